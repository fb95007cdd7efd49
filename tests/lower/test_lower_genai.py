"""``npuq export --genai``: the export folder is also an onnxruntime-genai model folder
(docs/design.md §11). onnxruntime-genai 0.18 itself loads the shared-cache folder on its CPU
provider and generates the same greedy tokens as ``npuq generate --onnx`` over the same graphs;
the windowed (NPU) folder, whose cache onnxruntime-genai uses only on a QNN HTP device, is
driven by a reference implementation of that cache written here from its documented behaviour."""

import json

import numpy as np
import pytest
import torch

from genai_chat import npuq_conversation, og_conversation, og_model
from windowed_driver import WindowedDriver
from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower import genai
from npuq.lower.export import ExportOptions, export_artifact
from npuq.lower.manifest import read_manifest
from npuq.lower.ort import cpu_session, load_export, qnn_available
from npuq.models.decoder import MASK_VALUE
from npuq.testing.tiny import save_tiny_hf_folder
from npuq.runtime.runner import StaticRunner

INSTALL = "onnxruntime-genai is not installed: pip install 'npuq[genai]' (onnxruntime-genai==0.18.0)"
CONTEXT, WINDOW = 16, 4
PROMPTS = ("w5 w17 w33 w9 w44 w12 w7", "w100", "w3 w4 w5 w6", "w150 w60 w70 w71 w72 w8 w9 w10 w11 w12")


