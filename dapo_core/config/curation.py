"""The ``curation`` section: the sources to curate, the train/validation split and the synthetic raw file.

Split out of ``dapo_core.data`` (which imports it from here): config sections live in ``dapo_core.config``, so
the config never imports the data code. ``data.template`` and ``data.max_prompt_length`` come from the ``data``
section (the trainer reads them too).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from dapo_core.config.section import _Section

DEFAULT_DATA_SOURCE = "math_dapo"  # problem/answer rows: the reward family and the val-metric name


class SourceSpec(_Section):
    """One input: a local file or ``hf:<dataset id>``. A bare string is read as ``{"path": ...}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="Local file (.parquet/.jsonl/.csv) or 'hf:<owner>/<name>' (Hugging Face).")
    format: str | None = Field(default=None, description="Loader name; null = from the path (see available_loaders).")
    data_source: str | None = Field(
        default=None,
        description="data_source of every row (names val metrics); null = the file's own column (verl), "
        f"else {DEFAULT_DATA_SOURCE!r}.",
    )
    problem_key: str = Field(default="problem", description="Problem column of problem/answer files.")
    answer_key: str = Field(default="answer", description="Answer column of problem/answer files.")
    split: str = Field(default="train", description="Split of a Hugging Face dataset.")
    revision: str | None = Field(default=None, description="Revision (commit/tag) of a Hugging Face dataset.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"path": os.fspath(value)} if isinstance(value, (str, os.PathLike)) else value


class SyntheticDataConfig(_Section):
    """The seeded raw file of the CPU default (``dapo data generate``): same values, same bytes."""

    path: str = Field(
        default="data/synthetic/problems.jsonl",
        description="Raw jsonl written by `dapo data generate`; inside data/, which data.dvc tracks.",
    )
    n: int = Field(default=20_000, gt=0, description="Problems to generate (duplicates are removed by curation).")
    seed: int = Field(default=0, description="Generator seed (fixed: the file must be re-creatable bit-identically).")
    min_ops: int = Field(default=1, ge=1, description="Fewest operations per problem (difficulty).")
    max_ops: int = Field(default=4, ge=1, description="Most operations per problem; longer solutions.")
    data_source: str = Field(default="synthetic", description="data_source of its rows (names val metrics).")


class CurationConfig(_Section):
    """The ``curation:`` section of params.yaml (a recipe): what to curate and how to split it.

    ``data.template`` and ``data.max_prompt_length`` come from the main config (the trainer reads them too).
    """

    sources: list[SourceSpec] | None = Field(
        default=None, description="Train sources (paths or 'hf:<id>'); null = the synthetic file."
    )
    val_sources: list[SourceSpec] = Field(
        default_factory=list, description="Validation-only sources (e.g. AIME-2024); never in train."
    )
    val_size: int = Field(
        default=200, ge=0, description="Problems held out of the train sources for validation (0 = none)."
    )
    seed: int = Field(default=0, description="Seed of the train/validation draw.")
    tokenizer: str | None = Field(
        default=None,
        description="Tokenizer that measures prompt length: 'char' (tiny task), a directory or hub id; "
        "null = model.tokenizer_path, else 'char'.",
    )
    synthetic: SyntheticDataConfig = Field(default_factory=SyntheticDataConfig)

    def train_specs(self) -> list[SourceSpec]:
        if self.sources is not None:
            return list(self.sources)
        return [SourceSpec(path=self.synthetic.path, data_source=self.synthetic.data_source)]
