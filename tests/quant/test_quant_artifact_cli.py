"""The artifact folder: atomic, refused when it exists without --force, read back as a LogitsFn;
and ``npuq quantize`` end to end on a tiny Hugging Face folder."""

import json
import os

import pytest
import torch

from npuq.calibrate.encodings import kv_io_qparams
from npuq.cli import main
from npuq.errors import NpuqError
from npuq.testing.tiny import save_tiny_hf_folder, tiny_decoder
from npuq.quantize.artifact import ModelInfo, load_artifact, save_artifact
from npuq.quantize.pt2e import quantize_model
from npuq.quant.recipe import RECIPES

CONTEXT = 16
RESULT_KEYS = {"scheme", "calibration_mode", "calibration_tokens", "calibration_seconds", "prepare_seconds",
               "convert_seconds", "total_seconds", "threads", "artifact"}


@pytest.fixture(scope="module")
def quantized():
    _, model = tiny_decoder("llama", seed=6, max_context=CONTEXT)
    ids = torch.randint(3, model.config.vocab_size, (2 * CONTEXT,), generator=torch.Generator().manual_seed(0))
    return quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT, prefill_len=4)


def test_save_load_round_trip(tmp_path, quantized):
    out = save_artifact(quantized, tmp_path / "art", model=ModelInfo("tiny", "tiny-source", "0" * 64),
                        calibration={"corpus": "test"})
    assert sorted(os.listdir(out)) == ["config.json", "decode.json", "encodings.json", "prefill.json",
                                       "scoring.json", "weights.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temporary folder left behind
    loaded = load_artifact(out)
    tokens = torch.randint(3, quantized.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.logits(tokens), quantized.logits(tokens))
    as_saved = load_artifact(out, fold_constants=False)  # weights dequantized at every call: same numbers
    assert torch.equal(as_saved.logits(tokens), quantized.logits(tokens))
    assert any(n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default for n in as_saved.decode.graph.nodes)
    assert not any(n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default for n in loaded.decode.graph.nodes)
    assert kv_io_qparams(as_saved.decode, 2) == kv_io_qparams(quantized.decode, 2)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "tiny" and config["calibration"] == {"corpus": "test"}
    assert config["context"] == CONTEXT and config["optimize"] is None
    assert config["programs"]["prefill"]["ar_len"] == 4
    assert {"npuq", "torch", "torchao"} <= set(config["versions"])
    assert config["recipe"]["default"] == "16a8w" and config["recipe_plan"]


def test_encodings_json_layout(tmp_path, quantized):
    out = save_artifact(quantized, tmp_path / "art")
    enc = json.loads((out / "encodings.json").read_text())
    acts = {e["name"]: e for e in enc["activation_encodings"]}
    params = {e["name"]: e for e in enc["param_encodings"]}
    w = params["layers.0.self_attn.q_proj.weight"]
    assert (w["dtype"], w["bw"], w["enc_type"], w["is_sym"], w["axis"]) == ("int8", 8, "PER_CHANNEL", True, 0)
    assert len(w["scale"]) == 64 and set(w["offset"]) == {0}
    assert all(abs(mx - 127 * s) < 1e-9 * max(1, mx) for mx, s in zip(w["max"], w["scale"]))
    emb = acts["embedding"]
    assert (emb["dtype"], emb["bw"], emb["is_sym"]) == ("uint16", 16, False)
    # offset is the negated zero point: min = scale · offset, max = scale · (65535 + offset)
    assert emb["min"][0] == pytest.approx(emb["scale"][0] * emb["offset"][0])
    assert emb["max"][0] == pytest.approx(emb["scale"][0] * (65535 + emb["offset"][0]))
    table = params["embed_tokens.weight"]
    assert (table["scale"], table["offset"]) == (emb["scale"], emb["offset"])  # gather shares the table's encoding
    matmul_inputs = [e for name, e in acts.items() if "->matmul" in name]
    assert matmul_inputs and all(e["dtype"] == "int16" and set(e["offset"]) == {0} for e in matmul_inputs)


def test_existing_folder_needs_force(tmp_path, quantized):
    target = tmp_path / "art"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(NpuqError, match="already exists: pass --force"):
        save_artifact(quantized, target)
    assert (target / "old.txt").exists()
    save_artifact(quantized, target, force=True)
    assert not (target / "old.txt").exists() and (target / "decode.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_load_rejects_non_artifacts(tmp_path):
    with pytest.raises(NpuqError, match="not an npuq artifact"):
        load_artifact(tmp_path)


# --------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = save_tiny_hf_folder(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, words=200)
    words = [f"w{i}" for i in range(200)]
    text = folder.parent / "calib.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(words[int(i)] for i in torch.randint(0, 200, (300,), generator=g)))
    return folder, text


def test_cli_quantize_end_to_end(tmp_path, hf_folder, capsys, monkeypatch):
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))  # the thread tuner caches its result here
    folder, text = hf_folder
    out, result_file = tmp_path / "q", tmp_path / "r.json"
    argv = ["quantize", "--model", str(folder), "--scheme", "16a4w", "--calib-corpus", f"file:{text}",
            "--calib-tokens", "40", "--context", str(CONTEXT), "--out", str(out), "--json", str(result_file),
            "--recipe-summary"]
    assert main(argv) == 0
    result = json.loads(result_file.read_text())
    assert RESULT_KEYS <= set(result)
    assert (result["scheme"], result["calibration_mode"], result["calibration_tokens"]) == ("16a4w", "onepass", 40)
    assert result["seq_mse"] is result["gram_seconds"] is None  # no SeqMSE/GPTQ walk
    assert "layers.1.mlp.down_proj" in capsys.readouterr().out  # the recipe summary
    config = json.loads((out / "config.json").read_text())
    assert len(config["model"]["weights_sha256"]) == 64 and config["calibration"]["corpus"] == f"file:{text}"
    plan = config["calibration"]["thread_plan"]["calibrate"]  # --num-threads 0: measured for the calibrate phase
    assert plan["source"] in ("auto", "cache") and plan["threads"] == result["threads"]
    assert result["thread_plan"] == config["calibration"]["thread_plan"]
    loaded = load_artifact(out)
    logits = loaded.logits(torch.tensor([[1, 5, 9, 12]]))
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()

    # the same --out again: refused before any work, unless --force
    assert main(argv) == 2
    assert "already exists: pass --force" in capsys.readouterr().err


