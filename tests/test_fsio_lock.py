"""One writer per output folder (npuq.fsio.folder_lock), between real processes: a second one is
refused at once with a message naming the folder and the holder's pid, or waits for it; the lock
goes away with its holder (an exception, Ctrl-C, SIGKILL) and lives in npuq's cache, keyed by the
folder's path, so it holds before the folder exists and across an atomic replacement of the folder,
and leaves nothing beside the folder."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from npuq.errors import NpuqError
from npuq.fsio import atomic_dir, folder_lock, lock_path

# Holds the lock on argv[1] until a line arrives on stdin ("raise": leave the block by an
# exception), then stays alive until stdin closes, so that only the block's own release can
# have freed the lock.
HOLDER = r"""
import sys
from npuq.fsio import folder_lock

try:
    with folder_lock(sys.argv[1], "holder"):
        print("held", flush=True)
        if sys.stdin.readline().strip() == "raise":
            raise ValueError("boom")
    print("released", flush=True)
except ValueError:
    print("raised", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.read()
"""

FIX = "wait for it to finish, or choose another --out"


@pytest.fixture
def start_holder():
    procs = []

    def start(folder):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line == "held\n", (line, proc.stderr.read() if proc.poll() is not None else "")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def tell(proc, line):
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def owner_file(folder):
    lock = lock_path(folder)
    return lock.with_name(lock.name + ".owner")


def test_one_lock_file_per_folder_in_the_cache(tmp_path):
    lock = lock_path(tmp_path / "out")
    assert lock.parent.name == "locks" and lock.name.startswith("out-") and not lock.is_relative_to(tmp_path)
    assert lock_path(tmp_path / "a" / ".." / "out") == lock  # the same folder, spelled differently
    assert lock_path(tmp_path / "other" / "out") != lock


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path, start_holder):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    assert not folder.exists()  # locked before it exists; taking the lock does not create it
    for _ in range(2):  # a refusal leaves the holder's lock and pid as they were
        with pytest.raises(NpuqError) as info, folder_lock(folder, "npuq quantize"):
            pytest.fail("the lock was taken twice")
        message = str(info.value)
        assert message.startswith(f"npuq quantize: {folder} is being written by another npuq process "
                                  f"(pid {holder.pid}); {FIX}"), message
        assert "\n" not in message
    assert holder.poll() is None


def test_waiting_acquires_once_the_holder_releases(tmp_path, start_holder, capsys):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    threading.Timer(1.0, tell, (holder, "release")).start()
    start = time.monotonic()
    with folder_lock(folder, "npuq export", wait=60):
        waited = time.monotonic() - start
        assert json.loads(owner_file(tmp_path / "out").read_text())["pid"] == os.getpid()
    assert 0.5 < waited < 50
    assert holder.stdout.readline() == "released\n"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "waiting up to 60 s" in err and f"(pid {holder.pid})" in err, err


def test_waiting_gives_up_after_the_time_given(tmp_path, start_holder, capsys):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    with pytest.raises(NpuqError, match=rf"still being written by another npuq process \(pid {holder.pid}\) "
                                        rf"after 0.5 s of waiting; {FIX}"):
        with folder_lock(folder, "npuq run", wait=0.5):
            pass
    assert "waiting up to 0.5 s" in capsys.readouterr().err


def test_a_sigkilled_holder_does_not_block(tmp_path, start_holder):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert owner_file(tmp_path / "out").exists()  # the dead holder's pid file stays; the OS lock did not
    with folder_lock(folder, "npuq run"):  # at once, without waiting
        assert json.loads(owner_file(tmp_path / "out").read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("how", ["raise", "ctrl-c"])
def test_a_block_left_by_an_exception_or_ctrl_c_releases_in_a_live_process(tmp_path, start_holder, how):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    if how == "raise":
        tell(holder, "raise")
        assert holder.stdout.readline() == "raised\n"
    else:
        holder.send_signal(signal.SIGINT)
        assert holder.stdout.readline() == "interrupted\n"
    assert holder.poll() is None  # still running: its release freed the lock, not its exit
    with folder_lock(folder, "npuq run"):
        pass
    assert not owner_file(tmp_path / "out").exists()  # released: no pid left behind


def test_an_exception_in_this_process_releases(tmp_path):
    folder = tmp_path / "out"
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc), folder_lock(folder, "npuq run"):
            raise exc()
    result = subprocess.run([sys.executable, "-c", "import sys\nfrom npuq.fsio import folder_lock\n"
                             "with folder_lock(sys.argv[1], 'other'): print('ok')", str(folder)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_the_same_process_is_refused_too_and_says_so(tmp_path):
    with folder_lock(tmp_path / "out", "npuq run"):
        with pytest.raises(NpuqError, match=rf"by this same process \(pid {os.getpid()}\)"):
            with folder_lock(tmp_path / "out", "npuq run"):
                pass


def test_the_lock_holds_across_an_atomic_replacement_of_the_folder(tmp_path, start_holder):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    for text in ("first", "second"):  # created, then replaced by a rename
        with atomic_dir(folder) as tmp:
            (tmp / "f.txt").write_text(text)
        with pytest.raises(NpuqError, match=f"pid {holder.pid}"), folder_lock(folder, "npuq run"):
            pass
    assert (folder / "f.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside the folder
