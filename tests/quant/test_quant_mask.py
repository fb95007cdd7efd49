"""Masked keys take no attention weight, however far below the mask value the scores lie
(npuq.quant.specs.masked_scores_spec).

A program runs from an empty cache: the slots not yet written hold zero keys, whose score is 0,
and the additive mask puts them at MASK_VALUE. With the mask at -255 and the ``scores + mask``
output encoded on its observed range, a row whose real scores all lay below -255 gave its
weight to those empty slots (their values are zero): Qwen2.5-Coder-1.5B's first layer has
scores down to -2500 (its q/k biases), and that alone was its 1.034x float perplexity at 16a8w
(with every activation encoding made exact by hand, the gap stayed; with a -1e5 mask it went:
KLD 1.5e-7).

Here a tiny Qwen2 model gets the same kind of q/k biases, planted on the rotary pair of lowest
frequency (its angle moves < 0.005 rad over the context, so the planted term is the same for
every query/key pair): every score of layer 0 is about -2000. The programs are fed the
calibration windows themselves, so every real score lies within the observed range; the
encoding then puts each masked entry at least the margin below its row's largest score, where
e^-margin times the keys is under half a softmax step: each masked probability is exactly
code 0. Before the fix the masked share of each row with empty slots was ~1.
"""

import copy
import math

import pytest
import torch

from npuq.calibrate.split import split_windows
from npuq.models.decoder import MASK_VALUE, rotate_half
from npuq.quant import graph as g
from npuq.quant.recipe import load_recipe
from npuq.quant.specs import MAX_KEYS, masked_margin
from npuq.quantize.pt2e import quantize_model
from npuq.runtime.runner import forward_logits, run_programs
from npuq.testing.tiny import tiny_decoder

CONTEXT, PREFILL = 16, 4
SCORE = -2000.0  # the planted score of every query/key pair of layer 0


def _planted_model():
    _, model = tiny_decoder("qwen2", seed=1, max_context=64)
    attn = model.layers[0].self_attn
    d = attn.head_dim // 2 - 1  # the lowest rotary frequency: rotate-half pairs dims d and d + D/2
    a = (-SCORE / attn.scale) ** 0.5
    with torch.no_grad():
        for h in range(attn.n_heads):
            attn.q_proj.bias[h * attn.head_dim + d] = a
        for h in range(attn.n_kv):
            attn.k_proj.bias[h * attn.head_dim + d] = -a
    return model


def _recording(program, seen: list):
    """A copy of ``program`` that appends what each softmax's consumers read (its dequantized
    output) and the mask input to ``seen`` at every call."""
    gm = copy.deepcopy(program)
    graph = gm.graph

    def record(probs, mask):
        seen.append((probs.detach().clone(), mask.detach().clone()))

    mask = next(n for n in graph.nodes if n.op == "placeholder" and n.name == g.MASK_INPUT)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in g.SOFTMAX:
            (q,) = node.users
            dq = next(iter(q.users))  # one of the dequantizes the consumers read (equal values)
            with graph.inserting_after(dq):
                graph.call_function(record, (dq, mask))
    gm.recompile()
    return gm


@pytest.mark.parametrize("scheme", ["16a8w", "16a16w"])
def test_masked_keys_take_no_weight_when_scores_lie_far_below_the_mask(scheme):
    torch.manual_seed(0)
    model = _planted_model()
    calib = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3))[:4 * CONTEXT]
    qm = quantize_model(model, load_recipe(scheme), calib, context=CONTEXT, prefill_len=PREFILL)
    seen: list = []
    graphs = {ar: _recording(p, seen) for ar, p in qm.graphs().items()}
    rows = split_windows(calib, CONTEXT).full
    run_programs(qm.config, graphs, CONTEXT, rows)
    assert seen
    layer0 = seen[::model.config.num_layers]  # the programs' softmaxes run layer by layer
    masked_share = []
    for probs, mask in layer0:
        T, S = mask.shape[-2:]
        p = probs.reshape(probs.shape[0], -1, T, S)  # (B, heads, T, S)
        masked = mask[:, 0] == MASK_VALUE  # (B, T, S)
        assert masked.any()
        masked_share.append(float((p * masked[:, None]).sum(-1).max()))
    assert max(masked_share) == 0.0, f"masked keys took up to {max(masked_share):.3f} of a row"
    # the real rows still sum to one (to the output step's rounding over S keys)
    for probs, _ in layer0:
        assert (probs.sum(-1) - 1).abs().max() <= probs.shape[-1] / 65535


def test_planted_scores_are_where_the_test_says():
    """The planted model's layer-0 scores (float) all lie within 10 % of SCORE (the weights'
    own terms spread them by about 6 %), far below the old mask value -255."""
    model = _planted_model()
    attn = model.layers[0].self_attn
    seen = []

    def grab(module, args, kwargs, out):
        seen.append(args)
    h = attn.register_forward_hook(grab, with_kwargs=True)
    tokens = torch.arange(3, 3 + CONTEXT).unsqueeze(0)
    forward_logits(model, tokens)
    h.remove()
    x, cos, sin = seen[0][:3]
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
    k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
    k = k.repeat_interleave(attn.n_heads // attn.n_kv, dim=1)
    s = (q @ k.transpose(-1, -2)) * attn.scale
    assert ((s - SCORE).abs() <= 0.1 * -SCORE).all(), (s.min().item(), s.max().item())


def test_the_margin_leaves_masked_entries_under_half_a_softmax_step():
    """The arithmetic of masked_margin: MAX_KEYS entries each e^-margin of the row's largest
    weight sum to half a step of the softmax output's grid."""
    for bits in (8, 16):
        step = 1 / (2**bits - 1)
        assert MAX_KEYS * math.exp(-masked_margin(bits)) == pytest.approx(step / 2, rel=1e-9)
