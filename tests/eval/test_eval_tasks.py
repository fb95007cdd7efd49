"""lm-evaluation-harness through npuq (`npuq eval --tasks`, npuq.eval.lm_eval_adapter), offline.

The adapter's loglikelihoods, rolling loglikelihoods and greedy generations against transformers
run directly on the same tiny model; `npuq eval --tasks` on the two small tasks of
tests/eval/lm_eval_tasks (multiple choice, and generation up to a full stop) against the same
hand computation; the artifact's programs through the device flow against its own logits.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from npuq.cli import main

TASKS = Path(__file__).parent / "lm_eval_tasks"
CONTEXT = 64
CHOICE = [json.loads(line) for line in (TASKS / "npuq_choice.jsonl").read_text().splitlines()]
CONTINUE = [json.loads(line) for line in (TASKS / "npuq_continue.jsonl").read_text().splitlines()]
MAX_GEN_TOKS = 6  # npuq_continue.yaml
LONG = ("Perplexity is the exponential of the average negative log-likelihood of a text. "
        "The quick brown fox jumps over the lazy dog; the lazy dog sleeps. ") * 3  # > CONTEXT tokens


class Request:
    """What the harness's LM methods read of an Instance: its args."""

    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    from npuq.testing.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("tasks")
    tiny_hf_model("llama", seed=11).save_pretrained(root / "model", safe_serialization=True)
    tokenizer.save_pretrained(root / "model")
    assert main(["quantize", "--model", str(root / "model"), "--scheme", "16a8w", "--calib-tokens", "256",
                 "--context", str(CONTEXT), "--prefill-len", "8", "--out", str(root / "art"), "--num-threads", "1"]) == 0
    return root


@pytest.fixture(scope="module")
def hf(folders):
    """The transformers model and tokenizer read from the folder: the independent reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folders / "model", attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(folders / "model")


@pytest.fixture(scope="module")
def float_lm(folders):
    from npuq.eval.lm_eval_adapter import NpuqLM
    from npuq.models import load_model
    from npuq.runtime.runner import forward_logits

    loaded = load_model(str(folders / "model"))
    model = loaded.model
    return NpuqLM(loaded.tokenizer, loaded.config, {1: model, 8: model}, lambda t: forward_logits(model, t), CONTEXT,
                  batch=3)


def _encode_pair(tok, context, continuation):
    """The harness's tokenization of a request (TemplateLM._encode_pair, written out): trailing
    spaces of the context go to the continuation; the two are encoded together and split."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n = len(tok.encode(context, add_special_tokens=False))
    return whole[:n], whole[n:]


