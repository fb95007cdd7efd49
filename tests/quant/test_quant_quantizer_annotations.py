"""Where HtpQuantizer puts which encoding, read off the converted decode program."""

import functools

import pytest
import torch

from npuq.testing.tiny import tiny_decoder
from npuq.quant.graph import in_rmsnorm
from npuq.quantize.pt2e import quantize_model
from npuq.quant.recipe import Recipe

CONTEXT = 16
aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


@functools.lru_cache(maxsize=None)
def _decode(arch, **recipe):
    _, model = tiny_decoder(arch, seed=8, max_context=CONTEXT)
    ids = torch.randint(3, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    return quantize_model(model, Recipe(**recipe), ids, context=CONTEXT).decode


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.mark.parametrize("scheme, dtype, qmin, qmax", [("16a8w", torch.int16, -32767, 32767), ("8a8w", torch.uint8, 0, 255)])
def test_matmul_second_input(scheme, dtype, qmin, qmax):
    gm = _decode("llama", default=scheme)
    mms = _calls(gm, aten.matmul.default)
    assert len(mms) == 4
    for mm in mms:
        dq = mm.args[1]
        assert dq.target == qd.dequantize_per_tensor.default
        assert (dq.args[3], dq.args[4], dq.args[5]) == (qmin, qmax, dtype)
        if dtype == torch.int16:
            assert dq.args[2] == 0  # symmetric


def test_rmsnorm_is_one_op_with_weight_on_the_activation_spec():
    gm = _decode("qwen3", default="16a8w")  # q/k norms as well as block norms
    for node in gm.graph.nodes:
        if node.op != "call_function" or not in_rmsnorm(node):
            continue
        if node.target in (aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default):
            assert all("quantize" not in str(u.target) for u in node.users), f"{node.name}: internals stay float"
    weight_muls = [n for n in _calls(gm, aten.mul.Tensor) if in_rmsnorm(n)
                   and n.args[0].target == qd.dequantize_per_tensor.default and n.args[0].args[0].op == "get_attr"]
    assert len(weight_muls) == 2 * 4 + 1  # per layer: input, post-attention, q and k norms; plus the final norm
    for mul in weight_muls:
        w = mul.args[0]
        assert (w.args[3], w.args[4], w.args[5]) == (0, 65535, torch.int32)
        out_q = next(iter(mul.users))
        assert out_q.target == qd.quantize_per_tensor.default and out_q.args[5] == torch.int32


@pytest.mark.parametrize("mode, qmax", [("pcq8", 127), ("pcq4", 7)])
def test_pcq_embedding(mode, qmax):
    gm = _decode("llama", default="16a8w", embedding=mode)
    emb = _calls(gm, aten.embedding.default)[0]
    table = emb.args[0]
    assert table.target == qd.dequantize_per_channel.default
    assert (table.args[3], table.args[4], table.args[5], table.args[6]) == (0, -qmax, qmax, torch.int8)  # axis 0: rows
    out_q = next(iter(emb.users))
    assert out_q.target == qd.quantize_per_tensor.default and (out_q.args[3], out_q.args[4]) == (0, 65535)


def test_shared_embedding_output_keeps_the_table_encoding():
    gm = _decode("llama", default="16a8w")
    emb = _calls(gm, aten.embedding.default)[0]
    table, out_q = emb.args[0], next(iter(emb.users))
    assert table.target == qd.dequantize_per_tensor.default
    assert table.args[1:6] == out_q.args[1:6]


def test_data_movers_keep_their_input_encoding():
    gm = _decode("llama", default="16a8w")
    for node in _calls(gm, aten.transpose.int) + _calls(gm, aten.view.default):
        src, users = node.args[0], list(node.users)
        if src.target == qd.dequantize_per_tensor.default and users and users[0].target == qd.quantize_per_tensor.default:
            assert src.args[1:6] == users[0].args[1:6], node.name
