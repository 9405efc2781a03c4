"""The problems an evaluation samples: de-duplicated records and their encoded prompts (``runner.evaluate``).

Problems are de-duplicated first: AIME-2024 as published by the DAPO authors repeats each of its 30 problems 32
times (960 rows). A problem's identity is its data source plus its raw problem text (``extra_info.raw_problem``),
or its prompt messages when the raw text is missing; copies must agree on the ground truth.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dapo_core.data.schema import ProblemRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UniqueProblem:
    """One de-duplicated problem and how many rows of the input repeated it."""

    record: ProblemRecord
    copies: int
    row: int  # index of its first row in the input


def _identity(record: ProblemRecord) -> tuple[str, str]:
    text = record.raw_problem.strip() or json.dumps(record.prompt, sort_keys=True)
    return record.data_source, text


def dedupe_problems(records: Iterable[ProblemRecord]) -> list[UniqueProblem]:
    """Unique problems in first-appearance order (identity: data source + raw problem, else prompt)."""
    first: dict[tuple[str, str], tuple[int, ProblemRecord]] = {}
    copies: dict[tuple[str, str], int] = {}
    for i, rec in enumerate(records):
        key = _identity(rec)
        seen = first.setdefault(key, (i, rec))[1]
        if seen.ground_truth != rec.ground_truth:
            raise ValueError(
                f"problem {rec.uid} repeats {seen.uid} (same data source and problem text) with another ground "
                f"truth ({rec.ground_truth!r} vs {seen.ground_truth!r}): fix the data file, or give the two "
                "problems different raw_problem texts"
            )
        copies[key] = copies.get(key, 0) + 1
    return [UniqueProblem(record=rec, copies=copies[key], row=row) for key, (row, rec) in first.items()]


def encode_prompt(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, max_prompt_length: int | None = None
) -> tuple[list[int], bool]:
    """Token ids of the chat prompt with the generation prompt appended; (ids, was_truncated).

    The template is rendered to text and then tokenized without extra special tokens (as verl does). Prompts
    longer than ``max_prompt_length`` keep their last tokens (verl ``truncation='left'``, the DAPO script's
    setting), so the instruction's end and the assistant opener survive.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    else:  # a base-model tokenizer without a template: the raw user text
        text = "\n".join(m["content"] for m in messages)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        return ids[-max_prompt_length:], True
    return ids, False


def encode_problems(
    tokenizer: Any,
    problems: Sequence[UniqueProblem],
    records: Sequence[ProblemRecord],
    prompt_ids: Sequence[Sequence[int]] | None,
    max_prompt_length: int | None,
) -> list[tuple[list[int], bool]]:
    """(ids, truncated) per unique problem: the given ``prompt_ids`` of its first row, else ``encode_prompt``."""
    if prompt_ids is not None:
        if len(prompt_ids) != len(records):
            raise ValueError(f"prompt_ids ({len(prompt_ids)}) must hold one prompt per record ({len(records)})")
        return [(list(prompt_ids[p.row]), False) for p in problems]
    encoded = [encode_prompt(tokenizer, p.record.prompt, max_prompt_length=max_prompt_length) for p in problems]
    num_cut = sum(cut for _, cut in encoded)
    if num_cut:
        logger.warning(
            "%d of %d prompts are longer than max_prompt_length=%s tokens; kept their last tokens (verl's "
            "truncation='left', as the DAPO script)", num_cut, len(problems), max_prompt_length,
        )  # fmt: skip
    return encoded