def test_cli_quantize_calib_offset(tmp_path, hf_folder, capsys):
    """--calib-offset N calibrates on the text N tokens later: config.json records the offset and
    the activation encodings come out different from offset 0's; an offset past the text's end is
    refused with the fix, before anything is written."""
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--calib-corpus", f"file:{text}", "--calib-tokens", "40",
            "--context", str(CONTEXT), "--num-threads", "1"]
    encodings = {}
    for offset in (0, 200):
        out = tmp_path / f"q{offset}"
        assert main([*base, "--calib-offset", str(offset), "--out", str(out)]) == 0
        config = json.loads((out / "config.json").read_text())
        assert (config["calibration"]["offset"], config["calibration"]["tokens"]) == (offset, 40)
        encodings[offset] = json.loads((out / "encodings.json").read_text())["activation_encodings"]
    assert len(encodings[0]) == len(encodings[200]) and encodings[0] != encodings[200]
    assert main([*base, "--calib-offset", "100000", "--out", str(tmp_path / "past")]) == 2
    assert "--calib-offset 100000 skips the whole calib split" in capsys.readouterr().err
    assert not (tmp_path / "past").exists()


def test_cli_quantize_calib_sampling(tmp_path, hf_folder):
    """--calib-sampling spread calibrates on windows from across the calib split: config.json
    records it, and the activation encodings differ from a contiguous draw of as many tokens."""
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--calib-corpus", f"file:{text}", "--calib-tokens", "40",
            "--context", str(CONTEXT), "--num-threads", "1"]
    encodings = {}
    for sampling in ("contiguous", "spread"):
        out = tmp_path / sampling
        assert main([*base, "--calib-sampling", sampling, "--out", str(out)]) == 0
        config = json.loads((out / "config.json").read_text())
        assert (config["calibration"]["sampling"], config["calibration"]["tokens"]) == (sampling, 40)
        encodings[sampling] = json.loads((out / "encodings.json").read_text())["activation_encodings"]
    assert encodings["contiguous"] != encodings["spread"]


def test_cli_quantize_recovery_draw_follows_the_widest_layer(tmp_path, hf_folder, monkeypatch):
    """With SeqMSE/GPTQ and neither --calib-tokens nor --calib-sampling, the stage draws the
    calibration by the model's widest linear-layer input: this model's (under 4096) gets 4096
    tokens in one stretch (this file is shorter: all of it); the same model read as wider than
    4096 gets RECOVERY_CALIB_DRAW, 8192 spread (again all of the file), and a flag given replaces its half."""
    from npuq.data.corpora import CALIB_DRAW, RECOVERY_CALIB_DRAW
    from npuq.models.config import ModelConfig

    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--scheme", "16a4w", "--calib-corpus", f"file:{text}",
            "--context", str(CONTEXT), "--num-threads", "1", "--seq-mse", "2"]

    def calibration(name, *flags):
        assert main([*base, *flags, "--out", str(tmp_path / name)]) == 0
        c = json.loads((tmp_path / name / "config.json").read_text())["calibration"]
        return c["tokens_requested"], c["sampling"], c["tokens"]

    whole = calibration("whole", "--calib-tokens", "100000")[2]
    assert 40 < whole < CALIB_DRAW[0]
    assert calibration("narrow") == (*CALIB_DRAW, whole)
    monkeypatch.setattr(ModelConfig, "widest_linear_input", property(lambda self: CALIB_DRAW[0] + 1))
    assert calibration("wide") == (*RECOVERY_CALIB_DRAW, whole)
    assert calibration("given", "--calib-tokens", "40") == (40, "spread", 40)


