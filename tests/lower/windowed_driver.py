"""onnxruntime-genai's windowed KV cache, driven here from its documented behaviour (docs/design.md
§10, §11): the reference driver of a ``npuq export --genai windowed`` folder. Used by
test_lower_genai.py and by bench/genai.py."""

import json

import numpy as np

from npuq.lower.ort import cpu_session, htp_session


class WindowedDriver:
    """onnxruntime-genai's windowed KV cache as its documentation and probes describe it, driving
    a folder's stages (from genai_config.json) on ONNX Runtime's exact CPU sessions:

    - the prompt is left-padded with pad_token_id to whole windows of W; pads get position 0, real
      tokens 0, 1, ...; each call gets input_ids / position_ids [1, W], then [1, 1] per new token;
    - attention_mask [1, ctx] int64: 1 for every real token seen so far, right-aligned, the current
      call's tokens in the last columns;
    - per layer one uint8 K input [KV, 1, D, ctx - T] and V input [KV, 1, ctx - T, D] for a call of
      T tokens (W for the prompt, then 1), right-aligned, empty slots holding pad_value; after a call
      its outputs [.., T] are appended at the right and the oldest entries dropped (between prompt
      windows the runtime shifts by W; at the switch to token generation it keeps the last ctx - 1).
      Here each layer keeps the last ctx entries and a call reads the last ctx - T of them.

    Each stage runs where genai_config.json puts it (its own session options, else the decoder's):
    on the QNN provider, the HTP emulator with that HTP arch; otherwise (or with ``cpu_only``,
    to run the same folder's stages on the CPU) the exact CPU session. ``qdq``: a stage that
    names a compiled context runs the QDQ graph it was compiled from (manifest.json) instead,
    which the CPU can open too. ``files``: the file each stage runs."""

    def __init__(self, folder, cpu_only=False, qdq=False):
        self.folder = folder
        manifest = json.loads((folder / "manifest.json").read_text())
        compiled = (manifest.get("compiled") or {}).get("graphs", {})
        shards = manifest.get("shards") or []
        entries = manifest.get("graphs") or {f"{kind}.part-{k + 1}-of-{len(shards)}": g  # a sharded export's graphs
                                             for k, shard in enumerate(shards) for kind, g in shard["graphs"].items()}
        graph_of = {c["file"]: entries[name]["file"] for name, c in compiled.items()} if qdq else {}
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        self.ctx, self.pad_id = config["context_length"], config["pad_token_id"]
        dec = config["decoder"]
        self.names, self.layers = dec["inputs"], dec["num_hidden_layers"]
        self.present = dec["outputs"]
        window = dec["sliding_window"]
        assert window["alignment"] == "right" and window["slide_inputs"] and window["slide_key_value_cache"]
        self.W, self.pad = window["window_size"], window["pad_value"]
        self.stages = [next(iter(s.items())) for s in dec["pipeline"]]
        self.sessions, self.files = {}, {}
        for name, stage in self.stages:
            providers = stage.get("session_options", dec["session_options"])["provider_options"]
            qnn = next((p["qnn"] for p in providers if "qnn" in p), None)
            self.files[name] = graph_of.get(stage["filename"], stage["filename"])
            path = folder / self.files[name]
            use_htp = qnn is not None and not cpu_only
            self.sessions[name] = htp_session(path, int(qnn["htp_arch"])) if use_htp else cpu_session(path)
        self.logits = []  # the last position's logits of every call
        kv, d = dec["num_key_value_heads"], dec["head_size"]
        self.k = [np.full((kv, 1, d, self.ctx), self.pad, np.uint8) for _ in range(self.layers)]
        self.v = [np.full((kv, 1, self.ctx, d), self.pad, np.uint8) for _ in range(self.layers)]
        self.valid = []  # one flag per token fed (pads 0), oldest first

    def _call(self, ids, positions, prompt):
        T = len(ids)
        mask = np.zeros((1, self.ctx), np.int64)
        seen = self.valid[-self.ctx:]
        mask[0, self.ctx - len(seen):] = seen
        values = {self.names["input_ids"]: np.array([ids], np.int32), self.names["position_ids"]: np.array([positions],
                  np.int32), self.names["attention_mask"]: mask}
        for i in range(self.layers):
            values[self.names["past_key_names"] % i] = np.ascontiguousarray(self.k[i][..., T:])
            values[self.names["past_value_names"] % i] = np.ascontiguousarray(self.v[i][:, :, T:])
        for name, stage in self.stages:
            if stage["run_on_prompt"] != prompt and stage["run_on_token_gen"] == prompt:
                continue
            session = self.sessions[name]
            out = session.run(stage["outputs"], {n: values[n] for n in stage["inputs"]})
            values.update(zip(stage["outputs"], out))
        for i in range(self.layers):  # append the new entries, drop the oldest
            k_new, v_new = values[self.present["present_key_names"] % i], values[self.present["present_value_names"] % i]
            assert k_new.shape[-1] == T and v_new.shape[-2] == T
            self.k[i] = np.concatenate([self.k[i][..., T:], k_new], axis=-1)
            self.v[i] = np.concatenate([self.v[i][:, :, T:], v_new], axis=-2)
        self.logits.append(values[self.present["logits"]][0, -1])
        return self.logits[-1]

    def generate(self, prompt_ids, n):
        pads = -len(prompt_ids) % self.W
        ids = [self.pad_id] * pads + list(prompt_ids)
        positions = [0] * pads + list(range(len(prompt_ids)))
        for start in range(0, len(ids), self.W):
            window = ids[start:start + self.W]
            self.valid += [0 if start + j < pads else 1 for j in range(self.W)]
            logits = self._call(window, positions[start:start + self.W], prompt=True)
        tokens, position = [int(np.argmax(logits))], len(prompt_ids)
        while len(tokens) < n:
            self.valid.append(1)
            logits = self._call([tokens[-1]], [position], prompt=False)
            tokens.append(int(np.argmax(logits)))
            position += 1
        return tokens
