"""Phase workloads on a tiny real decoder, and the tune-threads command end to end."""

import json
from types import SimpleNamespace

import pytest
import torch

from npuq.errors import NpuqError
from npuq.threads import contention
from npuq.runtime.workloads import PHASES, phase_workload


@pytest.fixture(scope="module")
def tiny():
    from npuq.testing.tiny import tiny_decoder

    return tiny_decoder("llama", seed=0, max_context=64)[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))


def test_each_phase_runs_its_mode_and_names_it(tiny):
    loads = {p: phase_workload(tiny, p, 32, 8 if p == "prefill" else None) for p in PHASES}
    assert [w.tokens_per_step for w in loads.values()] == [1, 8, 32]
    for phase, w in loads.items():
        assert w.run() is None
        assert f"|{phase}|context=32|" in w.signature and w.signature.startswith("llama-")
    assert len({w.signature for w in loads.values()}) == 3
    assert phase_workload(tiny, "decode", 32).signature == loads["decode"].signature  # stable


def test_the_workload_leaves_no_autograd_state(tiny):
    w = phase_workload(tiny, "prefill", 32, 8)
    w.run()
    assert all(p.grad is None for p in tiny.parameters())


def test_bad_phase_or_context_is_a_user_error(tiny):
    with pytest.raises(NpuqError, match="unknown phase"):
        phase_workload(tiny, "train", 32)
    with pytest.raises(NpuqError, match="exceeds"):
        phase_workload(tiny, "decode", 1000)


def test_cli_tunes_caches_and_plots(tiny, monkeypatch, tmp_path, capsys):
    import npuq.models
    from npuq.cli import main

    monkeypatch.setattr(npuq.models, "load_model", lambda spec, max_context=None: SimpleNamespace(model=tiny))
    # No contention verdict: whether another process shares the CPUs must not decide what is cached
    # here (test_threads_contention.py tests that).
    monkeypatch.setattr(contention, "snapshot", lambda: None)
    before = torch.get_num_threads()
    out, png = tmp_path / "tune.json", tmp_path / "tune.png"
    argv = ["tune-threads", "--model", "tiny", "--phase", "decode", "--phase", "prefill", "--context", "32",
            "--prefill-len", "8", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    first = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["phase"] for r in first["results"]] == ["decode", "prefill"]
    for r in first["results"]:
        assert set(r) >= {"phase", "ceiling", "candidates", "seconds", "best", "default_threads",
                          "speedup_vs_default", "tuning_seconds", "cached"}
        assert r["candidates"] == [n for n in r["candidates"] if n <= first["ceiling"]]
        assert len(r["seconds"]) == len(r["candidates"]) and r["best"] in r["candidates"]
        assert r["cached"] is False
    assert first["plan"] == {r["phase"]: r["best"] for r in first["results"]}
    assert torch.get_num_threads() == before

    assert main(argv[:-4] + ["--json", str(out)]) == 0
    assert all(r["cached"] for r in json.loads(out.read_text())["results"])
    assert main(argv[:-4] + ["--retune", "--json", str(out)]) == 0
    assert not any(r["cached"] for r in json.loads(out.read_text())["results"])
    main(["tune-threads", "--model", "tiny", "--phase", "all", "--context", "16", "--prefill-len", "8", "--json", str(out)])
    assert [r["phase"] for r in json.loads(out.read_text())["results"]] == ["decode", "prefill", "calibrate"]


def test_a_stored_threads_stage_is_stale_only_where_a_sweep_waited_too_long():
    from npuq.runtime.tuning import ThreadsResult
    from npuq.threads import CONTENDED

    assert ThreadsResult.stale({"sweeps": [{"contention": None}, {"contention": CONTENDED + 0.01}]})
    assert not ThreadsResult.stale({"sweeps": [{"contention": CONTENDED}, {"contention": None}]})
    assert not ThreadsResult.stale({"sweeps": [{"phase": "decode"}]})  # stored before npuq read contention
    assert not ThreadsResult.stale({"sweeps": []})  # a streamed model: nothing was timed
