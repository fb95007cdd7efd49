"""Streamed models: lazy checkpoints (sharded, bf16), shapes-only `info`, block-by-block logits.

References: the resident StaticDecoder built from the same tensors (the streamed forward runs
its own steps on the same weights, so the logits must agree bit for bit), transformers' own
sharded writer for the index layout, and a hand count of parameters.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from npuq.errors import ModelLoadError, NpuqError
from npuq.models import load_model, model_info, open_streamed
from npuq.models.stream import StreamedDecoder
from npuq.testing.tiny import TINY_CONFIGS, save_tiny_hf_folder, tiny_hf_model
from npuq.models.weights import Checkpoint
from npuq.runtime.runner import forward_logits

ARCHS = sorted(TINY_CONFIGS)


@pytest.fixture(scope="module", params=ARCHS)
def folder(request, tmp_path_factory):
    return request.param, save_tiny_hf_folder(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def test_streamed_logits_equal_the_resident_model_bit_for_bit(folder):
    _, folder = folder
    resident = load_model(str(folder), max_context=64)
    streamed = open_streamed(str(folder), max_context=64)
    assert isinstance(streamed.model, StreamedDecoder)
    tokens = torch.randint(0, resident.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(1)  # the same summation order in both
    expected = forward_logits(resident.model, tokens)
    got = forward_logits(streamed.model, tokens)
    assert torch.equal(got, expected)
    # every step read its weights again: the model was never resident as a whole
    n_tensors = len(resident.model.state_dict())
    assert streamed.model.reads == n_tensors
    assert all(p.is_meta for p in streamed.model.skeleton.parameters())  # all released after the call


def test_sharded_bf16_checkpoint_loads_lazily_and_widens_exactly(tmp_path):
    """transformers' own sharded bf16 writer → the same tensors, widened exactly, header-only open."""
    hf = tiny_hf_model("qwen2", seed=5).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2  # really sharded
    save_tiny_hf_folder(tmp_path / "tok", "qwen2")  # a tokenizer for the folder
    for f in (tmp_path / "tok").glob("tok*"):
        f.rename(tmp_path / f.name)
    checkpoint = Checkpoint.of_folder(tmp_path)
    assert {f.name for f in checkpoint.files} == shards
    assert checkpoint.entries["layers.0.mlp.up_proj.weight"].dtype == "BF16"
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    for name in ("embed_tokens.weight", "layers.1.self_attn.q_proj.bias", "lm_head.weight"):
        got = checkpoint.get(name)
        assert got.dtype == torch.float32
        assert torch.equal(got, state[name].float())  # bf16 → fp32 is exact
    loaded = load_model(str(tmp_path), max_context=32)
    streamed = open_streamed(str(tmp_path), max_context=32)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.set_num_threads(1)
    assert torch.equal(forward_logits(streamed.model, tokens), forward_logits(loaded.model, tokens))


def test_info_reads_shapes_only_and_counts_parameters(folder, monkeypatch):
    def no_reads(*args, **kwargs):
        raise AssertionError("npuq info read a weight")

    arch, folder = folder
    monkeypatch.setattr(Checkpoint, "get", no_reads)
    monkeypatch.setattr(Checkpoint, "load", no_reads)
    info = model_info(str(folder))
    hf = tiny_hf_model(arch, seed=3)
    tied = hf.config.tie_word_embeddings
    by_hand = sum(p.numel() for p in hf.parameters())  # transformers counts a tied table once
    assert info.parameters == by_hand
    assert info.tied_embeddings == tied


def test_info_refuses_a_checkpoint_whose_shapes_disagree_with_the_config(tmp_path):
    folder = save_tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mlp.*has shape"):
        model_info(str(folder))


def test_a_damaged_shard_names_the_file(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="bad.safetensors.*header"):
        Checkpoint.of_folder(tmp_path)
    (tmp_path / "bad.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(ModelLoadError, match="missing.safetensors.*copy every shard"):
        Checkpoint.of_folder(tmp_path)


def test_a_non_finite_block_is_refused_when_it_is_read(tmp_path):
    folder = save_tiny_hf_folder(tmp_path, "llama")
    path = folder / "model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, path)
    streamed = open_streamed(str(folder), max_context=32)
    with pytest.raises(ModelLoadError, match="layers.1.mlp.down_proj.weight contains NaN"):
        forward_logits(streamed.model, torch.zeros(1, 4, dtype=torch.long))


def test_a_model_larger_than_memory_is_refused_before_loading(folder, monkeypatch):
    import npuq.models

    _, folder = folder

    monkeypatch.setattr(npuq.models, "available_memory", lambda device=None: 1 << 10)  # where load_model reads it
    with pytest.raises(NpuqError, match=r"needs .* GiB as float32 but only 0.00 GiB .*--stream"):
        load_model(str(folder))
    assert open_streamed(str(folder)).model is not None  # the streamed model needs no room for the weights


def test_write_safetensors_is_read_back_by_safetensors_itself(tmp_path):
    from safetensors.torch import load_file

    from npuq.models.weights import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=g), "a": torch.randn(7, generator=g), "z": torch.zeros(0, 4)}
    asked = []

    def get(name):
        asked.append(name)
        return tensors[name].clone()

    write_safetensors(tmp_path / "t.safetensors", {k: tuple(v.shape) for k, v in tensors.items()}, get)
    assert asked == list(tensors)  # one at a time, in order, each once
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert Checkpoint([tmp_path / "t.safetensors"]).shapes() == {k: tuple(v.shape) for k, v in tensors.items()}
    with pytest.raises(ModelLoadError, match="b.weight is torch.float32 \\(3, 5\\), expected float32 \\(5, 3\\)"):
        write_safetensors(tmp_path / "u.safetensors", {"b.weight": (5, 3)}, get)


def test_a_streamed_model_generates_what_the_resident_model_generates(folder):
    """A model too large for memory generates streamed: each step runs the whole sequence so far
    block by block (no cache). Its logits are the cached run's within fp32 rounding (~1e-6 at
    these logits' scale of ~3), so the greedy tokens agree wherever a step's two top logits lie
    further apart: on these tiny models at least 2e-3 (qwen3), in words of the tiny vocabulary (an
    unknown word is id 0, the padding row, whose zero embedding gives all-zero logits)."""
    from npuq.runtime.generate import generate

    _, folder = folder
    resident = load_model(str(folder), max_context=64)
    streamed = open_streamed(str(folder), max_context=64)
    torch.set_num_threads(1)
    kwargs = dict(max_new_tokens=6, context=64, prefill_len=4)
    expected = generate(resident, "w5 w17 w3 w42", **kwargs)
    got = generate(streamed, "w5 w17 w3 w42", **kwargs)
    assert got.prompt_tokens == expected.prompt_tokens
    # where the EOS token ends the cached run early, the streamed one ends at the same place
    assert got.token_ids == expected.token_ids
    assert streamed.model.reads == (len(expected.token_ids)) * len(resident.model.state_dict())
