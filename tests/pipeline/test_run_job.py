"""``npuq run`` end to end on a tiny Hugging Face folder: every file of the artifact, the export
and the report; a second run reuses every stage; a change of export options redoes only the
export and its evaluation; Ctrl-C in the middle of calibration, then a resume that gives the
same encodings as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from npuq.cli import main
from npuq.pipeline.stages import MARKER
from run_inputs import inputs, no_contention_verdict  # noqa: F401  (fixtures)
from run_inputs import run_argv as argv

STAGES = ["model", "threads", "quantize", "eval-float", "eval-quantized", "layers", "generate", "export",
          "eval-exported"]
ARTIFACT_FILES = {"decode.json", "prefill.json", "scoring.json", "weights.safetensors", "encodings.json", "config.json"}
ONNX_FILES = {"decode.onnx", "prefill.onnx", "encodings.json", "decode.encodings.json", "prefill.encodings.json",
              "manifest.json"}
REPORT_KEYS = {"npuq_version", "created", "options", "execution", "model", "scheme", "recipe", "threads", "calibration", "layers",
               "perplexity", "export", "generations", "files", "stages", "seconds"}


@pytest.fixture(scope="module")
def first_run(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "job"
    assert main(argv(inputs, out, "--json", str(out.parent / "result.json"))) == 0
    return out, json.loads((out.parent / "result.json").read_text())


def test_run_writes_every_file_and_a_complete_report(first_run):
    out, result = first_run
    assert {p.name for p in (out / "artifact").iterdir()} == ARTIFACT_FILES
    assert {p.name for p in (out / "onnx").iterdir()} == ONNX_FILES
    report = json.loads((out / "report.json").read_text())
    assert report == result  # --json writes the same dict as report.json
    assert REPORT_KEYS <= set(report)
    assert [s["stage"] for s in report["stages"]] == STAGES and not any(s["cached"] for s in report["stages"])
    assert set(report["perplexity"]) == {"float", "quantized", "exported"}
    for row in report["perplexity"].values():
        assert row["tokens"] == 64 and row["word_perplexity"] > 1
    # the exported graphs compute what the quantized programs compute
    q, e = report["perplexity"]["quantized"], report["perplexity"]["exported"]
    assert abs(e["word_perplexity"] / q["word_perplexity"] - 1) < 0.01
    # divergence from float on the same windows (tests/eval/test_eval_kld.py checks the arithmetic): 16a8w
    # moves a tiny random model's logits by little (tests/runtime/test_quantized_cli.py: 6.5e-4 nats)
    assert "kld_mean" not in report["perplexity"]["float"]
    for row in (q, e):
        assert 0 < row["kld_mean"] < 0.01 and row["kld_p99"] > 0 and 0.5 < row["top1_agreement"] <= 1
    assert "KLD mean (nats)" in (out / "report.html").read_text()
    assert report["export"]["qnn_version"] == "2.51.0" and report["export"]["htp_arch"] == 73
    assert len(report["layers"]["layers"]) == 2 * 7 + 1  # q k v o gate up down per layer, and the lm head
    assert [g["prompt"] for g in report["generations"]] and all(g["tokens"] >= 1 for g in report["generations"])
    assert {s["phase"] for s in report["threads"]["sweeps"]} == {"decode", "prefill", "calibrate"}
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "<script" not in html  # self-contained, static
    assert "Quantization error per layer" in html and report["recipe"]["name"] in html
    assert not (out / MARKER).exists()  # finished: no in-progress marker
    # artifact/ and onnx/ are the stage files themselves (hard links), not copies
    stage = next((out / "stages").glob("export-*"))
    assert os.path.samefile(out / "onnx" / "decode.onnx", stage / "onnx" / "decode.onnx")


def test_second_run_reuses_every_stage_and_export_options_redo_only_the_export(first_run, inputs, capsys):
    out, first = first_run
    assert main(argv(inputs, out)) == 0
    again = json.loads((out / "report.json").read_text())
    assert all(s["cached"] for s in again["stages"])
    assert again["perplexity"] == first["perplexity"] and again["layers"] == first["layers"]

    assert main(argv(inputs, out, "--embedding-storage", "int8-rowscale")) == 0
    third = json.loads((out / "report.json").read_text())
    rebuilt = [s["stage"] for s in third["stages"] if not s["cached"]]
    assert rebuilt == ["export", "eval-exported"]
    # the superseded export stage folder was pruned, the new one published
    assert len(list((out / "stages").glob("export-*"))) == 1
    assert json.loads((out / "onnx" / "manifest.json").read_text())["options"]["embedding_storage"] == "int8-rowscale"


def test_a_threads_stage_timed_beside_other_work_is_measured_again(first_run, inputs):
    """A stored threads stage whose sweep waited for a CPU more than CONTENDED of its time is not
    reused: the rerun tunes again (here from the host cache, which holds the first run's quiet
    timings) under the same key, so every later stage is still reused."""
    from npuq.threads import CONTENDED

    out, _ = first_run
    assert main(argv(inputs, out)) == 0  # the default options again (tests before may have changed export's)
    stored = next((out / "stages").glob("threads-*")) / "result.json"
    result = json.loads(stored.read_text())
    assert all(s["contention"] is None for s in result["sweeps"])  # the reading is off in these tests
    result["sweeps"][1]["contention"] = CONTENDED + 0.01
    stored.write_text(json.dumps(result))
    assert main(argv(inputs, out)) == 0
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"] if not s["cached"]] == ["threads"]
    again = json.loads(next((out / "stages").glob("threads-*")).joinpath("result.json").read_text())
    assert all(s["contention"] is None for s in again["sweeps"]) and again["plan"] == result["plan"]
    assert main(argv(inputs, out)) == 0  # now quiet: reused
    assert all(s["cached"] for s in json.loads((out / "report.json").read_text())["stages"])


def test_a_run_without_a_target_chip_says_so_first(first_run, inputs, capsys):
    out, _ = first_run
    capsys.readouterr()
    assert main(argv(inputs, out)) == 0
    assert "no target chip" not in capsys.readouterr().err
    base = argv(inputs, out)
    i = base.index("--htp-arch")
    assert main(base[:i] + base[i + 2:]) == 0
    err = capsys.readouterr().err
    assert "no target chip (--soc / --htp-arch)" in err and "--soc SM8650" in err
    assert err.index("no target chip") < err.index("quantize")  # before any stage's work
    assert main(argv(inputs, out)) == 0  # the next test's starting point: the run with the target


# An alternative value for every ExportOptions field; the test fails for a field missing here.
EXPORT_CHANGES = {"qnn_version": "2.47", "htp_arch": "75", "soc": "SM8650", "embedding_pattern": "legacy",
                  "embedding_storage": "int8-rowscale", "compile": True, "share_weights": True, "genai": "shared",
                  "shards": "1"}  # the run's artifact is one part: one shard, asked for instead of auto
# flags that need a companion flag (--share-weights applies to --compile only)
EXPORT_COMPANIONS = {"share_weights": ["--compile"]}


def test_every_export_option_redoes_exactly_the_export_and_its_evaluation(first_run, inputs):
    """One option at a time (each run differs from the one before in export options only): the run
    rebuilds export and eval-exported and reuses the rest, so no export option can be left out of
    the stage key (the key hashes the whole ExportOptions)."""
    import dataclasses

    from npuq.lower.export import ExportOptions

    assert set(EXPORT_CHANGES) == {f.name for f in dataclasses.fields(ExportOptions)}
    out, _ = first_run
    for name, value in EXPORT_CHANGES.items():
        base = argv(inputs, out)
        if name == "soc":  # --soc and --htp-arch exclude each other
            i = base.index("--htp-arch")
            del base[i:i + 2]
        flag = [f"--{name.replace('_', '-')}"] + ([] if value is True else [value])
        assert main([*base, *EXPORT_COMPANIONS.get(name, []), *flag]) == 0, name
        report = json.loads((out / "report.json").read_text())
        assert [s["stage"] for s in report["stages"] if not s["cached"]] == ["export", "eval-exported"], name
        if value is True:
            assert report["options"]["export"][name] is True, name
        else:
            assert report["options"]["export"][name] in (value, int(value) if value.isdigit() else value), name


def test_interrupted_run_resumes_to_the_same_encodings(first_run, inputs, tmp_path):
    out = tmp_path / "job"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "npuq.cli", *argv(inputs, out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    stage = None
    while time.monotonic() < deadline and proc.poll() is None:  # wait until calibration is under way
        try:
            stage = json.loads((out / MARKER).read_text()).get("stage")
        except (OSError, ValueError):
            stage = None
        if stage == "quantize":
            break
        time.sleep(0.02)
    assert stage == "quantize", "the run never reached the quantize stage"
    proc.send_signal(signal.SIGINT)  # at once: on a fast machine the tiny quantize stage takes about a second
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    # the marker names the stage the interrupt stopped (quantize unless the machine outran the signal);
    # exactly the stages before it are finished, and nothing half-written is left
    stopped = json.loads((out / MARKER).read_text())["stage"]
    before = STAGES[:STAGES.index(stopped)]
    assert not (out / "artifact").exists() or "quantize" in before
    leftovers = [p.name for p in (out / "stages").iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers  # no half-written stage
    finished = {p.name.split("-")[0] for p in (out / "stages").iterdir()}
    assert finished == {s.split("-")[0] for s in before}

    resumed = subprocess.run([sys.executable, "-m", "npuq.cli", *argv(inputs, out)], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"was interrupted (stage {stopped})" in resumed.stderr
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"] if s["cached"]] == before
    reference = json.loads((first_run[0] / "artifact" / "encodings.json").read_text())
    assert json.loads((out / "artifact" / "encodings.json").read_text()) == reference


def test_run_bad_input_is_one_line(inputs, tmp_path, capsys):
    assert main(argv(inputs, tmp_path / "x", "--qnn-version", "two")) == 2
    err = capsys.readouterr().err
    assert err.startswith("npuq: error:") and err.count("\n") == 1


def test_rotation_redoes_quantize_and_layers_compare_in_one_basis(first_run, inputs):
    """--rotate changes the quantize stage's key (so everything after it is rebuilt), the
    report names the rotation, and the per-layer errors compare float and quantized outputs in
    the same (rotated) basis. Bound: an o_proj or down_proj output compared across bases, y·R1
    against y, differs by |y·R1 − y|² ≈ 2|y|² for a Hadamard R1 (yR1 and y are nearly
    orthogonal), an SQNR of about −3 dB; in one basis the 16a8w layers of this model measure
    30.7–44.7 dB with the rotation, so 10 dB separates the two cases with room on both sides."""
    out, _ = first_run
    assert main(argv(inputs, out, "--rotate", "r1+r2")) == 0
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"] if s["cached"]] == ["model", "threads", "eval-float"]
    rotation = report["recipe"]["rotation"]
    assert rotation["r1"] and rotation["r2"] and rotation["untied"] and report["recipe"]["name"].endswith("+r1+r2")
    assert json.loads((out / "artifact" / "config.json").read_text())["rotation"] == rotation
    assert all(layer["output_sqnr_db"] > 10 for layer in report["layers"]["layers"]), report["layers"]["layers"]
    q, e = report["perplexity"]["quantized"], report["perplexity"]["exported"]
    assert abs(e["word_perplexity"] / q["word_perplexity"] - 1) < 0.01
    assert abs(q["word_perplexity"] / report["perplexity"]["float"]["word_perplexity"] - 1) < 0.05


def test_an_edited_recipe_file_redoes_quantize(first_run, inputs, tmp_path):
    """The quantize stage is keyed on the recipe as resolved, not on its name: the same
    --recipe path with other content is a new quantize stage."""
    out, _ = first_run
    recipe = tmp_path / "mine.json"
    recipe.write_text(json.dumps({"default": "16a8w"}))
    assert main(argv(inputs, out, "--recipe", str(recipe))) == 0
    recipe.write_text(json.dumps({"default": "16a8w", "lm_head": "16a16w"}))
    assert main(argv(inputs, out, "--recipe", str(recipe))) == 0
    report = json.loads((out / "report.json").read_text())
    assert "quantize" in [s["stage"] for s in report["stages"] if not s["cached"]]
    assert json.loads((out / "artifact" / "config.json").read_text())["recipe"]["lm_head"] == "16a16w"


def test_bits_per_weight_redoes_quantize_and_the_report_shows_the_size(first_run, inputs):
    """Every run reports its weights' size (16a8w: 8-bit linears, the table shared at 16 bits);
    --bits-per-weight is a new quantize stage whose report, artifact and recipe file show the choice."""
    out, first = first_run
    assert first["bits_per_weight"] == pytest.approx((8 * 2 * 30720 + 8 * 16384 + 16 * 16384) / 94208)
    assert first["weight_bytes"] > 0 and first["recipe"]["budget"] is None
    assert main(argv(inputs, out, "--bits-per-weight", "6")) == 0
    report = json.loads((out / "report.json").read_text())
    assert "quantize" in [s["stage"] for s in report["stages"] if not s["cached"]]
    assert report["bits_per_weight"] <= 6 and report["recipe"]["budget"]["target_bits"] == 6
    assert json.loads((out / "artifact" / "recipe.json").read_text())["name"] == report["recipe"]["name"] == "budget-6"
    html = (out / "report.html").read_text()
    assert "bits per weight" in html and "--bits-per-weight" in html
    q, e = report["perplexity"]["quantized"], report["perplexity"]["exported"]
    assert abs(e["word_perplexity"] / q["word_perplexity"] - 1) < 0.01  # the chosen formats export as quantized


def test_a_run_in_parts_measures_what_the_whole_model_run_measures(first_run, inputs, tmp_path):
    """--parts 2: every stage runs the artifact's parts (the layers stage records each part's
    linear layers) and finds the one-part run's per-layer errors and perplexities."""
    _, whole = first_run
    assert main(argv(inputs, tmp_path / "parts", "--parts", "2", "--json", str(tmp_path / "parts.json"))) == 0
    parts = json.loads((tmp_path / "parts.json").read_text())
    assert (tmp_path / "parts" / "artifact" / "part-2-of-2").is_dir()
    assert parts["layers"] == whole["layers"]
    for row in ("float", "quantized", "exported"):
        assert parts["perplexity"][row]["word_perplexity"] == whole["perplexity"][row]["word_perplexity"], row
    assert [g["quantized"] for g in parts["generations"]] == [g["quantized"] for g in whole["generations"]]


