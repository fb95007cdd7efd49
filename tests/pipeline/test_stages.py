"""Stage caching: reuse by key, rebuild on changed inputs, nothing half-written after a failure."""

import pytest

from npuq.pipeline.stages import MARKER, RunDir
from npuq.records import record_key


def test_key_is_stable_and_order_free():
    assert record_key({"a": 1, "b": [1, 2]}) == record_key({"b": [1, 2], "a": 1})
    assert record_key({"a": 1}) != record_key({"a": 2})


def test_reuse_and_rebuild(tmp_path):
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "data.txt").write_text("x")
        return {"value": len(calls)}

    run = RunDir(tmp_path)
    f1, r1 = run.stage("calibrate", record_key({"scheme": "16a8w"}), build)
    f2, r2 = run.stage("calibrate", record_key({"scheme": "16a8w"}), build)
    f3, r3 = run.stage("calibrate", record_key({"scheme": "16a4w"}), build)
    assert f1 == f2 and r1 == r2 == {"value": 1} and f3 != f1 and r3 == {"value": 2}
    assert [e.cached for e in run.log] == [False, True, False]
    assert (f1 / "data.txt").read_text() == "x"


def test_a_result_its_record_calls_stale_is_built_again_in_place(tmp_path):
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "data.txt").write_text(str(len(calls)))
        return {"value": len(calls)}

    def stale(result):
        return result["value"] == 1

    run = RunDir(tmp_path)
    key = record_key({"scheme": "16a8w"})
    f1, _ = run.stage("threads", key, build)
    f2, r2 = run.stage("threads", key, build, stale)  # the stored result is rejected: built again
    f3, r3 = run.stage("threads", key, build, stale)  # the new one is kept
    assert f1 == f2 == f3 and r2 == r3 == {"value": 2} and (f1 / "data.txt").read_text() == "2"
    assert [e.cached for e in run.log] == [False, False, True]
    assert [p.name for p in (tmp_path / "stages").iterdir()] == [f1.name]  # replaced, nothing left aside


def test_failed_stage_leaves_nothing_and_marker_reports_it(tmp_path):
    def boom(folder):
        (folder / "partial.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    run = RunDir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run.stage("export", record_key({"v": 1}), boom)
    assert not list((tmp_path / "stages").glob("export-*"))
    assert not list((tmp_path / "stages").glob(".*"))  # no temporary folder left either
    again = RunDir(tmp_path)
    assert again.interrupted["stage"] == "export"
    again.finish()
    assert not (tmp_path / MARKER).exists()
    assert RunDir(tmp_path).interrupted is None