def _hf_scores(model, tokens, targets):
    """(Σ log p(targets), all greedy) from transformers' logits of ``tokens``, whose last
    len(targets) positions predict the targets; float64 log-softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    rows = logits[len(tokens) - len(targets):].log_softmax(-1)
    picked = rows[torch.arange(len(targets)), torch.tensor(targets)]
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(targets)).all())


# Tolerance of a summed log-likelihood: transformers and npuq's decoder compute the same fp32 function
# with different op orders; a logit of magnitude < 10 rounds by 2^-24 · 10 ≈ 6e-7 per op, and a log-prob
# is a difference of two such values after ~2·layers·(few) ops: ≲ 2e-5 per token, over ≤ 64 tokens ≲ 1e-3.
LL_TOL = 1e-3


def _requests():
    reqs = [(d["question"], c) for d in CHOICE for c in d["choices"]]
    return reqs + [("", "Windows are disjoint."), (LONG, " dog."), ("The lazy dog ", "sleeps.")]


def test_loglikelihoods_match_transformers(float_lm, hf):
    model, tok = hf
    requests = _requests()
    got = float_lm.loglikelihood([Request(c, x) for c, x in requests])
    for (context, continuation), (ll, greedy) in zip(requests, got):
        if context:
            ctx, cont = _encode_pair(tok, context, continuation)
        else:  # an empty context is the prefix token (BOS here)
            ctx, cont = [tok.bos_token_id], tok.encode(continuation, add_special_tokens=False)
        tokens = (ctx + cont)[-(CONTEXT + 1):][:-1]  # the context cut on the left to fit, as the harness does
        ref, ref_greedy = _hf_scores(model, tokens, cont)
        assert ll == pytest.approx(ref, abs=LL_TOL), (context[-30:], continuation)
        assert greedy == ref_greedy
    assert len(_encode_pair(tok, LONG, " dog.")[0]) > CONTEXT  # the long request was cut


def test_rolling_loglikelihood_matches_the_harness_windows_on_transformers(float_lm, hf):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model, tok = hf
    strings = [LONG, "Windows are disjoint."]
    got = float_lm.loglikelihood_rolling([Request(s) for s in strings])
    for s, ll in zip(strings, got):
        ids = tok.encode(s, add_special_tokens=False)
        ref = 0.0
        for inputs, targets in map(make_disjoint_window, get_rolling_token_windows(ids, tok.bos_token_id, CONTEXT, 1)):
            ref += _hf_scores(model, (inputs + targets)[-(CONTEXT + 1):][:-1], targets)[0]  # scored as a request
        assert ll == pytest.approx(ref, abs=LL_TOL * math.ceil(len(ids) / CONTEXT))
    assert len(tok.encode(LONG, add_special_tokens=False)) > 2 * CONTEXT  # three windows


def _hf_greedy(model, tok, prompt, until="."):
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).split(until)[0]


def test_generations_match_transformers(float_lm, hf):
    model, tok = hf
    gen = {"until": ["."], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False}
    got = float_lm.generate_until([Request(d["prompt"], gen) for d in CONTINUE])
    assert got == [_hf_greedy(model, tok, d["prompt"]) for d in CONTINUE]


def test_sampling_is_refused(float_lm):
    from npuq.errors import NpuqError

    with pytest.raises(NpuqError, match="npuq generates greedily"):
        float_lm.generate_until([Request("The", {"do_sample": True, "temperature": 0.7})])


def _cli(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative to the working folder
    out = tmp_path / "tasks.json"
    assert main(["eval", *argv, "--tasks", "npuq_choice,npuq_continue", "--include-path", str(TASKS),
                 "--num-threads", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_eval_tasks_on_the_float_model(folders, hf, tmp_path, monkeypatch):
    """acc and exact_match as the hand computation from transformers gives them."""
    model, tok = hf
    result = _cli(["--model", str(folders / "model"), "--context", str(CONTEXT)], tmp_path, monkeypatch)
    right = 0
    for d in CHOICE:
        scores = [_hf_scores(model, *_pair_tokens(tok, d["question"], c))[0] for c in d["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == d["answer"]
    matches = sum(_hf_greedy(model, tok, d["prompt"]) == d["target"] for d in CONTINUE)
    assert result["results"]["npuq_choice"]["acc,none"] == right / len(CHOICE)
    assert result["results"]["npuq_continue"]["exact_match,none"] == matches / len(CONTINUE)
    assert result["n-samples"]["npuq_choice"]["effective"] == len(CHOICE)
    assert result["graphs"] == {"model": str(folders / "model")} and result["context"] == CONTEXT


def _pair_tokens(tok, context, continuation):
    ctx, cont = _encode_pair(tok, context, continuation)
    return (ctx + cont)[:-1], cont


def test_eval_tasks_on_the_artifact_runs_the_device_flow(folders, tmp_path, monkeypatch):
    """The programs score each request as from an empty cache, four per call: the same log-likelihoods
    as each request run alone through the decode and prefill programs at batch 1. Measured: equal
    to the last bit; the two flows may round a GEMM differently (docs/design.md §7), hence 1e-5,
    a float32 rounding of a sum of a few log-probabilities."""
    from npuq.eval.lm_eval_adapter import NpuqLM
    from npuq.models import load_model
    from npuq.pipeline.programs import open_programs
    from npuq.runtime.runner import run_programs

    result = _cli(["--artifact", str(folders / "art")], tmp_path, monkeypatch)
    assert set(result["results"]) == {"npuq_choice", "npuq_continue"}
    assert result["graphs"]["artifact"] == str(folders / "art") and result["context"] == CONTEXT

    programs = open_programs(artifact=str(folders / "art"))
    tok = load_model(programs.model_source).tokenizer
    lm = NpuqLM(tok, programs.config, programs.graphs, programs.logits, programs.context, programs.batch)
    assert programs.batch == 4
    requests = _requests()
    got = lm.loglikelihood([Request(c, x) for c, x in requests])
    for (context, continuation), (ll, _) in zip(requests, got):
        ctx, cont = _encode_pair(tok, context, continuation) if context else (
            [tok.bos_token_id], tok.encode(continuation, add_special_tokens=False))
        tokens = (ctx + cont)[-(CONTEXT + 1):][:-1]
        logits = run_programs(programs.config, programs.graphs, programs.context, torch.tensor([tokens]))[0]
        rows = logits[len(tokens) - len(cont):].double().log_softmax(-1)
        alone = float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum())
        assert ll == pytest.approx(alone, abs=1e-5), (context[-30:], continuation)


def test_unknown_task_and_flags_without_tasks(folders, capsys):
    assert main(["eval", "--model", str(folders / "model"), "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err
    assert "no_such_task_xyz is not a task of lm-eval 0.4.13" in err and "--include-path" in err
    assert main(["eval", "--model", str(folders / "model"), "--limit", "3"]) == 2
    assert "--limit applies to --tasks" in capsys.readouterr().err
    assert main(["eval", "--artifact", str(folders / "art"), "--tasks", "npuq_choice", "--kl-divergence"]) == 2
    assert "run them as two commands" in capsys.readouterr().err
