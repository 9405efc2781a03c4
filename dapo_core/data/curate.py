"""Curation: validate every row, de-duplicate, normalise to the verl schema, split -- pure functions.

Every row of every source ends up kept or dropped with exactly one reason (the first that applies, in the order
of ``DROP_REASONS``), so ``rows in = kept + sum(dropped by reason)`` always holds:

1. ``unreadable_prompt``  the chat prompt (verl) or the line (jsonl) cannot be read;
2. ``missing_field``      problem, answer or data_source absent / null;
3. ``non_string_field``   one of them is not a string (answers too: ``42`` is rejected, ``"42"`` kept);
4. ``empty_problem``      nothing left once the template is stripped (also an applied template around nothing);
5. ``non_integer_answer`` DAPO trains on integer answers only: the answer after the scorer's
                          ``normalize_final_answer`` must match ``^-?[0-9]+$`` (ASCII digits);
6. ``duplicate``          the same problem was kept already (earlier row or source; validation sources first);
7. ``prompt_too_long``    the rendered prompt has more tokens than ``max_prompt_length``.

De-duplication (6) happens before any tokenising (7) and keys on a 64-bit hash of the problem with the template
stripped, case-folded and whitespace collapsed: the published DAPO-Math-17k repeats ~17.9k problems ~100x, and
work is done once per distinct value (loaders store columns as codes into distinct values).

    rows = [load_source("data/synthetic/problems.jsonl")]
    result = curate(rows, template="tiny", max_prompt_length=32, count_tokens=load_token_counter(), val_size=200)
    result.report.dropped, len(result.train), len(result.val)
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from dapo_core.data.curate_report import DROP_REASONS, CurationReport, CurationResult, DropExample, SourceReport
from dapo_core.data.loaders import Column, SourceRows
from dapo_core.data.schema import ProblemRecord
from dapo_core.data.templates import PromptTemplate, TokenCounter, get_template, strip_template
from dapo_core.rewards import normalize_final_answer

logger = logging.getLogger(__name__)
T = TypeVar("T")

_CODE = {reason: i for i, reason in enumerate(DROP_REASONS)}
_OK = len(DROP_REASONS)
INTEGER_ANSWER = re.compile(r"-?[0-9]+")  # DAPO: integer answers only (fullmatch, ASCII digits)
EXAMPLES_PER_REASON = 3
DEFAULT_ABILITY, DEFAULT_STYLE = "MATH", "rule"
# a DVC stage output: never inside data/ (docs/design.md, "Stage outputs and raw data")
DEFAULT_OUTPUT_DIR = "outputs/curated"


def normalize_problem(problem: str) -> str:
    """Case-folded, whitespace-collapsed text: what de-duplication compares."""
    return " ".join(problem.casefold().split())


def problem_key(problem: str) -> int:
    """The 64-bit de-duplication key of a (template-stripped) problem (blake2b; collisions ~1e-7 at 2M)."""
    digest = hashlib.blake2b(normalize_problem(problem).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def integer_ground_truth(answer: str) -> str | None:
    """The scorer-normalised answer when it is an integer (``"$1,000$"`` -> ``"1000"``), else None."""
    normalized = normalize_final_answer(answer)
    return normalized if INTEGER_ANSWER.fullmatch(normalized) else None


@dataclass
class _Verdicts:
    """Per distinct value of a column: the drop code (``_OK`` if fine) and why."""

    codes: np.ndarray  # (U,) int8
    details: list[str | None]

    def rows(self, column: Column) -> np.ndarray:
        return self.codes[column.codes]  # (N,)


def _string_verdicts(column: Column, name: str) -> _Verdicts:
    codes = np.full(len(column.values), _OK, dtype=np.int8)
    details: list[str | None] = [None] * len(column.values)
    for u, value in enumerate(column.values):
        if value is None:
            codes[u], details[u] = _CODE["missing_field"], f"{name} is missing"
        elif not isinstance(value, str):
            codes[u] = _CODE["non_string_field"]
            details[u] = f"{name} is a {type(value).__name__} ({value!r:.60}), expected a string"
    return _Verdicts(codes, details)


def _problem_verdicts(column: Column, templated: bool) -> tuple[_Verdicts, np.ndarray, list[str], list[str | None]]:
    """Verdicts, keys (U,) uint64, stripped problems and detected templates of the distinct problems."""
    verdicts = _string_verdicts(column, "problem")
    keys = np.zeros(len(column.values), dtype=np.uint64)
    texts: list[str] = [""] * len(column.values)
    templates: list[str | None] = [None] * len(column.values)
    for u, value in enumerate(column.values):
        if verdicts.codes[u] != _OK:
            continue
        text, templates[u] = strip_template(value) if templated else (value.strip(), None)
        if not text:
            verdicts.codes[u] = _CODE["empty_problem"]
            inside = f" inside the {templates[u]!r} template" if templates[u] else ""
            verdicts.details[u] = f"problem is empty{inside} ({value!r:.60})"
            continue
        texts[u], keys[u] = text, problem_key(text)
    return verdicts, keys, texts, templates


def _answer_verdicts(column: Column) -> tuple[_Verdicts, list[str | None]]:
    verdicts = _string_verdicts(column, "answer")
    truths: list[str | None] = [None] * len(column.values)
    for u, value in enumerate(column.values):
        if verdicts.codes[u] != _OK:
            continue
        truths[u] = integer_ground_truth(value)
        if truths[u] is None:
            verdicts.codes[u] = _CODE["non_integer_answer"]
            verdicts.details[u] = (
                f"answer {value!r:.40} normalises to {normalize_final_answer(value)!r:.40}, not ^-?[0-9]+$"
            )
    return verdicts, truths


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014), elementwise on uint64 (wrap-around arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix64(keys: np.ndarray, seed: int) -> np.ndarray:
    """A seeded, platform-independent order of problem keys (for the validation draw)."""
    salt = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return _splitmix64(keys.astype(np.uint64) ^ salt)


class _Curator:
    """State shared across sources: keys already kept (sorted, with their answers) and the kept rows."""

    def __init__(self, template: PromptTemplate, max_prompt_length: int, count_tokens: TokenCounter) -> None:
        self.template, self.max_prompt_length, self.count_tokens = template, max_prompt_length, count_tokens
        self.seen_keys = np.zeros(0, dtype=np.uint64)  # sorted
        self.seen_truth: list[str] = []  # aligned with seen_keys
        self.conflicts = 0
        self.examples: list[DropExample] = []

    def add(self, src: SourceRows, role: str) -> tuple[SourceReport, list[ProblemRecord], list[int], np.ndarray]:
        """Curate one source: (its report, kept records, their prompt token counts, their keys (K,) uint64)."""
        problems, keys, texts, templates = _problem_verdicts(src.problem, src.templated)
        answers, truths = _answer_verdicts(src.answer)
        sources = _string_verdicts(src.data_source, "data_source")
        reason = np.minimum(problems.rows(src.problem), answers.rows(src.answer))  # (N,) first reason wins
        reason = np.minimum(reason, sources.rows(src.data_source))
        if src.unreadable:
            reason[np.fromiter(src.unreadable, dtype=np.int64)] = _CODE["unreadable_prompt"]

        keep = self._deduplicate(reason, keys[src.problem.codes], truths, src.answer.codes)  # (K,) row ids
        prompts = [self.template.apply(texts[c]) for c in src.problem.codes[keep].tolist()]
        lengths = np.asarray(self.count_tokens(prompts), dtype=np.int64).reshape(-1)  # (K,)
        too_long = lengths > self.max_prompt_length
        reason[keep[too_long]] = _CODE["prompt_too_long"]
        kept = keep[~too_long]
        records = self._records(
            src, kept, texts, truths, [p for p, t in zip(prompts, too_long.tolist(), strict=True) if not t]
        )
        self._collect_examples(src, reason, texts, problems, answers, sources)
        report = _source_report(src, role, reason, templates)
        return report, records, lengths[~too_long].tolist(), keys[src.problem.codes[kept]]

    def _deduplicate(
        self, reason: np.ndarray, row_keys: np.ndarray, truths: list[str | None], answer_codes: np.ndarray
    ) -> np.ndarray:
        """Mark repeats of a kept key (earlier here or in an earlier source) ``duplicate``; return kept row ids."""
        valid = np.flatnonzero(reason == _OK)  # (V,)
        distinct, first = np.unique(row_keys[valid], return_index=True)
        fresh = ~np.isin(distinct, self.seen_keys)
        keep = np.sort(valid[first[fresh]])
        duplicate = np.setdiff1d(valid, keep, assume_unique=True)
        reason[duplicate] = _CODE["duplicate"]
        self._remember(row_keys[keep], [truths[a] for a in answer_codes[keep].tolist()])
        self._count_conflicts(row_keys[duplicate], [truths[a] for a in answer_codes[duplicate].tolist()])
        return keep

    def _remember(self, new_keys: np.ndarray, new_truths: list[str | None]) -> None:
        all_keys = np.concatenate([self.seen_keys, new_keys])
        truths = self.seen_truth + [t or "" for t in new_truths]
        order = np.argsort(all_keys, kind="stable")
        self.seen_keys = all_keys[order]
        self.seen_truth = [truths[i] for i in order.tolist()]

    def _count_conflicts(self, dup_keys: np.ndarray, dup_truths: list[str | None]) -> None:
        positions = np.searchsorted(self.seen_keys, dup_keys)
        self.conflicts += sum(self.seen_truth[p] != t for p, t in zip(positions.tolist(), dup_truths, strict=True))

    @staticmethod
    def _records(
        src: SourceRows, rows: np.ndarray, texts: list[str], truths: list[str | None], prompts: list[str]
    ) -> list[ProblemRecord]:
        """verl records of the kept ``rows`` (codes are read as lists: numpy scalars are slow one by one)."""
        abilities = [v if isinstance(v, str) and v else DEFAULT_ABILITY for v in src.ability.values]
        styles = [v if isinstance(v, str) and v else DEFAULT_STYLE for v in src.style.values]
        columns = (src.problem, src.answer, src.data_source, src.ability, src.style)
        codes = zip(*(c.codes[rows].tolist() for c in columns), prompts, strict=True)
        return [
            ProblemRecord(
                data_source=src.data_source.values[d],
                prompt=[{"role": "user", "content": prompt}],
                ground_truth=truths[a] or "",
                index=-1,
                raw_problem=texts[p],
                ability=abilities[b],
                style=styles[y],
            )
            for p, a, d, b, y, prompt in codes
        ]

    def _collect_examples(self, src: SourceRows, reason: np.ndarray, texts: list[str], *verdicts: _Verdicts) -> None:
        for code, name in enumerate(DROP_REASONS):
            for i in np.flatnonzero(reason == code)[:EXAMPLES_PER_REASON].tolist():
                self.examples.append(DropExample(src.source, i, name, self._detail(src, i, code, texts, verdicts)))

    def _detail(self, src: SourceRows, i: int, code: int, texts: list[str], verdicts_of: tuple[_Verdicts, ...]) -> str:
        if code == _CODE["unreadable_prompt"]:
            return src.unreadable[i]
        if code == _CODE["duplicate"]:
            return f"problem {texts[int(src.problem.codes[i])]!r:.60} was kept already"
        if code == _CODE["prompt_too_long"]:
            return f"prompt longer than max_prompt_length={self.max_prompt_length} tokens"
        for verdicts, column in zip(verdicts_of, (src.problem, src.answer, src.data_source), strict=True):
            u = int(column.codes[i])
            if verdicts.codes[u] == code:
                return verdicts.details[u] or DROP_REASONS[code]
        return DROP_REASONS[code]


def _source_report(src: SourceRows, role: str, reason: np.ndarray, templates: list[str | None]) -> SourceReport:
    counts = np.bincount(reason, minlength=_OK + 1)
    names = sorted({t or "none" for t in templates})
    per_value = np.array([names.index(t or "none") for t in templates], dtype=np.int64)  # (U,)
    per_name = np.bincount(per_value[src.problem.codes], minlength=len(names))
    return SourceReport(
        source=src.source,
        role=role,
        loader=src.loader,
        digest=src.digest,
        rows=len(src),
        kept=int(counts[_OK]),
        dropped={r: int(counts[i]) for i, r in enumerate(DROP_REASONS)},
        templates={name: int(per_name[i]) for i, name in enumerate(names) if per_name[i]},
    )


def curate(
    train_sources: Sequence[SourceRows],
    val_sources: Sequence[SourceRows] = (),
    *,
    template: PromptTemplate | str,
    max_prompt_length: int,
    count_tokens: TokenCounter,
    val_size: int = 0,
    seed: int = 0,
) -> CurationResult:
    """Curate sources into train / validation records (pure: no I/O, no global state).

    Validation sources are processed first, so a problem in both sets stays in validation only. ``val_size``
    more problems are held out of the train sources: the ``val_size`` smallest by a seeded hash of their key,
    so the split is the same for any input order. ``count_tokens`` maps prompts (the configured ``template``
    applied) to token counts; only kept, distinct prompts are counted.
    """
    if val_size < 0:
        raise ValueError(f"val_size ({val_size}) must be >= 0: it is the number of train problems held out")
    tmpl = get_template(template) if isinstance(template, str) else template
    curator = _Curator(tmpl, max_prompt_length, count_tokens)
    reports: dict[str, list[SourceReport]] = {"val": [], "train": []}
    records: dict[str, list[ProblemRecord]] = {"val": [], "train": []}
    lengths: dict[str, list[int]] = {"val": [], "train": []}
    train_keys: list[np.ndarray] = []
    for role, group in (("val", val_sources), ("train", train_sources)):
        for src in group:
            source_report, kept, kept_lengths, keys = curator.add(src, role)
            reports[role].append(source_report)
            records[role].extend(kept)
            lengths[role].extend(kept_lengths)
            if role == "train":
                train_keys.append(keys)
    if val_size:
        keys = np.concatenate(train_keys) if train_keys else np.zeros(0, dtype=np.uint64)
        held = _held_out(keys, val_size, seed)  # (K,) bool
        records["train"], moved = _split_off(records["train"], held)
        records["val"] += moved
        lengths["train"], moved_lengths = _split_off(lengths["train"], held)
        lengths["val"] += moved_lengths
    for split in ("train", "val"):
        for index, record in enumerate(records[split]):
            record.split, record.index = split, index
    report = CurationReport(
        sources=reports["train"] + reports["val"], examples=curator.examples, conflicting_answers=curator.conflicts
    )
    _check_counts(report, len(records["train"]) + len(records["val"]))
    logger.info("curated %d rows: %d train, %d val; dropped %s", report.rows_in, len(records["train"]),
                len(records["val"]), report.dropped)  # fmt: skip
    return CurationResult(train=records["train"], val=records["val"], report=report, prompt_lengths=lengths)


def _split_off(items: list[T], held: list[bool]) -> tuple[list[T], list[T]]:
    """(items not held, items held), each in input order."""
    return [x for x, h in zip(items, held, strict=True) if not h], [x for x, h in zip(items, held, strict=True) if h]


def _held_out(keys: np.ndarray, val_size: int, seed: int) -> list[bool]:
    """Which of the train problems (by key) go to validation: the ``val_size`` smallest seeded hashes."""
    if val_size >= len(keys):
        raise ValueError(
            f"curation.val_size ({val_size}) must be smaller than the number of curated train problems "
            f"({len(keys)}): lower val_size, or add train problems"
        )
    held = np.zeros(len(keys), dtype=bool)
    held[np.argsort(_mix64(keys, seed), kind="stable")[:val_size]] = True
    return held.tolist()


def _check_counts(report: CurationReport, kept: int) -> None:
    """The invariant the data card promises: in = kept + dropped, per source and in total."""
    for s in report.sources:
        if s.rows != s.kept + sum(s.dropped.values()):
            raise AssertionError(f"{s.source}: {s.rows} rows != {s.kept} kept + {s.dropped}")
    if report.kept != kept:
        raise AssertionError(f"kept rows {report.kept} != {kept} records written")
