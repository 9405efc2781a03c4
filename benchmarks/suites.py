"""The benchmark suites `dapo bench` runs: discovery, one-line descriptions and prerequisites (stdlib only).

A suite is a module ``benchmarks/bench_<name>.py`` run as ``python -m benchmarks.bench_<name>`` from the repository
root; it writes ``benchmarks/results/<name>.json`` and ``.md``. Adding one: drop the file in ``benchmarks/`` (its
docstring's first line is its description in ``dapo bench --list``), add its name to ``NEEDS_BASE_MODEL`` if it
starts from the warm-started base model and the curated data, and a headline extractor to
``benchmarks/summary.py``. Nothing here imports torch: ``dapo bench --list`` stays instant.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

# suites that start from `outputs/base_model` and `outputs/curated/{train,val}.parquet`
# (benchmarks/common.py:require_base_and_data); `dapo bench` skips them when those are missing, unless --prepare
NEEDS_BASE_MODEL = frozenset({"overlap", "trl", "overhead", "pi_old"})
BASE_MODEL_FILES = ("outputs/base_model/config.json",)
CURATED_FILES = ("outputs/curated/train.parquet", "outputs/curated/val.parquet")
# the `dapo` commands that create them, in pipeline order: (command, the files it creates)
PREPARE_COMMANDS = (("curate", CURATED_FILES), ("base-model", BASE_MODEL_FILES))
PREPARE_FIX = "run `make run`, or `dapo curate` + `dapo base-model`, or `dapo bench --prepare`"

# suites that need a Python package the project does not install by default: skipped (with the reason) without it
NEEDS_MODULE = {"vllm": ("vllm", "a CUDA GPU and the vllm package (pip install .[gpu]); it measures nothing elsewhere")}

# what else to know before running a suite (shown by `dapo bench --list`)
NOTES = {
    "rollout": "vLLM rows only when run from .venv-vllm; the warm-started base-model case only when it exists",
    "trl": "creates .venv-trl (pinned TRL, ~2 GB) on its first run",
    "fsdp": "writes fsdp_cuda.* instead on a CUDA machine",
}


@dataclass(frozen=True)
class Suite:
    """One ``benchmarks/bench_<name>.py``."""

    name: str
    path: Path

    @property
    def module(self) -> str:
        return f"benchmarks.bench_{self.name}"


def discover(root: Path) -> list[Suite]:
    """Every ``benchmarks/bench_*.py`` under ``root``, sorted by name."""
    return [Suite(p.stem.removeprefix("bench_"), p) for p in sorted((root / "benchmarks").glob("bench_*.py"))]


def description(path: Path) -> str:
    """The module docstring's first line (its first sentence when that wraps onto the next line), read with ``ast``:
    the module is not imported."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError, ValueError):
        return "(docstring unreadable)"
    first = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    return first.replace("``", "`") or "(no docstring)"


def prerequisites(name: str) -> str:
    """What the suite needs, and what else to know, in words (``dapo bench --list``)."""
    needs = []
    if name in NEEDS_BASE_MODEL:
        needs.append("the base model + curated data (make run, or dapo curate + dapo base-model, or --prepare)")
    if name in NEEDS_MODULE:
        needs.append(NEEDS_MODULE[name][1])
    return f"needs {' and '.join(needs) or 'nothing'}" + (f"; {NOTES[name]}" if name in NOTES else "")


def missing_files(name: str, root: Path) -> list[str]:
    """The base-model / curated-data files ``name`` needs that are missing under ``root`` (relative paths)."""
    if name not in NEEDS_BASE_MODEL:
        return []
    return [f for f in (*CURATED_FILES, *BASE_MODEL_FILES) if not (root / f).is_file()]


def skip_reason(name: str, root: Path) -> str | None:
    """Why ``name`` cannot run here (with the fix), or None when it can."""
    missing = missing_files(name, root)
    if missing:
        return f"needs {', '.join(missing)}: {PREPARE_FIX}"
    if name in NEEDS_MODULE and importlib.util.find_spec(NEEDS_MODULE[name][0]) is None:
        return f"needs {NEEDS_MODULE[name][1]}"
    return None
