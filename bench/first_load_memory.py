"""Peak memory of a model's first load (the GGUF conversion into npuq's cache), split by kind.

Loads ``--model`` in a child process with an empty GGUF cache and samples the child's
``/proc/PID/status`` every 50 ms: ``RssAnon`` (memory only the process holds: decoded
tensors, copies) and ``RssFile`` (mapped file pages: the cached weights the model maps, page
cache the kernel can reclaim), and their sum ``VmRSS``. ``--src`` runs another checkout's
sources, so two versions compare in one run (docs/design.md §13):

    .venv/bin/python bench/first_load_memory.py --model qwen2.5-coder-0.5b \\
        --src /path/to/old/src --src src --json out/bench/first_load_memory.json

A built-in model's joined GGUF is reused from the current cache (hard-linked), so only the
conversion is measured. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ("RssAnon", "RssFile", "VmRSS")


def first_load(model: str, src: str) -> dict:
    from npuq.fsio import user_cache_dir

    cache = Path(tempfile.mkdtemp(prefix="npuq-first-load-"))
    try:
        builtin = user_cache_dir() / "builtin"
        if builtin.is_dir():
            (cache / "builtin").mkdir()
            for f in builtin.iterdir():
                os.link(f, cache / "builtin" / f.name)
        env = dict(os.environ, NPUQ_CACHE_DIR=str(cache), PYTHONPATH=str(Path(src).resolve()))
        code = f"from npuq.models import load_model; load_model({model!r})"
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", code], env=env)
        peak = dict.fromkeys(FIELDS, 0)
        while proc.poll() is None:
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    key = line.split(":")[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.05)
        return {"src": src, "returncode": proc.returncode, "seconds": round(time.monotonic() - start, 1),
                **{f"peak_{k}_gib": round(v / 2**20, 2) for k, v in peak.items()}}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--src", action="append", help="a checkout's src folder (repeat to compare; default: src)")
    parser.add_argument("--json", default="out/bench/first_load_memory.json")
    args = parser.parse_args()
    runs = [first_load(args.model, src) for src in args.src or ["src"]]
    result = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "runs": runs}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
