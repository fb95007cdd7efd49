"""Two runs on one --out folder: while a run holds the folder (its RunDir), a second ``npuq run``
(the real command line) is refused at once with exit status 2 and a one-line message naming the
folder and the first run's pid, and touches nothing; the first run then finishes with its
report intact. A run that is still alive is never reported as interrupted; once it is killed,
the next run reports its marker and proceeds.

Run 1 is a small process that holds a RunDir (a whole tiny ``npuq run`` takes over a minute on
a loaded machine; the full run is tests/pipeline/test_run_job.py's)."""

import json
import signal
import subprocess
import sys

import pytest

from npuq.errors import NpuqError
from npuq.pipeline.stages import MARKER, RunDir
from run_inputs import inputs, no_contention_verdict  # noqa: F401  (fixtures)
from run_inputs import run_argv as argv

# Run 1: holds the run folder argv[1]; builds stage "model", writes a report, says "held", and
# finishes when a line arrives. With argv[2] == "hang" it stays inside stage "quantize" instead.
HOLDER = r"""
import sys
from pathlib import Path
from npuq.fsio import write_json
from npuq.pipeline.stages import RunDir

out = Path(sys.argv[1])
run = RunDir(out)
run.stage("model", "k1", lambda folder: {"layers": 2})
write_json(out / "report.json", {"run": 1})
if sys.argv[2] == "hang":
    def build(folder):
        print("held", flush=True)
        sys.stdin.read()
    run.stage("quantize", "k1", build)
print("held", flush=True)
sys.stdin.readline()
run.finish()
print("finished", flush=True)
"""


@pytest.fixture
def start_run1():
    procs = []

    def start(out, mode="hold"):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), mode], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()  # it holds the lock from here on
        assert line == "held\n", (line, proc.stderr.read() if proc.poll() is not None else "")
        assert json.loads((out / MARKER).read_text())["pid"] == proc.pid
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() if p.is_file() else None for p in sorted(out.rglob("*"))}


def test_second_run_is_refused_while_the_first_holds_the_folder(inputs, tmp_path, start_run1):
    out = tmp_path / "job"
    run1 = start_run1(out)
    before = snapshot(out)

    run2 = subprocess.run([sys.executable, "-m", "npuq.cli", *argv(inputs, out)], capture_output=True, text=True,
                          timeout=300)
    assert run2.returncode == 2, run2.stderr
    errors = [line for line in run2.stderr.splitlines() if line.startswith("npuq: error:")]
    assert errors == [f"npuq: error: npuq run: {out} is being written by another npuq process (pid {run1.pid}); "
                      "wait for it to finish, or choose another --out"], run2.stderr
    assert "Traceback" not in run2.stderr and "interrupted" not in run2.stderr
    assert snapshot(out) == before  # not one file touched: marker, stage, report

    run1.stdin.write("\n")
    run1.stdin.flush()
    assert run1.stdout.readline() == "finished\n"
    assert run1.wait(timeout=30) == 0
    assert json.loads((out / "report.json").read_text()) == {"run": 1}
    assert not (out / MARKER).exists()
    with RunDir(out) as again:  # free once run 1 finished, and nothing to report
        assert again.interrupted is None


def test_a_live_run_is_not_reported_as_interrupted_a_killed_one_is(tmp_path, start_run1):
    out = tmp_path / "job"
    run1 = start_run1(out, "hang")  # inside stage "quantize"
    with pytest.raises(NpuqError, match=rf"another npuq process \(pid {run1.pid}\)"):
        RunDir(out)  # refused before it reads run 1's marker
    assert json.loads((out / MARKER).read_text())["stage"] == "quantize"

    run1.send_signal(signal.SIGKILL)
    run1.wait(timeout=30)
    with RunDir(out) as resumed:  # the OS dropped the lock with the process
        assert resumed.interrupted["pid"] == run1.pid and resumed.interrupted["stage"] == "quantize"
        _, result = resumed.stage("model", "k1", lambda folder: pytest.fail("a finished stage is reused"))
        assert result == {"layers": 2}
        resumed.finish()
    assert not (out / MARKER).exists() and not resumed.locked
