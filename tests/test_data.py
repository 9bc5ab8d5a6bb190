"""The data layer: mirror lookup, real HTTP download into the cache, checksums, clear errors.

The download tests serve the shared data folder over HTTP on 127.0.0.1, so the real
`urllib` path runs end to end without the internet.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import os
import threading
import zipfile
from pathlib import Path

import pytest

from transformer_course import data
from transformer_course.tokenization import load_gpt2_tokenizer

MIRROR = Path(
    os.environ.get(data.MIRROR_ENV, Path(__file__).resolve().parents[2] / "shared" / "data")
)
pytestmark = pytest.mark.skipif(
    not (MIRROR / "tinyshakespeare" / "input.txt").is_file(),
    reason=f"needs the data mirror ({data.MIRROR_ENV}) with tinyshakespeare/input.txt",
)


@pytest.fixture
def server(tmp_path):
    """An HTTP server on 127.0.0.1 serving a folder; yields (folder, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args):
        QuietHandler.requests.append(self.path)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """No mirror, an empty cache of our own."""
    monkeypatch.delenv(data.MIRROR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "transformer_course"


def serve(monkeypatch, file: data.DataFile, url: str) -> data.DataFile:
    """Point the registry entry for `file` at `url` for the length of a test."""
    moved = dataclasses.replace(file, url=url)
    monkeypatch.setitem(data.REGISTRY[file.dataset], file.name, moved)
    return moved


def test_mirror_files_match_the_registry(monkeypatch):
    monkeypatch.setenv(data.MIRROR_ENV, str(MIRROR))
    text = data.load_text("tinyshakespeare")
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    assert len(text) == 1115394
    pairs = data.load_translation_pairs("spa-eng")
    assert len(pairs) == 118964
    assert pairs[:2] == [("Go.", "Ve."), ("Go.", "Vete.")]


def test_download_over_http_is_verified_and_cached(server, offline_cache, monkeypatch):
    root, base = server
    (root / "input.txt").write_bytes((MIRROR / "tinyshakespeare" / "input.txt").read_bytes())
    serve(monkeypatch, data.REGISTRY["tinyshakespeare"]["input.txt"], f"{base}/input.txt")
    QuietHandler.requests.clear()

    assert data.load_text("tinyshakespeare").startswith("First Citizen:")
    cached = offline_cache / "tinyshakespeare" / "input.txt"
    assert cached.is_file() and QuietHandler.requests == ["/input.txt"]
    assert [p.name for p in cached.parent.iterdir()] == ["input.txt"]  # no partial files left

    data.load_text("tinyshakespeare")  # second call is served from the cache
    assert QuietHandler.requests == ["/input.txt"]


def test_download_from_a_zip_archive(server, offline_cache, monkeypatch):
    root, base = server
    with zipfile.ZipFile(root / "spa-eng.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.write(MIRROR / "en-es" / "spa.txt", "spa-eng/spa.txt")
    serve(monkeypatch, data.REGISTRY["en-es"]["spa.txt"], f"{base}/spa-eng.zip")
    assert data.load_translation_pairs()[4] == ("Hi.", "Hola.")


def test_corrupt_download_is_refused_and_never_cached(server, offline_cache, monkeypatch):
    root, base = server
    original = (MIRROR / "tinyshakespeare" / "input.txt").read_bytes()
    (root / "input.txt").write_bytes(original.replace(b"Citizen", b"Citizan", 1))
    serve(monkeypatch, data.REGISTRY["tinyshakespeare"]["input.txt"], f"{base}/input.txt")
    with pytest.raises(data.DataError, match="sha256"):
        data.load_text("tinyshakespeare")
    folder = offline_cache / "tinyshakespeare"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_interrupted_download_in_cache_is_not_trusted(server, offline_cache, monkeypatch):
    root, base = server
    original = (MIRROR / "tinyshakespeare" / "input.txt").read_bytes()
    (root / "input.txt").write_bytes(original)
    cached = offline_cache / "tinyshakespeare" / "input.txt"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(original[:1000])  # what a killed, non-atomic download would leave
    serve(monkeypatch, data.REGISTRY["tinyshakespeare"]["input.txt"], f"{base}/input.txt")
    assert len(data.load_text("tinyshakespeare")) == len(original)
    assert cached.read_bytes() == original


def test_missing_file_says_how_to_fix_it(server, offline_cache, monkeypatch):
    _, base = server
    serve(monkeypatch, data.REGISTRY["tinyshakespeare"]["input.txt"], f"{base}/nowhere.txt")
    with pytest.raises(data.DataError, match=data.MIRROR_ENV) as info:
        data.load_text("tinyshakespeare")
    assert "tinyshakespeare/input.txt" in str(info.value)


def test_corrupt_mirror_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("not Shakespeare")
    monkeypatch.setenv(data.MIRROR_ENV, str(tmp_path))
    with pytest.raises(data.DataError, match="corrupt"):
        data.load_text("tinyshakespeare")


def test_unknown_names_are_errors():
    with pytest.raises(KeyError, match="tinyshakespeare"):
        data.load_text("shakespeare")
    with pytest.raises(KeyError, match="spa-eng"):
        data.load_translation_pairs("eng-fra")


def test_bad_archive_is_refused(server, offline_cache, monkeypatch):
    root, base = server
    with zipfile.ZipFile(root / "wrong.zip", "w") as archive:
        archive.writestr("other.txt", "x")
    serve(monkeypatch, data.REGISTRY["en-es"]["spa.txt"], f"{base}/wrong.zip")
    with pytest.raises(data.DataError, match="spa-eng/spa.txt"):
        data.load_translation_pairs()


def test_gpt2_tokenizer_files_are_openais(monkeypatch):
    """The registry names the URLs tiktoken's `gpt2` encoding reads; the mirror's copies verify."""
    if not (MIRROR / "gpt2" / "vocab.bpe").is_file():
        pytest.skip("the data mirror has no gpt2/ folder")
    monkeypatch.setenv(data.MIRROR_ENV, str(MIRROR))
    for name in ("encoder.json", "vocab.bpe"):
        file = data.REGISTRY["gpt2"][name]
        assert file.url == f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
        assert data.fetch("gpt2", name).stat().st_size == file.size
    assert load_gpt2_tokenizer().decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_a_cache_folder_that_cannot_be_made_says_what_to_set(tmp_path, monkeypatch):
    """XDG_CACHE_HOME under a file: no raw NotADirectoryError, the data layer's own error."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.delenv(data.MIRROR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    with pytest.raises(data.DataError, match="cannot create the cache folder") as info:
        data.load_text("tinyshakespeare")
    assert "XDG_CACHE_HOME" in str(info.value) and data.MIRROR_ENV in str(info.value)
