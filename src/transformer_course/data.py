"""The course's datasets: one registry, checksummed files, offline mirrors.

A file is looked up in this order:

1. the mirror folder named by `$TRANSFORMER_COURSE_DATA`, laid out as `<dataset>/<file>`;
2. the user cache (`$XDG_CACHE_HOME/transformer_course` or `~/.cache/transformer_course`);
3. the public URL, downloaded into the cache.

Every file is checked against its sha256 before use, so a corrupt mirror, a half-finished
download or a changed upstream file is refused with an error that says how to fix it.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

MIRROR_ENV = "TRANSFORMER_COURSE_DATA"
DOWNLOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset: where it comes from and what its bytes must hash to."""

    dataset: str
    name: str
    url: str
    sha256: str
    size: int
    member: str | None = None  # the file's path inside the zip archive at `url`, if any


REGISTRY: dict[str, dict[str, DataFile]] = {}


def _register(*files: DataFile) -> None:
    for file in files:
        REGISTRY.setdefault(file.dataset, {})[file.name] = file


_register(
    DataFile(
        "tinyshakespeare",
        "input.txt",
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        1115394,
    ),
    DataFile(
        "en-es",
        "spa.txt",
        "http://storage.googleapis.com/download.tensorflow.org/data/spa-eng.zip",
        "6ec60e212f812ee3430f7568ea6f33b6fb080e32193c5952e8da0ee8ba45574c",
        8042772,
        member="spa-eng/spa.txt",
    ),
    DataFile(
        "wikitext-2",
        "wiki.valid.tokens",
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/valid.txt",
        "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        1121681,
    ),
    DataFile(
        "wikitext-2",
        "wiki.test.tokens",
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/test.txt",
        "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
        1256449,
    ),
    DataFile(
        "gpt2",
        "encoder.json",
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
        1042301,
    ),
    DataFile(
        "gpt2",
        "vocab.bpe",
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        456318,
    ),
)

# Names the loaders accept, mapped to (dataset, file).
TEXTS = {
    "tinyshakespeare": ("tinyshakespeare", "input.txt"),
    "wikitext-2-valid": ("wikitext-2", "wiki.valid.tokens"),
    "wikitext-2-test": ("wikitext-2", "wiki.test.tokens"),
}
TRANSLATIONS = {"spa-eng": ("en-es", "spa.txt")}


class DataError(RuntimeError):
    """A dataset file is missing, corrupt or could not be downloaded."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "transformer_course"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _lookup(dataset: str, name: str) -> DataFile:
    if dataset not in REGISTRY:
        raise KeyError(f"dataset: expected one of {sorted(REGISTRY)}, got {dataset!r}")
    if name not in REGISTRY[dataset]:
        raise KeyError(f"file: dataset {dataset!r} has {sorted(REGISTRY[dataset])}, got {name!r}")
    return REGISTRY[dataset][name]


def _download(file: DataFile, target: Path) -> None:
    """Download `file` to `target` atomically: a partial download never sits at `target`."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cannot create the cache folder {target.parent} for {file.dataset}/{file.name} "
            f"({exc.strerror or exc}). Set XDG_CACHE_HOME to a writable folder, or put the file "
            f"at <mirror>/{file.dataset}/{file.name} and set {MIRROR_ENV}=<mirror>."
        ) from exc
    try:
        with urllib.request.urlopen(file.url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            payload = response.read()
    except OSError as exc:
        raise DataError(
            f"could not download {file.dataset}/{file.name} from {file.url}: {exc}.\n"
            f"Offline? Put the file at <mirror>/{file.dataset}/{file.name} "
            f"and set {MIRROR_ENV}=<mirror>."
        ) from exc
    if file.member is not None:
        try:
            payload = zipfile.ZipFile(io.BytesIO(payload)).read(file.member)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DataError(
                f"{file.url}: expected a zip archive holding {file.member!r} ({exc})"
            ) from exc
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        actual = sha256_of(Path(tmp))
        if actual != file.sha256:
            raise DataError(
                f"downloaded {file.dataset}/{file.name} from {file.url} has sha256 {actual}, "
                f"expected {file.sha256}: the file changed upstream or the download is corrupt."
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fetch(dataset: str, name: str) -> Path:
    """The local path of a verified dataset file: mirror, then cache, then download."""
    file = _lookup(dataset, name)
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        candidate = Path(mirror).expanduser() / dataset / name
        if candidate.is_file():
            actual = sha256_of(candidate)
            if actual != file.sha256:
                raise DataError(
                    f"{candidate} has sha256 {actual}, expected {file.sha256}: the mirror's copy "
                    f"is corrupt or a different version. Replace it with the file from {file.url}."
                )
            return candidate
    cached = cache_dir() / dataset / name
    if cached.is_file():
        if sha256_of(cached) == file.sha256:
            return cached
        cached.unlink()  # corrupt or stale: fetch it again
    try:
        _download(file, cached)
    except DataError as exc:
        if mirror:
            raise DataError(
                f"{exc}\n(Also not found in the mirror {MIRROR_ENV}={mirror}.)"
            ) from exc
        raise
    return cached


def load_text(name: str = "tinyshakespeare") -> str:
    """A whole text corpus as one string: "tinyshakespeare", "wikitext-2-valid" or
    "wikitext-2-test"."""
    if name not in TEXTS:
        raise KeyError(f"name: expected one of {sorted(TEXTS)}, got {name!r}")
    return fetch(*TEXTS[name]).read_text(encoding="utf-8")


def load_translation_pairs(name: str = "spa-eng") -> list[tuple[str, str]]:
    """Sentence pairs `(source, target)` of a translation corpus, in file order."""
    if name not in TRANSLATIONS:
        raise KeyError(f"name: expected one of {sorted(TRANSLATIONS)}, got {name!r}")
    path = fetch(*TRANSLATIONS[name])
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) < 2:
            raise DataError(f"{path}:{number}: expected 'source<TAB>target', got {line!r}")
        pairs.append((fields[0], fields[1]))
    return pairs