def test_a_model_too_large_for_memory_runs_streamed_with_the_same_scores(inputs, tmp_path, monkeypatch):
    """Where the float model does not fit, the run streams it (one block resident at a time): the
    float perplexity, the divergence of the quantized graphs from it and the float generations
    are the resident run's; threads are not timed and the per-layer errors not measured, and the
    report says so."""
    import npuq.pipeline.job as job

    assert main(argv(inputs, tmp_path / "resident", "--json", str(tmp_path / "resident.json"))) == 0
    whole = json.loads((tmp_path / "resident.json").read_text())
    monkeypatch.setattr(job, "model_fits", lambda cfg: False)  # as if it did not fit (quantize streams on its own)
    assert main(argv(inputs, tmp_path / "streamed", "--json", str(tmp_path / "streamed.json"))) == 0
    streamed = json.loads((tmp_path / "streamed.json").read_text())
    for row in ("float", "quantized", "exported"):
        for key in ("word_perplexity", "kld_mean", "top1_agreement"):
            assert streamed["perplexity"][row].get(key) == whole["perplexity"][row].get(key), (row, key)
    assert [g["float"] for g in streamed["generations"]] == [g["float"] for g in whole["generations"]]
    assert streamed["threads"]["sweeps"] == [] and streamed["layers"]["layers"] == []
    html = (tmp_path / "streamed" / "report.html").read_text()
    assert "Not measured: the float model did not fit memory" in html and "Not timed" in html
    # in the resident run's folder, only the stages that measure a streamed model differently redo
    assert main(argv(inputs, tmp_path / "resident", "--json", str(tmp_path / "again.json"))) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert {s["stage"] for s in again["stages"] if not s["cached"]} == {"threads", "layers"}
