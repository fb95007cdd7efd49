"""Scoring several rows per call through an artifact's scoring program (the prefill program at
batch 4): each row takes the calls it takes alone, and only GEMM rounding tells them apart."""

import pytest
import torch

from npuq.testing.tiny import tiny_decoder
from npuq.quant.recipe import load_recipe
from npuq.quantize.artifact import load_artifact, read_artifact
from npuq.quantize.pt2e import SCORING_BATCH, quantize_model
from npuq.runtime.runner import StaticRunner, feed_schedule, run_programs, tokens_shape

CONTEXT, PREFILL = 16, 4


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def quantized(request):
    torch.manual_seed(0)
    _, model = tiny_decoder(request.param, max_context=CONTEXT)
    tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return quantize_model(model, load_recipe(None, "16a8w"), tokens, context=CONTEXT, prefill_len=PREFILL)


def _rows(qm, n, length, seed):
    return torch.randint(0, qm.config.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits_step(program) -> float:
    """The scale of the logits output's 16-bit encoding: the grid every logit lies on."""
    out = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    assert "dequantize_per_tensor" in str(out.target)
    return float(out.args[1])


def test_the_scoring_program_is_the_prefill_program_at_a_larger_batch(quantized):
    qm = quantized
    assert tokens_shape(qm.scoring) == (SCORING_BATCH, PREFILL) and tokens_shape(qm.prefill) == (1, PREFILL)
    ops = lambda gm: [(n.name, str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    assert ops(qm.scoring) == ops(qm.prefill)
    weights = lambda gm: {t.data_ptr() for t in [*gm.buffers(), *gm.parameters()]}
    assert weights(qm.scoring) == weights(qm.prefill)  # shared, not copied


@pytest.mark.parametrize("length", [CONTEXT - 2, 7])  # chunks only; the last one padded
def test_a_row_scores_the_same_whatever_shares_its_batch(quantized, length):
    qm = quantized
    rows = _rows(qm, 6, length, seed=1)  # a full batch of 4, then a group of 2 padded with copies
    assert all(ar_len == PREFILL for ar_len, _ in feed_schedule(0, length, PREFILL, CONTEXT))
    together = qm.logits(rows)
    for i in range(len(rows)):
        others = _rows(qm, 2, length, seed=10 + i)
        assert torch.equal(qm.logits(torch.cat([rows[i : i + 1], others]))[0], together[i]), i


def test_batched_rows_agree_with_the_device_flow_within_rounding(quantized):
    """Row by row through the batch-1 programs is the device's flow; the scoring program differs
    only where a GEMM of 4x the rows rounds a sum differently and a quantizer then picks the
    neighbouring code. A wrong cache slot, position or mask would move logits by their own size."""
    qm = quantized
    rows = _rows(qm, 5, CONTEXT - 2, seed=2)
    alone = run_programs(qm.config, qm.graphs(), CONTEXT, rows)
    batched = qm.logits(rows)
    step = _logits_step(qm.prefill)
    diff = (batched - alone).abs()
    assert diff.max() <= 16 * step and diff.mean() <= step, (diff.max() / step, diff.mean() / step)
    assert alone.abs().max() > 1000 * step  # the bound is far below the logits' own size


def test_feed_schedule_is_onnxruntime_genais_chunking():
    """A single token is a decode step; longer feeds are prefill chunks, a leftover single token
    in a padded chunk as onnxruntime-genai's pipeline runs it (docs/design.md §11), and decode
    steps only where a chunk no longer fits the context."""
    assert feed_schedule(0, 1, PREFILL, CONTEXT) == [(1, 1)]
    assert feed_schedule(5, 1, PREFILL, CONTEXT) == [(1, 1)]
    assert feed_schedule(0, 2 * PREFILL + 1, PREFILL, CONTEXT) == [(PREFILL, PREFILL)] * 2 + [(PREFILL, 1)]
    assert feed_schedule(3, PREFILL, PREFILL, CONTEXT) == [(PREFILL, PREFILL)]
    assert feed_schedule(CONTEXT - PREFILL - 1, PREFILL + 1, PREFILL, CONTEXT) == [(PREFILL, PREFILL), (1, 1)]
    assert feed_schedule(CONTEXT - 3, 3, PREFILL, CONTEXT) == [(1, 1)] * 3


def test_rows_whose_feed_needs_a_decode_step_go_one_by_one(quantized):
    """A row whose feed cannot be prefill chunks only (here: a single token) is not batched: it
    goes through the batch-1 programs, as the device runs it."""
    qm = quantized
    rows = _rows(qm, 3, 1, seed=3)
    assert feed_schedule(0, 1, PREFILL, CONTEXT) == [(1, 1)]
    assert torch.equal(qm.logits(rows), run_programs(qm.config, qm.graphs(), CONTEXT, rows))


def test_a_runner_without_decode_graph_refuses_a_feed_that_needs_one(quantized):
    qm = quantized
    runner = StaticRunner(qm.config, {PREFILL: qm.scoring}, CONTEXT, batch=SCORING_BATCH)
    with pytest.raises(ValueError, match="ar_len 1"):
        runner.feed_rows(_rows(qm, SCORING_BATCH, 1, seed=4))


def test_the_artifact_keeps_the_scoring_program(quantized, tmp_path):
    from npuq.quantize.artifact import save_artifact

    qm = quantized
    out = save_artifact(qm, tmp_path / "art")
    entry = read_artifact(out).programs["scoring"]
    assert (entry.file, entry.ar_len, entry.batch) == ("scoring.json", PREFILL, SCORING_BATCH)
    rows = _rows(qm, 3, CONTEXT - 2, seed=5)
    loaded = load_artifact(out)
    assert torch.equal(loaded.logits(rows), qm.logits(rows))
    assert load_artifact(out, scoring=False).scoring is None
