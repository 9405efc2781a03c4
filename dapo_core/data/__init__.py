"""Datasets: the verl RL schema, source loaders, prompt templates, curation, the data card, the synthetic task.

from dapo_core.data import load_source, curate, build_card, load_token_counter
rows = load_source("data/synthetic/problems.jsonl")
result = curate([rows], template="tiny", max_prompt_length=32, count_tokens=load_token_counter(), val_size=200)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dapo_core.data.schema import (
    REQUIRED_COLUMNS,
    ProblemRecord,
    SchemaError,
    read_rl_files,
    read_rl_parquet,
    record_from_row,
    rl_table,
    write_rl_parquet,
)

# The rest loads on first use (PEP 562), so `dapo_core.data.schema` users do not pay for pyarrow/pydantic models.
_LAZY = {
    "dapo_core.data.card": ("build_card", "dataset_digest", "render_markdown", "write_card"),
    "dapo_core.config.curation": ("CurationConfig", "SyntheticDataConfig"),  # the config section, re-exported
    "dapo_core.data.curate": ("curate", "integer_ground_truth", "problem_key"),
    "dapo_core.data.curate_report": ("DROP_REASONS", "CurationReport", "CurationResult"),
    "dapo_core.data.loaders": (
        "SourceRows", "SourceSpec", "available_loaders", "get_loader", "load_source", "register_loader",
    ),
    "dapo_core.data.templates": (
        "PromptTemplate", "available_templates", "detect_template", "get_template", "load_token_counter",
        "register_template", "strip_template",
    ),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:
    from dapo_core.config.curation import CurationConfig, SyntheticDataConfig
    from dapo_core.data.card import build_card, dataset_digest, render_markdown, write_card
    from dapo_core.data.curate import curate, integer_ground_truth, problem_key
    from dapo_core.data.curate_report import DROP_REASONS, CurationReport, CurationResult
    from dapo_core.data.loaders import (
        SourceRows,
        SourceSpec,
        available_loaders,
        get_loader,
        load_source,
        register_loader,
    )
    from dapo_core.data.templates import (
        PromptTemplate,
        available_templates,
        detect_template,
        get_template,
        load_token_counter,
        register_template,
        strip_template,
    )


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'dapo_core.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


__all__ = [
    "DROP_REASONS",
    "REQUIRED_COLUMNS",
    "CurationConfig",
    "CurationReport",
    "CurationResult",
    "ProblemRecord",
    "PromptTemplate",
    "SchemaError",
    "SourceRows",
    "SourceSpec",
    "SyntheticDataConfig",
    "available_loaders",
    "available_templates",
    "build_card",
    "curate",
    "dataset_digest",
    "detect_template",
    "get_loader",
    "get_template",
    "integer_ground_truth",
    "load_source",
    "load_token_counter",
    "problem_key",
    "read_rl_files",
    "read_rl_parquet",
    "record_from_row",
    "register_loader",
    "register_template",
    "render_markdown",
    "rl_table",
    "strip_template",
    "write_card",
    "write_rl_parquet",
]
