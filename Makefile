# The README's two commands: `make run` (the whole pipeline on the CPU default) and `make test` (the full suite).
# Both bootstrap .venv from nothing; re-installation is skipped while pyproject.toml and constraints.txt are unchanged.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

include env.mk
export

.PHONY: run test lint format bench clean-venv

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so the CPU build on local disk is used (a looser pin pulls a multi-GB CUDA build).
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/dapo pipeline

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean-venv:
	rm -rf $(VENV)