def _og():
    return pytest.importorskip("onnxruntime_genai", reason=INSTALL)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama (a Hugging Face folder with its tokenizer) quantized 16a8w (uint16 KV) and with an
    8-bit KV recipe, each exported with the cache contract it can take; each also quantized in two
    parts (one layer each: the same programs, tests/quant/test_quant_parts.py) and exported in two
    shards (``shared2``, ``windowed2``)."""
    root = tmp_path_factory.mktemp("genai")
    model = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=g)))
    (root / "kv8.json").write_text(json.dumps({"default": "16a8w", "kv_bits": 8}))
    out = {}
    for name, recipe in (("kv16", []), ("kv8", ["--recipe", str(root / "kv8.json")])):
        for parts in (1, 2):
            folder = root / (name if parts == 1 else f"{name}-parts")
            assert main(["quantize", "--model", str(model), "--calib-corpus", f"file:{text}", "--calib-tokens", "64",
                         "--context", str(CONTEXT), "--prefill-len", str(WINDOW), "--num-threads", "1",
                         "--parts", str(parts), "--out", str(folder), *recipe]) == 0
            out[folder.name] = folder
    for cache, artifact in (("shared", "kv16"), ("windowed", "kv8")):
        for shards in (1, 2):
            name = cache if shards == 1 else f"{cache}2"
            out[name] = root / name
            export_artifact(out[artifact if shards == 1 else f"{artifact}-parts"], out[name],
                            ExportOptions(qnn_version="2.51", htp_arch=73, genai=cache, shards=shards))
    if qnn_available() is None:  # the windowed folders with QNN HTP contexts of their graphs (--compile)
        for name, artifact, shards in (("compiled", "kv8", 1), ("compiled2", "kv8-parts", 2)):
            out[name] = root / name
            export_artifact(out[artifact], out[name], ExportOptions(qnn_version="2.51", htp_arch=73, genai="windowed",
                                                                    compile=True, shards=shards))
    out["model"] = model
    return out


def _npuq_generate(folder, prompt, tmp_path, n):
    """``npuq generate --onnx``: npuq's own runner over the folder's graphs."""
    result = tmp_path / "gen.json"
    assert main(["generate", "--onnx", str(folder), "--prompt", prompt, "--max-new-tokens", str(n), "--prefill-len", str(WINDOW),
                 "--num-threads", "1", "--json", str(result)]) == 0
    return json.loads(result.read_text())["token_ids"]


def _prompt_ids(folders, prompt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders["model"])(prompt)["input_ids"]


def _new_tokens(prompt_len):
    return CONTEXT - prompt_len  # the runtime's max_length is the context: prompt and generated tokens


def test_folder_files_and_record(folders):
    for cache in ("shared", "windowed"):
        out = folders[cache]
        manifest = read_manifest(out)
        record = manifest.genai
        assert record.cache == cache and record.model_type == "decoder-pipeline" and record.window == WINDOW
        config = json.loads((out / "genai_config.json").read_text())
        model = config["model"]
        assert model["type"] == "decoder-pipeline" and model["context_length"] == CONTEXT
        assert model["decoder"]["sliding_window"]["window_size"] == WINDOW
        files = [next(iter(s.values()))["filename"] for s in model["decoder"]["pipeline"]]
        assert tuple(files) == record.stages and {"prefill.onnx", "decode.onnx"} <= set(files)
        assert all((out / f).is_file() for f in files) and "tokenizer.json" in record.tokenizer
        assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # written atomically
    shared = json.loads((folders["shared"] / "genai_config.json").read_text())["model"]
    layers = read_manifest(folders["shared"]).cfg.num_layers
    # the shared contract: unpadded appends, one bookkeeping cache layer, no token is padding
    assert shared["decoder"]["sliding_window"]["slide_inputs"] is False and shared["pad_token_id"] == -1
    assert shared["decoder"]["num_hidden_layers"] == layers + 1
    assert read_manifest(folders["shared"]).genai.chat_template is None  # the tiny model has none
    windowed = read_manifest(folders["windowed"])
    assert windowed.genai.pad_value == 128  # uint8 symmetric KV: every cache's zero point
    k = {s.name: s for s in windowed.graphs["decode"].inputs}["k_cache_0"]
    assert k.dtype == "uint8" and k.shape[:2] == (2, 1) and windowed.graphs["decode"].kv_heads_first


def test_a_sharded_folder_runs_each_shard_between_the_stages(folders):
    """Two shards: each kind's pipeline runs its stage, both shard graphs in order, and (shared) its
    output stage; the second shard takes by name the hidden-state codes the first returns."""
    for cache, stages in (("shared2", ("genai_in_{}.onnx", "{}.part-1-of-2.onnx", "{}.part-2-of-2.onnx",
                                       "genai_out_{}.onnx")),
                          ("windowed2", ("genai_mask_{}.onnx", "{}.part-1-of-2.onnx", "{}.part-2-of-2.onnx"))):
        manifest = read_manifest(folders[cache])
        pipeline = json.loads((folders[cache] / "genai_config.json").read_text())["model"]["decoder"]["pipeline"]
        files = [next(iter(s.values()))["filename"] for s in pipeline]
        assert files == [f.format(kind) for kind in ("prefill", "decode") for f in stages]
        assert manifest.genai.stages == tuple(files) and len(manifest.shards) == 2
        first, second = (next(iter(s.values())) for s in pipeline[1:3])
        hidden = [n for n in first["outputs"] if n.startswith("hidden_")]
        assert hidden == ["hidden_1"] and hidden[0] in second["inputs"] and "logits" in second["outputs"]


def test_onnxruntime_genai_gives_npuq_greedy_tokens(folders, tmp_path):
    """onnxruntime-genai 0.18 on the CPU loads the shared-cache folder; for prompts that fill
    whole windows, part of one, and several, its greedy tokens are those of `npuq generate --onnx`
    on the same folder (npuq's runner, npuq's graphs, no genai stages)."""
    og = _og()
    model = og_model(folders["shared"], threads=1)  # as `npuq generate --num-threads 1`
    for prompt in PROMPTS:
        ids = _prompt_ids(folders, prompt)
        n = _new_tokens(len(ids))
        want = _npuq_generate(folders["shared"], prompt, tmp_path, n)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=CONTEXT, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        got = []
        while not generator.is_done() and len(got) < len(want):
            generator.generate_next_token()
            got.append(int(generator.get_next_tokens()[0]))
        assert len(want) >= 2 and got == want, prompt


# Conversations: (token ids, tokens to generate) per turn; window 4, context 16. Turn lengths:
# one window, one token, three windows, and later turns of one token, less and more than a window.
TURNS = {
    "one window, then 1 token, then 3": [([11, 12, 13, 14], 2), ([15], 2), ([16, 17, 18], 3)],
    "one token, then a window": [([21], 3), ([22, 23, 24, 25], 3)],
    "three windows": [(list(range(30, 42)), 4)],
    "3 tokens, then 6 (two chunks)": [([41, 42, 43], 2), ([44, 45, 46, 47, 48, 49], 3)],
}


@pytest.mark.parametrize("name", sorted(TURNS))
def test_a_conversation_gives_npuq_runners_tokens_turn_by_turn(folders, name):
    """onnxruntime-genai appends each turn to the same generator (continuous decoding) on the
    shared folder and generates, turn by turn, the greedy tokens of npuq's runner on the same
    conversation: its stages feed npuq's graphs what the runner feeds them."""
    turns = TURNS[name]
    _og()
    got = og_conversation(folders["shared"], turns, threads=1)  # npuq's sessions: 1 thread (conftest)
    want = npuq_conversation(folders["shared"], turns)
    assert [len(t) for t in got] == [n for _, n in turns] and got == want


