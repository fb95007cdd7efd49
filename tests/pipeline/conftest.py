"""Shared inputs of the npuq run tests: a tiny Hugging Face folder and a text file of its words."""

import pytest
import torch

from npuq.models.tiny import save_tiny_hf_folder


@pytest.fixture(scope="session")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-inputs")
    folder = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=g)))
    return folder, text

