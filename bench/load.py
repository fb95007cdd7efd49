"""Model load time: the first (cold) load of a GGUF, which converts it and fills the GGUF cache,
against the second, which reads the cache; each in a fresh Python process.

Every load runs in a subprocess with ``NPUQ_CACHE_DIR`` set to a new temporary folder (so the
user's cache is neither read nor changed). Per run: wall time of the whole process, time to
import torch, time of ``load_model`` alone, whether it came from the cache, and the child's peak
RSS; the parent also records ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` (the peak of all
children so far) after each, and each child its RssAnon / RssFile once loaded (a cached load's
weights are pages of the memory-mapped cache file, not a copy). ``uncached`` is a load with ``NPUQ_NO_MODEL_CACHE=1``, the
behaviour before the cache (every load converts); ``cli`` times ``npuq info`` on the warm cache.

    .venv/bin/python bench/load.py                      # writes out/bench/load.json and prints it
    .venv/bin/python bench/load.py --repeats 5 --no-uncached
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from npuq.models import load_model
from npuq.models.gguf_cache import CachedHFConfig
t2 = time.perf_counter()
loaded = load_model(sys.argv[1])
t3 = time.perf_counter()
print(json.dumps({
    "import_torch_s": t1 - t0, "import_npuq_s": t2 - t1, "load_model_s": t3 - t2, "in_process_s": t3 - t0,
    "from_cache": isinstance(loaded.hf_config, CachedHFConfig),
    "parameters": loaded.info().parameters,
    "imported_transformers": "transformers" in sys.modules,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    # now, after the load: anonymous memory vs pages of mapped files (the cache's weights; reclaimable)
    **{f"{k.lower()}_mib": int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
       if k in ("RssAnon", "RssFile")},
}))
"""


def children_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def run_child(model: str, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"load of {model} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    warnings = [line for line in out.stderr.splitlines() if "npuq: warning" in line]
    return {"wall_s": wall, **result, "npuq_warnings": warnings, "children_peak_rss_mib": children_peak_mib()}


def run_cli(model: str, env: dict[str, str]) -> dict:
    npuq = Path(sys.executable).with_name("npuq")
    cmd = [str(npuq)] if npuq.exists() else [sys.executable, "-m", "npuq.cli"]
    start = time.perf_counter()
    out = subprocess.run([*cmd, "info", "--model", model], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"npuq info --model {model} failed:\n{out.stderr[-4000:]}")
    return {"command": f"npuq info --model {model}", "wall_s": wall, "children_peak_rss_mib": children_peak_mib()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3, help="second (cached) loads to time; the median is reported")
    parser.add_argument("--no-uncached", action="store_true", help="skip the NPUQ_NO_MODEL_CACHE=1 baseline load")
    parser.add_argument("--json", default=str(ROOT / "out" / "bench" / "load.json"))
    args = parser.parse_args(argv)

    cache = Path(tempfile.mkdtemp(prefix="npuq-bench-load-"))
    env = {k: v for k, v in os.environ.items() if k != "NPUQ_NO_MODEL_CACHE"}
    env["NPUQ_CACHE_DIR"] = str(cache)
    report: dict = {
        "model": args.model, "cpus": os.cpu_count(), "load_average_before": list(os.getloadavg()),
        "python": sys.version.split()[0],
    }
    try:
        shutil.rmtree(cache / "gguf", ignore_errors=True)  # cold: nothing cached
        cold = run_child(args.model, env)
        assert not cold["from_cache"], "the cold load was served from a cache"
        warm = [run_child(args.model, env) for _ in range(max(1, args.repeats))]
        assert all(w["from_cache"] for w in warm), "a second load was not served from the cache"
        cli = run_cli(args.model, env)
        uncached = None if args.no_uncached else run_child(args.model, {**env, "NPUQ_NO_MODEL_CACHE": "1"})
        entry_bytes = sum(p.stat().st_size for p in (cache / "gguf").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    def median(key: str) -> float:
        return statistics.median(w[key] for w in warm)

    report.update({
        "first": cold,
        "second": warm,
        "second_median": {key: median(key) for key in ("wall_s", "import_torch_s", "load_model_s", "in_process_s",
                                                        "peak_rss_mib")},
        "ratio_first_to_second_load_model": cold["load_model_s"] / median("load_model_s"),
        "ratio_first_to_second_wall": cold["wall_s"] / median("wall_s"),
        "cli_info_cached": cli,
        "uncached": uncached,
        "cache_entry_bytes": entry_bytes,
        "children_peak_rss_mib": children_peak_mib(),
        "load_average_after": list(os.getloadavg()),
    })
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    from npuq.fsio import write_json

    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    second = report["second_median"]
    print(f"\nfirst load: {cold['wall_s']:.2f} s wall ({cold['load_model_s']:.2f} s in load_model); "
          f"second: {second['wall_s']:.2f} s wall ({second['load_model_s']:.2f} s in load_model, "
          f"{second['import_torch_s']:.2f} s importing torch); ratio {report['ratio_first_to_second_load_model']:.0f}x "
          f"(load_model), {report['ratio_first_to_second_wall']:.1f}x (wall); npuq info cached {cli['wall_s']:.2f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
