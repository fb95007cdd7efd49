"""Peak resident memory and wall time of each stage of ``npuq run``.

Runs ``npuq run`` as a child process with the given arguments, samples the child's resident
memory (``VmRSS`` of /proc/PID/status) every 0.2 s, and splits the samples by the stage lines
the run prints on stderr (``[3/10] quantize: ...``). Writes JSON with, per stage, its seconds
and the highest RSS sampled while it ran, and the whole run's peak (``VmHWM``, the kernel's own
high-water mark, which no sampling interval can miss):

    .venv/bin/python bench/run_memory.py --json out/bench/run_memory.json -- \\
        --model qwen2.5-coder-0.5b --out out/bench/qwen05-run --eval-tokens 4096

Everything after ``--`` goes to ``npuq run`` unchanged. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

STAGE_LINE = re.compile(r"^\[(\d+)/(\d+)\] ([\w-]+):")


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def measure(run_args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "npuq.cli", "run", *run_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1)
    stages: list[dict] = []  # name, start, peak_kib
    hwm = last = 0
    lock = threading.Lock()
    done = threading.Event()

    def sample() -> None:
        nonlocal hwm, last
        while not done.is_set():
            rss = _status_kib(proc.pid, "VmRSS")
            peak = _status_kib(proc.pid, "VmHWM")
            with lock:
                if peak:
                    hwm = max(hwm, peak)
                if rss:
                    last = rss
                if rss and stages:
                    stages[-1]["peak_kib"] = max(stages[-1]["peak_kib"], rss)
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    tail: list[str] = []
    for line in proc.stderr:
        sys.stderr.write(line)
        tail = (tail + [line])[-20:]
        m = STAGE_LINE.match(line)
        if m:
            with lock:
                # a stage starts at the memory the last one left (a short stage may see no sample)
                stages.append({"stage": m.group(3), "start": time.monotonic() - start, "peak_kib": last})
    rc = proc.wait()
    done.set()
    thread.join()
    total = time.monotonic() - start
    for i, s in enumerate(stages):
        end = stages[i + 1]["start"] if i + 1 < len(stages) else total
        s["seconds"] = round(end - s.pop("start"), 2)
        s["peak_rss_gib"] = round(s.pop("peak_kib") / 2**20, 2)
    if rc != 0:
        raise SystemExit(f"npuq run failed (exit {rc}):\n{''.join(tail)}")
    return {"command": cmd[2:], "seconds": round(total, 1), "peak_rss_gib": round(hwm / 2**20, 2), "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="out/bench/run_memory.json", help="where to write the result")
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then the arguments of npuq run")
    args = ap.parse_args()
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    result = measure(run_args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
