"""Refresh the copy of MathJax that the book serves itself, so math renders with no network.

The book loads `_static/mathjax/tex-chtml-full.js` (see `mathjax_path` in `_config.yml`). That
file and the fonts it needs are committed under `book/_static_offline/mathjax/`, together with
MathJax's LICENSE (Apache-2.0); this script replaces them with the files of one npm release:

    python scripts/vendor_mathjax.py            # needs `npm` and access to the npm registry
    python scripts/vendor_mathjax.py --check    # exit 1 if the committed copy is incomplete

Only the single-file TeX bundle (every TeX extension built in, so nothing is fetched on demand)
and the CommonHTML woff-v2 fonts are kept: about 1.7 MB instead of the package's 24 MB.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "book" / "_static_offline" / "mathjax"
VERSION = "3.2.2"
BUNDLE = "tex-chtml-full.js"
FONTS = Path("output") / "chtml" / "fonts" / "woff-v2"
# Fonts CommonHTML may request; the bundle loads each one only when a page uses it.
EXPECTED_FONTS = 23


def committed_files() -> list[Path]:
    return [TARGET / BUNDLE, TARGET / "LICENSE", *sorted((TARGET / FONTS).glob("*.woff"))]


def check() -> int:
    missing = [p for p in (TARGET / BUNDLE, TARGET / "LICENSE") if not p.is_file()]
    fonts = sorted((TARGET / FONTS).glob("*.woff"))
    if missing or len(fonts) != EXPECTED_FONTS:
        print(
            f"incomplete MathJax copy in {TARGET.relative_to(ROOT)}: missing {missing or 'none'}, "
            f"{len(fonts)} of {EXPECTED_FONTS} fonts; run `python scripts/vendor_mathjax.py`"
        )
        return 1
    size = sum(p.stat().st_size for p in committed_files())
    print(f"MathJax {VERSION}: {len(committed_files())} files, {size / 1e6:.2f} MB")
    return 0


def vendor() -> int:
    if shutil.which("npm") is None:
        print("npm not found: install Node.js (it ships npm) and run this script again")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["npm", "pack", f"mathjax@{VERSION}", "--silent"],
            cwd=tmp,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with tarfile.open(Path(tmp) / f"mathjax-{VERSION}.tgz") as archive:
            # The "data" filter refuses links and paths outside `tmp` (Python >= 3.10.12).
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(tmp, **safe)
        package = Path(tmp) / "package"
        if TARGET.exists():
            shutil.rmtree(TARGET)
        (TARGET / FONTS).mkdir(parents=True)
        shutil.copy2(package / "LICENSE", TARGET / "LICENSE")
        shutil.copy2(package / "es5" / BUNDLE, TARGET / BUNDLE)
        for font in (package / "es5" / FONTS).glob("*.woff"):
            shutil.copy2(font, TARGET / FONTS / font.name)
    return check()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the committed copy")
    args = parser.parse_args(argv)
    return check() if args.check else vendor()


if __name__ == "__main__":
    sys.exit(main())