@pytest.mark.parametrize("folder", ["shared", "shared2"])
def test_the_runtime_computes_npuq_runners_logits_bit_for_bit(folders, folder):
    """Not only the argmax: at every call (a prompt of two chunks, a generation step, a later turn)
    the logits onnxruntime-genai samples from are npuq's runner's, bit for bit. ``shared2``: the
    runtime runs the two shards as one pipeline and still computes the unsharded graphs' logits."""
    og = _og()
    model = og_model(folders[folder], threads=1)  # npuq's sessions: 1 thread (conftest)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=CONTEXT, do_sample=False)
    generator = og.Generator(model, params)
    manifest, graphs = load_export(folders["shared"])
    runner = StaticRunner(manifest.cfg, graphs, manifest.context)

    def logits():
        return np.asarray(generator.get_output(genai.LOGITS))[0, -1]

    for ids in ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]):
        generator.append_tokens(ids)
        want = runner.feed(ids)[0, -1].numpy()
        assert np.array_equal(logits(), want), ids
        generator.generate_next_token()  # samples from the append's logits
        first = int(generator.get_next_tokens()[0])
        assert first == int(np.argmax(want))
        generator.generate_next_token()  # feeds `first`, samples the next (never fed before the next turn)
        want = runner.feed([first])[0, -1].numpy()
        assert np.array_equal(logits(), want), ids
        assert int(generator.get_next_tokens()[0]) == int(np.argmax(want))


def test_a_conversation_past_the_context_is_a_clear_error(folders):
    """A turn whose chunk no longer fits the cache fails with the stage's message (the runtime's
    own max_length check catches the rest)."""
    _og()
    with pytest.raises(Exception, match="no longer fits the context of 16 tokens.*new og.Generator"):
        og_conversation(folders["shared"], [(list(range(1, 14)), 1), ([3, 4], 1)])
    with pytest.raises(Exception, match="exceeds max length"):
        og_conversation(folders["shared"], [(list(range(1, 14)), 2), ([3, 4, 5], 1)])


# --------------------------------------------------------------------------- the windowed (NPU) contract
def test_windowed_folder_under_the_reference_driver(folders, tmp_path):
    """The NPU contract's graphs (uint8 KV declared [KV, 1, ...], mask stages), driven as
    onnxruntime-genai's windowed cache drives them, give the greedy tokens of `npuq generate --onnx`
    on the same folder (npuq's runner feeds the same graphs in its own layout), and so does the
    two-shard folder's pipeline, every logit of it equal to the one-shard folder's."""
    for prompt in PROMPTS:
        ids = _prompt_ids(folders, prompt)
        n = _new_tokens(len(ids))
        want = _npuq_generate(folders["windowed"], prompt, tmp_path, n)
        driver = WindowedDriver(folders["windowed"], cpu_only=True)
        got = driver.generate(ids, len(want))
        assert len(want) >= 2 and got == want, prompt
        sharded = WindowedDriver(folders["windowed2"], cpu_only=True)
        assert sharded.generate(ids, len(want)) == want, prompt
        assert len(sharded.logits) == len(driver.logits)
        assert all(np.array_equal(x, y) for x, y in zip(sharded.logits, driver.logits)), prompt


