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
	@if $(BIN)/dapo pipeline --help >/dev/null 2>&1; then \
		$(BIN)/dapo pipeline; \
	else \
		echo "== dapo-flow: the end-to-end pipeline (curate -> base model -> train -> evaluate) is not built yet."; \
		echo "== What exists: the algorithm core, rewards, config/recipes and engines (see README 'Status')."; \
		echo "== The resolved default config (params.yaml) that the pipeline will run:"; \
		$(BIN)/dapo config show; \
	fi

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do m=$${b%.py}; $(BIN)/python -m $${m//\//.} || exit 1; done

clean-venv:
	rm -rf $(VENV)
