"""Builders shared by tests/test_data_*.py and test_evaluation_runner.py (imported by them, not a pytest conftest):
messy sources with one row of every bad class, in-memory sources, and the real AIME-2024 file (``aime_path``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_core.data.loaders import Column, ColumnBuilder, SourceRows
from dapo_core.data.templates import DAPO_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
AIME_ENV = "DAPO_AIME_PARQUET"  # where the real AIME-2024 file is, when not at AIME_DEFAULT
AIME_DEFAULT = REPO / "data" / "aime-2024.parquet"  # git-ignored: each user supplies their own copy
LONG = "x" * 200  # a problem longer than the tests' max_prompt_length (counted in characters)
LONG_2 = "y" * 200  # another one (the same long problem in two files would be a duplicate)


def aime_location() -> Path:
    """Where the AIME-2024 file should be: ``$DAPO_AIME_PARQUET`` when set, else ``data/aime-2024.parquet`` under
    the repository root."""
    value = os.environ.get(AIME_ENV, "").strip()
    return Path(value).expanduser() if value else AIME_DEFAULT


def aime_missing_message(path: Path) -> str:
    """What is missing and how to supply it: the skip's reason, and the start of the failure's under CI."""
    where = (
        f"{AIME_ENV} is set to {path}, which is not a file"
        if os.environ.get(AIME_ENV, "").strip()
        else f"no file at {path}"
    )
    return (
        f"AIME-2024 parquet missing: {where}. These tests read the file the DAPO authors publish as "
        f"eval/aime-2024.parquet (960 rows, verl schema): put a copy at {AIME_DEFAULT}, or set {AIME_ENV} to "
        "the path of one."
    )


def aime_path() -> Path:
    """The real AIME-2024 file; when it is missing, skip the test, or fail it when CI is set (CI must have it)."""
    path = aime_location()
    if not path.is_file():
        message = aime_missing_message(path)
        if os.environ.get("CI"):
            pytest.fail(f"{message} CI is set, so this fails instead of skipping.", pytrace=False)
        pytest.skip(message)
    return path


def char_count(texts: list[str]) -> list[int]:
    """A stand-in token counter: one token per character (no chat template)."""
    return [len(t) for t in texts]


def rows(problems: list[Any], answers: list[Any], *, templated: bool = False, source: str = "mem") -> SourceRows:
    """In-memory SourceRows (no file), data_source 'mem'."""
    p, a = ColumnBuilder(), ColumnBuilder()
    for value in problems:
        p.add(value)
    for value in answers:
        a.add(value)
    n = len(problems)
    return SourceRows(
        source=source,
        loader="memory",
        problem=p.build(),
        answer=a.build(),
        data_source=Column.constant("mem", n),
        ability=Column.constant(None, n),
        style=Column.constant(None, n),
        templated=templated,
        digest="none",
    )


def messy_jsonl(path: Path) -> Path:
    """One good row, then one row of every bad class (the expected reasons are MESSY_JSONL_REASONS)."""
    lines = [
        json.dumps({"problem": "1+2", "answer": "3"}),
        "this line is not JSON",  # unreadable_prompt
        json.dumps({"problem": "2+2"}),  # missing_field (answer)
        json.dumps({"problem": "3+3", "answer": 6}),  # non_string_field
        json.dumps({"problem": "   ", "answer": "1"}),  # empty_problem
        json.dumps({"problem": "half of one", "answer": "1/2"}),  # non_integer_answer
        json.dumps({"problem": " 1+2 ", "answer": "3"}),  # duplicate (whitespace differs)
        json.dumps({"problem": LONG, "answer": "7"}),  # prompt_too_long
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


MESSY_JSONL_REASONS = [
    None,
    "unreadable_prompt",
    "missing_field",
    "non_string_field",
    "empty_problem",
    "non_integer_answer",
    "duplicate",
    "prompt_too_long",
]

_PROMPT = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", _PROMPT),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64())])),
    ]
)


def verl_row(content: str | None, truth: str | None, *, messages: list[dict[str, Any]] | None = None) -> dict:
    prompt = messages if messages is not None else [{"role": "user", "content": content}]
    return {
        "data_source": "math_dapo",
        "prompt": prompt,
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": 0},
    }


def messy_verl(path: Path) -> Path:
    """A verl parquet: one good row, then the bad classes a typed parquet can hold (MESSY_VERL_REASONS)."""
    dapo = DAPO_TEMPLATE.apply
    table = pa.Table.from_pylist(
        [
            verl_row(dapo("What is 6 times 7?"), "42"),
            verl_row(None, "1", messages=[{"role": "system", "content": "no user turn"}]),  # unreadable_prompt
            verl_row(dapo("What is 1 + 1?"), None),  # missing_field
            verl_row(dapo(""), "3"),  # empty_problem (the template around nothing)
            verl_row(dapo("What is pi?"), "\\pi"),  # non_integer_answer
            verl_row(dapo("what is 6   TIMES 7?"), "$42$"),  # duplicate (case, whitespace)
            verl_row(dapo(LONG_2), "5"),  # prompt_too_long
        ],
        schema=VERL_SCHEMA,
    )
    pq.write_table(table, path)
    return path


MESSY_VERL_REASONS = [
    None,
    "unreadable_prompt",
    "missing_field",
    "empty_problem",
    "non_integer_answer",
    "duplicate",
    "prompt_too_long",
]