def test_cli_quantize_rotate(tmp_path, hf_folder, monkeypatch):
    """--rotate r1+r2: the artifact holds the float weights rotated as npuq.optimize.rotate
    rotates them (seed 0, the stage's fixed seed): every linear weight lies within one step of
    the integer reference of the rotated float weight (min/max scales, nearest rounding; the
    bound is test_weights_within_one_step_of_integer_reference's). An unrotated weight would
    miss it by many steps: R1 mixes every input channel. config.json records the rotation, and
    the model hash is of the weights as loaded; --rotate none on the same scheme rotates nothing."""
    from npuq.models import load_model
    from npuq.optimize.rotate import rotate_model
    from npuq.quant.graph import module_path
    from npuq.quantize.artifact import weights_sha256
    from qdq_noise import constant, reference_weight

    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--scheme", "16a4w", "--calib-corpus", f"file:{text}",
            "--calib-tokens", "40", "--context", str(CONTEXT), "--num-threads", "1"]
    assert main([*base, "--rotate", "r1+r2", "--out", str(tmp_path / "rot")]) == 0
    config = json.loads((tmp_path / "rot" / "config.json").read_text())
    rotation = config["rotation"]
    assert config["recipe"]["rotate"] == "r1+r2" and rotation["r1"] and rotation["r2"] and rotation["seed"] == 0
    float_model = load_model(str(folder)).model
    assert config["model"]["weights_sha256"] == weights_sha256(float_model)
    rotate_model(float_model, seed=0, r1=True, r2=True)
    params = dict(float_model.named_parameters())
    art = load_artifact(tmp_path / "rot")
    linears = [n for n in art.decode.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.linear.default]
    assert len(linears) == 7 * float_model.config.num_layers + 1
    for node in linears:
        w = params[module_path(node) + ".weight"].detach()
        ref, step = reference_weight(w, 7)
        got, zero = constant(art.decode, node.args[1]), step == 0  # all-zero rows (unused token ids) stay zero
        assert not got[zero].any() and not w[zero].any(), module_path(node)
        err = ((got - ref).abs()[~zero] / step[~zero]).max().item()
        assert err <= 1.0 + 1e-4, f"{module_path(node)}: {err:.2f} steps from the rotated weight's reference"

    assert main([*base, "--rotate", "none", "--out", str(tmp_path / "plain")]) == 0
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "rotation" not in config and config["recipe"]["rotate"] is None


def test_cli_quantize_times_threads_before_the_weights_hash_starts(tmp_path, hf_folder, monkeypatch):
    """The thread tuning times the model on every CPU it may use; the weights hash, a thread of
    its own, must not run beside it (it would be timed too, and the timing then not cached as
    contended). The hash is slowed here so that, started first, it would still be running."""
    import threading
    import time

    from npuq.models import load_model
    from npuq.quantize import artifact
    from npuq.runtime.context import ExecutionContext
    from npuq.threads import contention

    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(contention, "snapshot", lambda: None)  # the verdict is not what this test is about
    hashing = artifact._state_sha256
    monkeypatch.setattr(artifact, "_state_sha256", lambda items: (time.sleep(1.0), hashing(items))[1])
    beside = []
    plan_model = ExecutionContext.plan_model

    def timed(self, model, *args, **kwargs):
        beside.append([t.name for t in threading.enumerate() if t.name.startswith("npuq-weights-sha256")])
        return plan_model(self, model, *args, **kwargs)

    monkeypatch.setattr(ExecutionContext, "plan_model", timed)
    folder, text = hf_folder
    assert main(["quantize", "--model", str(folder), "--scheme", "16a8w", "--rotate", "none", "--calib-corpus",
                 f"file:{text}", "--calib-tokens", "40", "--context", str(CONTEXT), "--out", str(tmp_path / "a")]) == 0
    assert beside == [[]]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model"]["weights_sha256"] == artifact.weights_sha256(load_model(str(folder)).model)  # still of the weights as loaded


def test_cli_bad_inputs(tmp_path, hf_folder, capsys):
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--calib-corpus", f"file:{text}", "--context", str(CONTEXT),
            "--num-threads", "1"]
    with pytest.raises(SystemExit) as exc:
        main(base + ["--scheme", "4a4w", "--out", str(tmp_path / "a")])
    assert exc.value.code == 2 and "invalid choice: '4a4w'" in capsys.readouterr().err
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"default": "16a8w", "rules": [{"path": "layers\\.\\d+\\.mlp\\.dwn_proj", "scheme": "16a4w"}]}))
    assert main(base + ["--recipe", str(recipe), "--calib-tokens", "40", "--out", str(tmp_path / "b")]) == 2
    assert "matches no layer of this model" in capsys.readouterr().err
    assert main(base + ["--calib-tokens", "10", "--out", str(tmp_path / "c")]) == 2
    assert "less than one window" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3")
    assert main(base[:4] + [f"file:{short}", "--context", str(CONTEXT), "--num-threads", "1", "--calib-tokens", "40",
                            "--out", str(tmp_path / "d")]) == 2
    assert "shorter than one window" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abcd")
