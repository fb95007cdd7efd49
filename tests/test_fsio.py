"""Folders npuq writes and reads back: names from manifests stay inside the folder, JSON
problems are one NpuqError, and Ctrl-C during the final renames never loses a folder."""

import os
import signal

import pytest

from npuq import fsio
from npuq.fsio import atomic_dir, read_json, resolve_inside
from npuq.errors import NpuqError


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "art"
    root.mkdir()
    (root / "decode.pt2").write_bytes(b"x")
    (root / "sub").mkdir()
    (root / "sub" / "p.pt2").write_bytes(b"y")
    (tmp_path / "secret.pt2").write_bytes(b"outside")
    return root


def test_names_inside_the_folder_resolve(folder):
    assert resolve_inside(folder, "decode.pt2", "m") == (folder / "decode.pt2").resolve()
    assert resolve_inside(folder, "sub/p.pt2", "m") == (folder / "sub" / "p.pt2").resolve()


@pytest.mark.parametrize("name, message", [
    ("../secret.pt2", "points outside"),
    ("sub/../../secret.pt2", "points outside"),
    ("sub/../decode.pt2", "points outside"),  # '..' is refused even where it would come back inside
    ("/etc/passwd", "points outside"),
    ("", "is not a file name"),
    ("a\x00b", "is not a file name"),
    (7, "is not a file name"),
    (None, "is not a file name"),
])
def test_names_leaving_the_folder_are_refused(folder, name, message):
    with pytest.raises(NpuqError, match=message):
        resolve_inside(folder, name, "manifest")


def test_symlinks_out_of_the_folder_are_refused(folder):
    (folder / "link.pt2").symlink_to(folder.parent / "secret.pt2")
    (folder / "linkdir").symlink_to(folder.parent)
    for name in ("link.pt2", "linkdir/secret.pt2"):
        with pytest.raises(NpuqError, match="is a link to .*secret.pt2, outside"):
            resolve_inside(folder, name, "manifest")
    (folder / "inner.pt2").symlink_to(folder / "decode.pt2")  # a link that stays inside is fine
    assert resolve_inside(folder, "inner.pt2", "m") == (folder / "decode.pt2").resolve()


@pytest.mark.parametrize("content, message", [
    (b"{not json", "is not valid JSON"),
    (b"\xff\xfe{}", "cannot be read as UTF-8"),
    (b"[" * 100_000, "unreadable JSON .*RecursionError"),
    (b"1" * 5000, "unreadable JSON .*ValueError"),  # more digits than int() converts
])
def test_read_json_problems_are_one_error(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_bytes(content)
    with pytest.raises(NpuqError, match=f"^what: .*{message}.*; the fix$"):
        read_json(path, "what", "the fix")
    with pytest.raises(NpuqError, match="is missing; the fix"):
        read_json(tmp_path / "none.json", "what", "the fix")


def _interrupt_on_call(monkeypatch, n):
    """Make the n-th os.replace deliver a real SIGINT to this process right after it runs."""
    real, calls = os.replace, []

    def replace(src, dst):
        real(src, dst)
        calls.append((str(src), str(dst)))
        if len(calls) == n:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(fsio.os, "replace", replace)
    return calls


@pytest.mark.parametrize("nth", [1, 2])
def test_ctrl_c_between_the_renames_keeps_a_whole_folder(tmp_path, monkeypatch, nth):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    calls = _interrupt_on_call(monkeypatch, nth)
    with pytest.raises(KeyboardInterrupt), atomic_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
    assert len(calls) == 2  # the swap finished although SIGINT came in the middle
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .tmp or .old left


def test_ctrl_c_while_writing_keeps_the_old_folder(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_dir(final) as tmp:
        (tmp / "new.txt").write_text("half")
        signal.raise_signal(signal.SIGINT)
    assert sorted(p.name for p in final.iterdir()) == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_files_written_private_come_out_as_ordinary_files(tmp_path):
    """safetensors and ONNX's external data create 0600 files; the finished folder has the
    modes of ordinary files (0666 less the umask), like the folder itself."""
    mask = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            fd = os.open(tmp / "weights.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a.txt").write_text("x")
            os.chmod(tmp / "sub" / "a.txt", 0o600)
    finally:
        os.umask(mask)
    assert (tmp_path / "out" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "out" / "sub" / "a.txt").stat().st_mode & 0o777 == 0o644
