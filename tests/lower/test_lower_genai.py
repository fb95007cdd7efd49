"""``npuq export --genai``: the export folder is also an onnxruntime-genai model folder
(docs/design.md §11). onnxruntime-genai 0.18 itself loads the shared-cache folder on its CPU
provider and generates the same greedy tokens as ``npuq generate --onnx`` over the same graphs;
the windowed (NPU) folder, whose cache onnxruntime-genai uses only on a QNN HTP device, is
driven by a reference implementation of that cache written here from its documented behaviour."""

import json

import numpy as np
import pytest
import torch

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower import genai
from npuq.lower.export import ExportOptions, export_artifact, read_manifest
from npuq.lower.ort import cpu_session, htp_session, qnn_available
from npuq.models.tiny import save_tiny_hf_folder

INSTALL = "onnxruntime-genai is not installed: pip install 'npuq[genai]' (onnxruntime-genai==0.18.0)"
CONTEXT, WINDOW = 16, 4
PROMPTS = ("w5 w17 w33 w9 w44 w12 w7", "w100", "w3 w4 w5 w6", "w150 w60 w70 w71 w72 w8 w9 w10 w11 w12")


def _og():
    return pytest.importorskip("onnxruntime_genai", reason=INSTALL)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama (a Hugging Face folder with its tokenizer) quantized 16a8w (uint16 KV) and with an
    8-bit KV recipe, each exported with the cache contract it can take."""
    root = tmp_path_factory.mktemp("genai")
    model = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=g)))
    (root / "kv8.json").write_text(json.dumps({"default": "16a8w", "kv_bits": 8}))
    out = {}
    for name, recipe in (("kv16", []), ("kv8", ["--recipe", str(root / "kv8.json")])):
        assert main(["quantize", "--model", str(model), "--calib-corpus", f"file:{text}", "--calib-tokens", "64",
                     "--context", str(CONTEXT), "--prefill-len", str(WINDOW), "--num-threads", "1",
                     "--out", str(root / name), *recipe]) == 0
        out[name] = root / name
    out["shared"] = root / "shared"
    export_artifact(out["kv16"], out["shared"], ExportOptions(qnn_version="2.51", htp_arch=73, genai="shared"))
    out["windowed"] = root / "windowed"
    export_artifact(out["kv8"], out["windowed"], ExportOptions(qnn_version="2.51", htp_arch=73, genai="windowed"))
    if qnn_available() is None:  # the windowed folder with QNN HTP contexts of its graphs (--compile)
        out["compiled"] = root / "compiled"
        export_artifact(out["kv8"], out["compiled"], ExportOptions(qnn_version="2.51", htp_arch=73, genai="windowed",
                                                                    compile=True))
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
    return CONTEXT - -(-prompt_len // WINDOW) * WINDOW  # the runtime pads the prompt to whole windows


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
    windowed = read_manifest(folders["windowed"])
    assert windowed.genai.pad_value == 128  # uint8 symmetric KV: every cache's zero point
    k = {s.name: s for s in windowed.graphs["decode"].inputs}["k_cache_0"]
    assert k.dtype == "uint8" and k.shape[:2] == (2, 1) and windowed.graphs["decode"].kv_heads_first


def test_onnxruntime_genai_gives_npuq_greedy_tokens(folders, tmp_path):
    """onnxruntime-genai 0.18 on the CPU loads the shared-cache folder; for prompts that fill
    whole windows, part of one, and several, its greedy tokens are those of `npuq generate --onnx`
    on the same folder (npuq's runner, npuq's graphs, no genai stages)."""
    og = _og()
    model = og.Model(str(folders["shared"]))
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


# --------------------------------------------------------------------------- the windowed (NPU) contract
class WindowedDriver:
    """onnxruntime-genai's windowed KV cache as its documentation and probes describe it, driving
    a folder's stages (from genai_config.json) on ONNX Runtime's exact CPU sessions:

    - the prompt is left-padded with pad_token_id to whole windows of W; pads get position 0, real
      tokens 0, 1, ...; each call gets input_ids / position_ids [1, W], then [1, 1] per new token;
    - attention_mask [1, ctx] int64: 1 for every real token seen so far, right-aligned, the current
      call's tokens in the last columns;
    - per layer one uint8 K input [KV, 1, D, ctx - T] and V input [KV, 1, ctx - T, D] for a call of
      T tokens (W for the prompt, then 1), right-aligned, empty slots holding pad_value; after a call
      its outputs [.., T] are appended at the right and the oldest entries dropped (between prompt
      windows the runtime shifts by W; at the switch to token generation it keeps the last ctx - 1).
      Here each layer keeps the last ctx entries and a call reads the last ctx - T of them.

    Each stage runs where genai_config.json puts it (its own session options, else the decoder's):
    on the QNN provider, the HTP emulator with that HTP arch; otherwise (or with ``cpu_only``,
    to run the same folder's stages on the CPU) the exact CPU session."""

    def __init__(self, folder, cpu_only=False):
        self.folder = folder
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        self.ctx, self.pad_id = config["context_length"], config["pad_token_id"]
        dec = config["decoder"]
        self.names, self.layers = dec["inputs"], dec["num_hidden_layers"]
        self.present = dec["outputs"]
        window = dec["sliding_window"]
        assert window["alignment"] == "right" and window["slide_inputs"] and window["slide_key_value_cache"]
        self.W, self.pad = window["window_size"], window["pad_value"]
        self.stages = [next(iter(s.items())) for s in dec["pipeline"]]
        self.sessions = {}
        for name, stage in self.stages:
            providers = stage.get("session_options", dec["session_options"])["provider_options"]
            qnn = next((p["qnn"] for p in providers if "qnn" in p), None)
            path = folder / stage["filename"]
            use_htp = qnn is not None and not cpu_only
            self.sessions[name] = htp_session(path, int(qnn["htp_arch"])) if use_htp else cpu_session(path)
        self.logits = []  # the last position's logits of every call
        kv, d = dec["num_key_value_heads"], dec["head_size"]
        self.k = [np.full((kv, 1, d, self.ctx), self.pad, np.uint8) for _ in range(self.layers)]
        self.v = [np.full((kv, 1, self.ctx, d), self.pad, np.uint8) for _ in range(self.layers)]
        self.valid = []  # one flag per token fed (pads 0), oldest first

    def _call(self, ids, positions, prompt):
        T = len(ids)
        mask = np.zeros((1, self.ctx), np.int64)
        seen = self.valid[-self.ctx:]
        mask[0, self.ctx - len(seen):] = seen
        values = {self.names["input_ids"]: np.array([ids], np.int32), self.names["position_ids"]: np.array([positions],
                  np.int32), self.names["attention_mask"]: mask}
        for i in range(self.layers):
            values[self.names["past_key_names"] % i] = np.ascontiguousarray(self.k[i][..., T:])
            values[self.names["past_value_names"] % i] = np.ascontiguousarray(self.v[i][:, :, T:])
        for name, stage in self.stages:
            if stage["run_on_prompt"] != prompt and stage["run_on_token_gen"] == prompt:
                continue
            session = self.sessions[name]
            out = session.run(stage["outputs"], {n: values[n] for n in stage["inputs"]})
            values.update(zip(stage["outputs"], out))
        for i in range(self.layers):  # append the new entries, drop the oldest
            k_new, v_new = values[self.present["present_key_names"] % i], values[self.present["present_value_names"] % i]
            assert k_new.shape[-1] == T and v_new.shape[-2] == T
            self.k[i] = np.concatenate([self.k[i][..., T:], k_new], axis=-1)
            self.v[i] = np.concatenate([self.v[i][:, :, T:], v_new], axis=-2)
        self.logits.append(values[self.present["logits"]][0, -1])
        return self.logits[-1]

    def generate(self, prompt_ids, n):
        pads = -len(prompt_ids) % self.W
        ids = [self.pad_id] * pads + list(prompt_ids)
        positions = [0] * pads + list(range(len(prompt_ids)))
        for start in range(0, len(ids), self.W):
            window = ids[start:start + self.W]
            self.valid += [0 if start + j < pads else 1 for j in range(self.W)]
            logits = self._call(window, positions[start:start + self.W], prompt=True)
        tokens, position = [int(np.argmax(logits))], len(prompt_ids)
        while len(tokens) < n:
            self.valid.append(1)
            logits = self._call([tokens[-1]], [position], prompt=False)
            tokens.append(int(np.argmax(logits)))
            position += 1
        return tokens


def test_windowed_folder_under_the_reference_driver(folders, tmp_path):
    """The NPU contract's graphs (uint8 KV declared [KV, 1, ...], mask stages), driven as
    onnxruntime-genai's windowed cache drives them, give the greedy tokens of `npuq generate --onnx`
    on the same folder (npuq's runner feeds the same graphs in its own layout)."""
    for prompt in PROMPTS:
        ids = _prompt_ids(folders, prompt)
        n = _new_tokens(len(ids))
        want = _npuq_generate(folders["windowed"], prompt, tmp_path, n)
        driver = WindowedDriver(folders["windowed"], cpu_only=True)
        got = driver.generate(ids, len(want))
        assert len(want) >= 2 and got == want, prompt


def test_compiled_windowed_folder_runs_its_contexts_on_the_htp(folders):
    """--genai windowed --compile: genai_config.json puts the graphs on the QNN HTP provider and
    names their compiled contexts; driven through the windowed cache, those contexts run on the
    HTP emulator and give the logits of the folder's QDQ graphs run there, bit for bit, at every
    call. (The HTP's own arithmetic differs from the exact CPU graphs by a code here and there,
    test_lower_htp, so its tokens are compared with the QDQ graphs on the same backend.)"""
    if "compiled" not in folders:
        pytest.skip(str(qnn_available()))
    folder = folders["compiled"]
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    assert config["session_options"]["provider_options"] == [{"qnn": {"backend_type": "htp", "htp_arch": "73"}}]
    files = [next(iter(s.values()))["filename"] for s in config["pipeline"]]
    assert files == ["genai_mask_prefill.onnx", "prefill_ctx.onnx", "genai_mask_decode.onnx", "decode_ctx.onnx"]
    assert read_manifest(folder).genai.stages == tuple(files)
    for prompt in PROMPTS[:2]:
        ids = _prompt_ids(folders, prompt)
        on_contexts, on_graphs = WindowedDriver(folder), WindowedDriver(folder)
        for name in ("prefill", "decode"):  # the QDQ graphs in place of their contexts
            on_graphs.sessions[f"{name}_ctx"] = htp_session(folder / f"{name}.onnx", 73)
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
                value = np.where(rng.random(shape) < 0.3, -255.0, 0.0).astype(np.float32)
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
