"""Guards around the artifact: calibration memory (a smaller batch, same encodings), free disk
before writing, file names that must stay inside the folder, and programs whose archive would
make torch unpickle or run code."""

import contextlib
import io
import json
import re
import shutil
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower.export import ExportOptions, export_artifact
from npuq.quantize import pt2e as pipeline
from npuq.quantize.artifact import (
    estimate_artifact_bytes,
    load_artifact,
    load_program,
    read_artifact,
    save_artifact,
)
from npuq.quant.recipe import load_recipe
from npuq.resources import USABLE_FRACTION, onepass_window_bytes

Usage = namedtuple("Usage", "total used free")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


# --------------------------------------------------------------------------- memory
def test_memory_estimate_forces_a_smaller_batch_with_the_same_encodings(tiny_folders, monkeypatch):
    model, tokens = tiny_folders.model, tiny_folders.tokens
    per_window = onepass_window_bytes(model.config, 16)
    monkeypatch.setattr(pipeline, "available_memory", lambda device=None: int(1.5 * per_window / USABLE_FRACTION))
    batches = []
    real = pipeline.calibrate_onepass

    def recording(graph, cfg, windows, batch_size, progress=None):
        batches.append(batch_size)
        return real(graph, cfg, windows, batch_size, progress)

    monkeypatch.setattr(pipeline, "calibrate_onepass", recording)
    with pytest.warns(UserWarning, match=r"--batch-size 8 would need .* calibrating 1 window\(s\) per forward"):
        qm = pipeline.quantize_model(model, load_recipe(None, "16a8w"), tokens, context=16, prefill_len=4, batch_size=8)
    assert batches == [1] and qm.stats["batch_size"] == 1
    # min/max encodings do not depend on how the windows were batched (the session's artifact used batch 8)
    reference = tiny_folders.quantized.encodings
    for section in ("activation_encodings", "param_encodings"):
        got = {e["name"]: e for e in qm.encodings[section]}
        assert set(got) == {e["name"] for e in reference[section]}
        for e in reference[section]:
            assert got[e["name"]]["scale"] == pytest.approx(e["scale"], rel=1e-5), e["name"]
            assert max(abs(a - b) for a, b in zip(got[e["name"]]["offset"], e["offset"], strict=True)) <= 1


# --------------------------------------------------------------------------- disk
def _free(monkeypatch, free):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, free))


def test_artifact_estimate_covers_what_is_written(tiny_folders):
    written = _size(tiny_folders.artifact)
    assert written <= estimate_artifact_bytes(tiny_folders.quantized) <= 3 * written


def test_full_disk_refuses_the_artifact_before_writing(tiny_folders, tmp_path, monkeypatch):
    old = tmp_path / "art"
    old.mkdir()
    (old / "previous.txt").write_text("keep me")
    _free(monkeypatch, 1 << 20)
    for target, force in ((tmp_path / "new", False), (old, True)):
        with pytest.raises(NpuqError, match=r"the artifact .* needs about [\d.]+ MiB but only 1\.0 MiB is free"):
            save_artifact(tiny_folders.quantized, target, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # nothing written, no temporary folder
    assert [p.name for p in old.iterdir()] == ["previous.txt"]


def test_full_disk_refuses_the_export_with_the_size_it_needs(tiny_folders, tmp_path, monkeypatch):
    _free(monkeypatch, 1 << 20)
    with pytest.raises(NpuqError, match=r"the export .* needs about") as exc:
        export_artifact(tiny_folders.artifact, tmp_path / "onnx", ExportOptions(qnn_version="2.51", htp_arch=73))
    needed = float(re.search(r"needs about ([\d.]+) MiB", str(exc.value)).group(1)) * (1 << 20)
    assert needed >= _size(tiny_folders.onnx)  # the real export of the same artifact
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- names in config.json
def _set_program_file(folder: Path, name: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["programs"]["decode"]["file"] = name
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_program_outside_the_artifact_is_refused(tiny_folders, tmp_path, capsys, kind):
    art = _copy(tiny_folders.artifact, tmp_path)
    outside = tmp_path / "elsewhere.pt2"
    shutil.copy(art / "decode.pt2", outside)  # a real program: only the location is wrong
    if kind == "dotdot":
        _set_program_file(art, "../elsewhere.pt2")
    elif kind == "absolute":
        _set_program_file(art, str(outside))
    else:
        (art / "decode.pt2").unlink()
        (art / "decode.pt2").symlink_to(outside)
    message = "is a link to" if kind == "symlink" else "points outside"
    with pytest.raises(NpuqError, match=message):
        read_artifact(art)
    with pytest.raises(NpuqError, match=message):
        export_artifact(art, tmp_path / "onnx", ExportOptions(qnn_version="2.51"))
    capsys.readouterr()
    assert main(["eval", "--artifact", str(art), "--context", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_damaged_encodings_are_refused_before_the_programs_load(tiny_folders, tmp_path, monkeypatch):
    art = _copy(tiny_folders.artifact, tmp_path)
    enc = json.loads((art / "encodings.json").read_text())
    enc["activation_encodings"][3]["scale"][0] = -1.0
    (art / "encodings.json").write_text(json.dumps(enc))
    import npuq.quantize.artifact as artifact_mod

    monkeypatch.setattr(artifact_mod, "load_program", lambda path: pytest.fail("loaded a program first"))
    name = enc["activation_encodings"][3]["name"]
    with pytest.raises(NpuqError, match=rf"activation_encodings\[3\] \({re.escape(name)}\): every scale must be"):
        load_artifact(art)


# --------------------------------------------------------------------------- pickle in programs
def _rewrite(src: Path, dst: Path, change) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = change(item.filename, zin.read(item.filename))
            if data is not None:
                zout.writestr(item, data)


class _Touch:
    """Unpickling this creates a file: proof that code from the archive ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_sample_inputs_with_code_are_refused_and_never_run(tiny_folders, tmp_path):
    marker = tmp_path / "code-ran"
    buf = io.BytesIO()
    torch.save((_Touch(marker),), buf)
    evil = tmp_path / "decode.pt2"
    _rewrite(tiny_folders.artifact / "decode.pt2", evil,
             lambda name, data: buf.getvalue() if name.endswith("data/sample_inputs/model.pt") else data)
    with pytest.raises(NpuqError, match="pickled object other than plain tensors; refusing to unpickle"):
        load_program(evil)
    assert not marker.exists()
    # The danger is real: torch.export.load alone falls back to a full unpickle and runs it. (Its
    # warning about the fallback has a broken format string, which pytest's log capture raises.)
    with contextlib.suppress(TypeError):
        torch.export.load(evil)
    assert marker.exists()


def test_pickled_payloads_and_compiled_code_are_refused_unread(tiny_folders, tmp_path):
    src = tiny_folders.artifact / "decode.pt2"

    def mark_pickled(name, data):
        if name.endswith("_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            return json.dumps(config).encode()
        return data

    _rewrite(src, tmp_path / "pickled.pt2", mark_pickled)
    with pytest.raises(NpuqError, match="stored as a pickled object"):
        load_program(tmp_path / "pickled.pt2")
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
    shutil.copy(src, tmp_path / "aoti.pt2")
    with zipfile.ZipFile(tmp_path / "aoti.pt2", "a") as z:
        z.writestr(f"{root}/data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(NpuqError, match="holds data/aotinductor/model/model.so, which loading would"):
        load_program(tmp_path / "aoti.pt2")
    assert isinstance(load_program(src), torch.export.ExportedProgram)  # npuq's own programs pass
