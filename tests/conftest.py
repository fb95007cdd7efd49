"""Suite-wide setup: npuq's cache (GGUF metadata, thread tuning) goes to a fresh temporary folder,
removed when the session ends;
Ctrl-C reaches the suite and its child processes as in a terminal; torch runs on one intra-op
thread and every test starts from its global RNG seeded 0; the tiny artifact and export folders
the reader tests start from."""

import gc
import os
import shutil
import signal
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="npuq-test-cache-")
os.environ["NPUQ_CACHE_DIR"] = _CACHE
# A suite started in the background of a non-interactive shell inherits SIGINT ignored (POSIX),
# and so would every npuq process it starts: the interruption tests would wait forever on a
# Ctrl-C that never arrives. A handler (unlike "ignored") is reset to the default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session, exitstatus):
    """The cache goes with the session: with the real-model tests it holds a GGUF conversion of
    about 0.5 GB, which each run used to leave behind in the temporary folder."""
    shutil.rmtree(_CACHE, ignore_errors=True)
    gc.unfreeze()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "own_threads: the test runs at torch's default thread count and with its global RNG as "
        "it finds it (not the suite's 1 thread and seed 0), and must fix both itself")


@pytest.fixture(scope="module", autouse=True)
def _earlier_objects_frozen():
    """Each test module starts with a full collection, then moves every object still alive into
    the collector's permanent generation (``gc.freeze``), which later collections do not walk.
    Why: every torch.export leaves its ShapeEnv reachable from torch's C++ side (with its
    symbolic sizes and fake-tensor dispatch cache, about 12,000 objects), so the session's
    tracked objects grow to about 3.7 million, and each full ``gc.collect()`` (npuq makes one
    after each stage of ``npuq run`` and after each quantized part) walked them all, about a
    second each: 300 s of the suite, half of tests/pipeline/test_run_job.py's time. Frozen,
    those calls walk only what the module made. What they free is unchanged: garbage is
    collected before each freeze, a module's own fixtures and objects are created after it,
    and memory held only through reference counts is released as before (freezing affects
    the cycle collector only)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for the whole session, session fixtures included (autouse fixtures
    are set up first in their scope): torch splits its reductions by thread count, so float
    results would otherwise depend on the machine's core count. Yields torch's default count,
    restored at the end."""
    import torch

    default = torch.get_num_threads()
    torch.set_num_threads(1)
    yield default
    torch.set_num_threads(default)


@pytest.fixture(autouse=True)
def _deterministic_torch(request, _one_torch_thread):
    """Each test: torch's global RNG seeded 0 (its state before the test restored after it, so
    tests do not depend on which ran before), and the thread count back to 1 whatever the test
    left. A test marked ``own_threads`` gets torch's default count and the RNG untouched."""
    import torch

    if request.node.get_closest_marker("own_threads"):
        torch.set_num_threads(_one_torch_thread)
        try:
            yield
        finally:
            torch.set_num_threads(1)
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """A tiny Llama quantized 16a8w by npuq itself (context 16, prefill 4, 64 calibration tokens,
    the default batch), built once per session: ``.artifact`` and ``.onnx`` folders (the seeds of
    the reader tests; copy before changing them), and the ``.model``, ``.tokens`` and
    ``.quantized`` model they came from."""
    from types import SimpleNamespace

    import torch

    from npuq.lower.export import ExportOptions, export_artifact
    from npuq.testing.tiny import tiny_decoder
    from npuq.quantize.artifact import save_artifact
    from npuq.quantize.pt2e import quantize_model
    from npuq.quant.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny-folders")
    _, model = tiny_decoder("llama", max_context=16)
    tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    qm = quantize_model(model, load_recipe(None, "16a8w"), tokens, context=16, prefill_len=4)
    artifact = save_artifact(qm, root / "artifact")
    export_artifact(artifact, root / "onnx", ExportOptions(qnn_version="2.51", htp_arch=73))
    return SimpleNamespace(artifact=artifact, onnx=root / "onnx", model=model, tokens=tokens, quantized=qm)