def test_compiled_windowed_folder_runs_its_contexts_on_the_htp(folders):
    """--genai windowed --compile: genai_config.json puts the graphs on the QNN HTP provider and
    names their compiled contexts; driven through the windowed cache, those contexts run on the
    HTP emulator and give the logits of the folder's QDQ graphs run there, bit for bit, at every
    call. (The HTP's own arithmetic differs from the exact CPU graphs by a code here and there,
    test_lower_htp, so its tokens are compared with the QDQ graphs on the same backend.)"""
    if "compiled" not in folders:
        pytest.skip(str(qnn_available()))
    for name, tags in (("compiled", [""]), ("compiled2", [".part-1-of-2", ".part-2-of-2"])):
        folder = folders[name]
        config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
        assert config["session_options"]["provider_options"] == [{"qnn": {"backend_type": "htp", "htp_arch": "73"}}]
        files = [next(iter(s.values()))["filename"] for s in config["pipeline"]]
        assert files == [f for kind in ("prefill", "decode")
                         for f in [f"genai_mask_{kind}.onnx"] + [f"{kind}{tag}_ctx.onnx" for tag in tags]]
        assert read_manifest(folder).genai.stages == tuple(files)
        last = f"decode{tags[-1]}"
        for prompt in PROMPTS[:2]:
            ids = _prompt_ids(folders, prompt)
            on_contexts, on_graphs = WindowedDriver(folder), WindowedDriver(folder, qdq=True)
            assert on_graphs.files[f"{last}_ctx"] == f"{last}.onnx" and on_contexts.files[f"{last}_ctx"] == f"{last}_ctx.onnx"
            assert on_contexts.generate(ids, 4) == on_graphs.generate(ids, 4)
            assert len(on_contexts.logits) == len(on_graphs.logits)
            assert all(np.array_equal(x, y) for x, y in zip(on_contexts.logits, on_graphs.logits))


def test_windowed_graphs_keep_the_npuq_graphs_outputs(folders, tmp_path):
    """Declaring the cache heads first changes no number: the windowed folder's graphs give the
    outputs of a plain export of the same artifact, bit for bit, on the same codes."""
    plain = tmp_path / "plain"
    export_artifact(folders["kv8"], plain, ExportOptions(qnn_version="2.51", htp_arch=73))
    rng = np.random.default_rng(0)
    for kind in ("decode", "prefill"):
        a, b = cpu_session(plain / f"{kind}.onnx"), cpu_session(folders["windowed"] / f"{kind}.onnx")
        feeds_a, feeds_b = {}, {}
        for x, y in zip(a.get_inputs(), b.get_inputs()):
            shape = [int(d) for d in x.shape]
            if x.name == "mask":
                value = np.where(rng.random(shape) < 0.3, MASK_VALUE, 0.0).astype(np.float32)
            elif x.name in ("tokens", "positions"):
                value = rng.integers(0, CONTEXT, shape).astype(np.int32)
            else:
                value = rng.integers(0, 256, shape).astype(np.uint8)
            feeds_a[x.name] = value
            feeds_b[y.name] = np.swapaxes(value, 0, 1) if x.name.startswith(("k_", "v_")) else value
        for x, out_a, out_b in zip(a.get_outputs(), a.run(None, feeds_a), b.run(None, feeds_b)):
            assert np.array_equal(out_a, np.swapaxes(out_b, 0, 1) if x.name.startswith(("k_", "v_")) else out_b), x.name


# --------------------------------------------------------------------------- what is refused
def test_windowed_needs_uint8_kv(folders, tmp_path, capsys):
    code = main(["export", "--artifact", str(folders["kv16"]), "--out", str(tmp_path / "o"), "--qnn-version", "2.51",
                 "--htp-arch", "73", "--genai", "windowed"])
    err = capsys.readouterr().err
    assert code == 2 and "uint8 KV codes" in err and '"kv_bits": 8' in err and "--genai shared" in err
    assert not (tmp_path / "o").exists()


def test_bad_values_are_refused():
    with pytest.raises(NpuqError, match="--genai 'npu': choose windowed"):
        ExportOptions(genai="npu")
    with pytest.raises(NpuqError, match="context 6 is less than twice the prompt window 4.*--prefill-len 3"):
        genai.check_window(6, 4)
    with pytest.raises(NpuqError, match="must be at least 2 tokens"):
        genai.check_window(16, 1)


def test_options_without_genai_keep_their_key():
    from npuq.records import to_json

    assert "genai" not in to_json(ExportOptions(htp_arch=73))
    assert to_json(ExportOptions(htp_arch=73, genai="shared"))["genai"] == "shared"
