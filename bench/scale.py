"""Memory and time of npuq on models of the sizes people deploy (docs/design.md §13).

No 3-8B weights ship in packages, so this writes random-weight Hugging Face folders at the real
configs of Qwen2.5-3B and Qwen2.5-7B (bf16, sharded safetensors with an index, as the hub
ships them; the Qwen2.5 tokenizer of the built-in Qwen2.5-Coder-0.5B), then runs npuq commands
on them as child processes under ``/usr/bin/time -v`` and records each one's wall time, peak
resident memory (the kernel's maximum RSS) and exit status:

    info            npuq info (config and tensor shapes only)
    eval-stream     npuq eval --model DIR --stream (one block resident at a time)
    eval-whole      npuq eval --model DIR (the whole float32 model: refused up front where it
                    cannot fit, with the figure, instead of being killed by the kernel)
    quantize        npuq quantize --model DIR --scheme 16a8w --calib-tokens 1024
                    --context 512 (--parts auto: in parts, streamed, where the model does not fit
                    whole), the artifact to out/scale/<size>-16a8w
    export          npuq export --artifact out/scale/<size>-16a8w --soc SM8650 (--shards auto:
                    shards of at most 3.5 GiB of weights), to out/scale/<size>-onnx
    eval-onnx       npuq eval --onnx out/scale/<size>-onnx (part by part)
    generate-onnx   npuq generate --onnx out/scale/<size>-onnx, 4 new tokens (the parts that fit
                    memory stay loaded, the others are read again at each step)
    quantize-4bit   npuq quantize --model DIR --scheme 16a4w_block (LPBQ, 4-bit weights)
                    --calib-tokens 1024 --context 512, to out/scale/<size>-16a4w_block; not in
                    the default runs

    .venv/bin/python bench/scale.py --sizes 3b,7b --json out/bench/scale.json

The folders go to ``out/scale/<size>`` (about 6 GB for 3B and 15 GB for 7B) and are reused by
later runs. The weights are random (normal, std 0.02; norm weights 1), so perplexities are
those of a random model: this bench measures resources, not accuracy. Set ``NPUQ_CACHE_DIR``
to keep its GGUF conversion of the tokenizer's model apart from yours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

# Hugging Face config.json values of the real checkpoints (Qwen/Qwen2.5-3B, Qwen/Qwen2.5-7B).
CONFIGS = {
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
COMMON = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
              rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151643,
              torch_dtype="bfloat16", use_sliding_window=False, attention_dropout=0.0)
SHARD_BYTES = 4 << 30  # the hub's usual 4-5 GB shards
STD = 0.02


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Qwen2 checkpoint keys and shapes (q/k/v biases; lm_head only when untied)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_folder(size: str, folder: Path) -> dict:
    """The random-weight folder of ``size``, shard by shard (peak: one shard), then the config,
    the index and the tokenizer; ``.complete`` last, so an interrupted write is redone."""
    from safetensors.torch import save_file

    if (folder / ".complete").is_file():
        return json.loads((folder / ".complete").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **CONFIGS[size]}
    shapes = tensor_shapes(cfg)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    for name, shape in shapes.items():
        if shards[-1] and sum(math.prod(s) * 2 for s in shards[-1].values()) + math.prod(shape) * 2 > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = shape
    weight_map, start = {}, time.perf_counter()
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shape, generator=generator) * STD).to(torch.bfloat16)
            weight_map[name] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        print(f"scale: {size} shard {k}/{len(shards)} written", file=sys.stderr, flush=True)
    total = sum(math.prod(s) for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_tokenizer(folder)
    facts = {"parameters": total, "bf16_bytes": total * 2, "shards": len(shards),
             "write_seconds": round(time.perf_counter() - start, 1)}
    (folder / ".complete").write_text(json.dumps(facts))
    return facts


def _write_tokenizer(folder: Path) -> None:
    from npuq.models import load_tokenizer

    load_tokenizer("qwen2.5-coder-0.5b").save_pretrained(folder)


def timed(cmd: list[str]) -> dict:
    """``cmd`` under /usr/bin/time -v: wall seconds, peak RSS, exit status, its JSON result."""
    start = time.monotonic()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.monotonic() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    result = None
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        pass
    errors = [line for line in proc.stderr.splitlines() if line.startswith("npuq: error")]
    return {"command": " ".join(cmd[2:]), "seconds": round(wall, 1),
            "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None, "returncode": proc.returncode,
            "error": errors[0] if errors else None, "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="3b,7b", help="comma-separated: 3b, 7b (default: both)")
    parser.add_argument("--root", default="out/scale", help="where the folders are written (default out/scale)")
    parser.add_argument("--eval-tokens", type=int, default=256, help="tokens scored by the eval runs (default 256)")
    parser.add_argument("--context", type=int, default=256, help="window of the eval runs (default 256)")
    parser.add_argument("--whole", default=None,
                        help="sizes whose eval-whole run is made (default: every size; a model that fits takes "
                             "its float32 size in memory)")
    parser.add_argument("--runs", default="info,eval-stream,eval-whole,quantize,export,eval-onnx,generate-onnx",
                        help="comma-separated runs to make (default: all; see above)")
    parser.add_argument("--parts", default="auto", help="--parts of the quantize run (default auto)")
    parser.add_argument("--json", default="out/bench/scale.json", help="where the result goes")
    args = parser.parse_args()
    chosen = set(args.runs.split(","))
    npuq = [sys.executable, "-m", "npuq.cli"]
    results = {"date": time.strftime("%Y-%m-%d"), "cpus": len(os.sched_getaffinity(0)), "sizes": {}}
    for size in args.sizes.split(","):
        folder = Path(args.root) / size
        facts = write_folder(size, folder)
        runs = {}
        if "info" in chosen:
            runs["info"] = timed([*npuq, "info", "--model", str(folder), "--json", "-"])
        evaluate = [*npuq, "eval", "--model", str(folder), "--max-tokens", str(args.eval_tokens),
                    "--context", str(args.context), "--json", "-"]
        if "eval-stream" in chosen:
            runs["eval-stream"] = timed([*evaluate, "--stream"])
        if "eval-whole" in chosen and (args.whole is None or size in args.whole.split(",")):
            runs["eval-whole"] = timed(evaluate)
        for run, scheme in (("quantize", "16a8w"), ("quantize-4bit", "16a4w_block")):
            if run not in chosen:
                continue
            artifact = Path(args.root) / f"{size}-{scheme}"
            runs[run] = timed([*npuq, "quantize", "--model", str(folder), "--scheme", scheme,
                               "--calib-tokens", "1024", "--context", "512", "--parts", args.parts,
                               "--out", str(artifact), "--force", "--json", "-"])
            if runs[run]["returncode"] == 0:
                files = [f for f in artifact.rglob("*") if f.is_file()]
                runs[run]["artifact_gib"] = round(sum(f.stat().st_size for f in files) / 2**30, 2)
                runs[run]["largest_file_gib"] = round(max(f.stat().st_size for f in files) / 2**30, 2)
        artifact, exported = Path(args.root) / f"{size}-16a8w", Path(args.root) / f"{size}-onnx"
        if "export" in chosen:
            runs["export"] = timed([*npuq, "export", "--artifact", str(artifact), "--soc", "SM8650", "--out",
                                    str(exported), "--force", "--json", "-"])
            if runs["export"]["returncode"] == 0:
                files = [f for f in exported.rglob("*") if f.is_file()]
                runs["export"]["export_gib"] = round(sum(f.stat().st_size for f in files) / 2**30, 2)
                runs["export"]["largest_file_gib"] = round(max(f.stat().st_size for f in files) / 2**30, 2)
        if "eval-onnx" in chosen:
            runs["eval-onnx"] = timed([*npuq, "eval", "--onnx", str(exported), "--max-tokens", str(args.eval_tokens),
                                       "--json", "-"])
        if "generate-onnx" in chosen:
            runs["generate-onnx"] = timed([*npuq, "generate", "--onnx", str(exported), "--prompt",
                                           "def fibonacci(n):", "--max-new-tokens", "4", "--json", "-"])
        per_b = facts["parameters"] / 1e9
        for run in runs.values():
            run["seconds_per_billion_parameters"] = round(run["seconds"] / per_b, 1)
            run["peak_gib_per_billion_parameters"] = round((run["peak_rss_gib"] or 0) / per_b, 2)
            print(f"scale: {size} {run['command'][:60]}: {run['seconds']} s, {run['peak_rss_gib']} GiB, "
                  f"rc {run['returncode']}", file=sys.stderr, flush=True)
        results["sizes"][size] = {"folder": str(folder), **facts, "runs": runs}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
