"""Does the thread tuner pick (nearly) the fastest count? Compare it with an exhaustive oracle.

For each phase, on the real model: run the tuner as npuq does (early stop, 3 samples), then time
every candidate exhaustively (no early stop, 5 samples) in the same process. Report the
tuner's choice, the oracle's fastest count, how much slower the choice is than the oracle's
best (target: within 5 %), and the tuning time relative to a stated calibration workload:
calibrating ``--calib-tokens`` tokens in that phase (1024 decode steps, or 1024/N prefill
chunks) at the chosen count.

    .venv/bin/python bench/threads.py --json out/bench_threads.json
    taskset -c 0 .venv/bin/python bench/threads.py --json out/bench_threads_1cpu.json   # ceiling 1
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from npuq.fsio import write_json
from npuq.models import load_model
from npuq.threads import BUDGETED, EXHAUSTIVE, cpu_limits, cpu_model, tune
from npuq.runtime.workloads import phase_workload

TARGET = 0.05  # the choice may be at most 5 % slower than the oracle's fastest count


def bench_phase(workload, ceiling: int, calib_tokens: int) -> dict:
    default = torch.get_num_threads()
    tuned = tune(workload.run, ceiling, phase="", default_threads=default, settings=BUDGETED)
    oracle = tune(workload.run, ceiling, phase="", default_threads=default, settings=EXHAUSTIVE)
    timed = {n: s for n, s in zip(oracle.candidates, oracle.seconds) if s is not None}
    fastest = min(timed, key=timed.get)
    choice_seconds = timed.get(tuned.best)
    gap = None if choice_seconds is None else choice_seconds / timed[fastest] - 1
    calib_seconds = calib_tokens / workload.tokens_per_step * (choice_seconds or timed[fastest])
    return {
        "signature": workload.signature,
        "tokens_per_step": workload.tokens_per_step,
        "candidates": list(tuned.candidates),
        "tuner": {"best": tuned.best, "seconds": list(tuned.seconds), "stopped_early": list(tuned.stopped),
                  "tuning_seconds": tuned.tuning_seconds},
        "oracle": {"best": fastest, "seconds": list(oracle.seconds), "tuning_seconds": oracle.tuning_seconds},
        "choice_seconds_in_oracle": choice_seconds,
        "oracle_best_seconds": timed[fastest],
        "gap_vs_oracle": gap,
        "within_target": gap is not None and gap <= TARGET,
        "default_threads": default,
        "speedup_vs_default": None if oracle.default_seconds is None or not choice_seconds
        else oracle.default_seconds / choice_seconds,
        "calibration_workload": f"{calib_tokens} tokens at {workload.tokens_per_step} per step",
        "calibration_seconds": calib_seconds,
        "tuning_over_calibration": tuned.tuning_seconds / calib_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--phase", action="append", choices=("decode", "prefill", "calibrate"),
                   help="repeatable (default: decode and prefill)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=32)
    p.add_argument("--calib-tokens", type=int, default=1024, help="tokens of the reference calibration workload")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON ('-' for stdout)")
    args = p.parse_args(argv)

    limits = cpu_limits()
    loaded = load_model(args.model)
    report = {
        "host": {"cpu_model": cpu_model(), "affinity_cpus": limits.affinity, "cgroup_quota_cpus": limits.quota,
                 "ceiling": limits.ceiling, "torch": torch.__version__, "torch_default_threads": torch.get_num_threads()},
        "model": args.model, "context": args.context, "target_gap": TARGET, "phases": {},
    }
    start = time.perf_counter()
    for phase in args.phase or ["decode", "prefill"]:
        workload = phase_workload(loaded.model, phase, args.context, args.prefill_len if phase == "prefill" else None)
        r = bench_phase(workload, limits.ceiling, args.calib_tokens)
        report["phases"][phase] = r
        ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"  # noqa: E731
        print(f"{phase}: tuner {r['tuner']['best']} threads ({ms(r['choice_seconds_in_oracle'])} ms/step in the oracle run), "
              f"oracle {r['oracle']['best']} ({ms(r['oracle_best_seconds'])} ms), gap {100 * (r['gap_vs_oracle'] or 0):.1f} %, "
              f"tuning {r['tuner']['tuning_seconds']:.2f} s = {100 * r['tuning_over_calibration']:.2f} % of "
              f"{r['calibration_workload']} ({r['calibration_seconds']:.1f} s)", file=sys.stderr)
        print(f"  oracle ms/step by threads: " + ", ".join(
            f"{n}: {ms(s)}" for n, s in zip(r["candidates"], r["oracle"]["seconds"])), file=sys.stderr)
    report["bench_seconds"] = time.perf_counter() - start
    if args.json:
        write_json(args.json, report)
    return 0 if all(r["within_target"] for r in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
