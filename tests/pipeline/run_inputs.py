"""The tiny inputs and the npuq run command line the run tests share (imported, not a conftest:
tests elsewhere import their own conftest by name)."""

import pytest
import torch

from npuq.testing.tiny import save_tiny_hf_folder


@pytest.fixture(scope="module", autouse=True)
def no_contention_verdict():
    """The run tests assert which stages a rerun reuses; a threads stage timed on a busy machine
    would rightly be measured again (test_run_job.py tests that by editing its result), so the
    CPU-waiting reading is off here and the host cache keeps the first run's timings."""
    from npuq.threads import contention

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contention, "snapshot", lambda: None)
        yield


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-inputs")
    folder = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=g)))
    return folder, text


def run_argv(inputs, out, *extra):
    """``npuq run`` on the tiny inputs: cheap sizes, a fixed target and one thread."""
    folder, text = inputs
    return ["run", "--model", str(folder), "--calib-corpus", f"file:{text}", "--eval-corpus", f"file:{text}",
            "--context", "32", "--calib-tokens", "64", "--eval-tokens", "64", "--gen-tokens", "4",
            "--qnn-version", "2.51", "--htp-arch", "73", "--num-threads", "1", "--out", str(out), *extra]
