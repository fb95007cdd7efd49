"""A conversation through onnxruntime-genai's own API and the same conversation through npuq's
runner (docs/design.md §11): used by test_lower_genai*.py and by bench/genai.py."""

import json

from npuq.lower.ort import load_export
from npuq.runtime.runner import StaticRunner


def og_model(folder, threads=None):
    """``og.Model`` of the folder; ``threads``: its graphs' intra-op thread count (ONNX Runtime's
    CPU kernels split sums by thread, so bit-for-bit comparisons pin it to npuq's; None: og's
    default, half the hardware threads)."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    if threads is not None:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def og_conversation(folder, turns, max_length=None, threads=None):
    """As a chat app does with onnxruntime-genai: one generator; per turn (token ids, n),
    append_tokens, then generate_next_token until n tokens or is_done(). Returns each turn's
    generated tokens. ``max_length``: default genai_config.json's context_length."""
    import onnxruntime_genai as og

    model = og_model(folder, threads)
    params = og.GeneratorParams(model)
    if max_length is None:
        max_length = json.loads((folder / "genai_config.json").read_text())["model"]["context_length"]
    params.set_search_options(max_length=max_length, do_sample=False)
    generator = og.Generator(model, params)
    out = []
    for ids, n in turns:
        generator.append_tokens(ids)
        got = []
        while len(got) < n and not generator.is_done():
            generator.generate_next_token()
            got.append(int(generator.get_next_tokens()[0]))
        out.append(got)
    return out


def npuq_conversation(folder, turns, eos=None):
    """The same conversation through npuq's runner over the folder's graphs (what `npuq generate
    --onnx` runs): each turn feeds its tokens, then each generated token but the last, which
    onnxruntime-genai samples and never feeds before the next append; a turn stops at ``eos``."""
    manifest, graphs = load_export(folder)
    runner = StaticRunner(manifest.cfg, graphs, manifest.context)
    out = []
    for ids, n in turns:
        got = [int(runner.feed(ids)[0, -1].argmax())]
        while len(got) < n and got[-1] != eos:
            got.append(int(runner.feed([got[-1]])[0, -1].argmax()))
        out.append(got)
    return out


def chat_ids(tokenizer, texts):
    """Token ids of each user turn as a chat app builds them with onnxruntime-genai's tokenizer
    (``og.Tokenizer``) and the folder's chat template: the first turn whole (with the template's
    system prompt), each later turn the template of that message alone from the end-of-turn token
    before its "user" header on: onnxruntime-genai samples the previous answer's end-of-turn token
    but never feeds it, so the turn closes the answer first. ChatML templates (SmolLM2, Qwen2.5)."""
    turns = []
    for i, text in enumerate(texts):
        prompt = tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": text}]),
                                               add_generation_prompt=True)
        if i:
            prompt = prompt[prompt.rindex("<|im_end|>\n<|im_start|>user"):]
        turns.append([int(t) for t in tokenizer.encode(prompt)])
    return turns
