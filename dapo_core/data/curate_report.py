"""What curation reports: the drop reasons, per-source counts, example drops and the curated result.

``dapo_core.data.curate`` fills these; the data card (``dapo_core.data.card``) and ``tasks.data`` read them. Every
row ends up kept or dropped with exactly one reason, so ``SourceReport.rows == kept + sum(dropped.values())``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_core.data.schema import ProblemRecord

# In the order curation checks them: a row is dropped for the first that applies (see dapo_core.data.curate).
DROP_REASONS: tuple[str, ...] = (
    "unreadable_prompt",
    "missing_field",
    "non_string_field",
    "empty_problem",
    "non_integer_answer",
    "duplicate",
    "prompt_too_long",
)


@dataclass
class DropExample:
    """One dropped row, to show in the data card: where it was and why."""

    source: str
    row: int
    reason: str
    detail: str


@dataclass
class SourceReport:
    """Counts of one source: ``rows == kept + sum(dropped.values())``."""

    source: str
    role: str  # "train" or "val"
    loader: str
    digest: str
    rows: int
    kept: int
    dropped: dict[str, int]
    templates: dict[str, int]  # detected prompt template -> rows ("none": no template)


@dataclass
class CurationReport:
    sources: list[SourceReport]
    examples: list[DropExample]
    conflicting_answers: int  # duplicates whose answer differs from the kept copy's

    @property
    def rows_in(self) -> int:
        return sum(s.rows for s in self.sources)

    @property
    def kept(self) -> int:
        return sum(s.kept for s in self.sources)

    @property
    def dropped(self) -> dict[str, int]:
        return {r: sum(s.dropped[r] for s in self.sources) for r in DROP_REASONS}


@dataclass
class CurationResult:
    """The curated splits (records with ``split`` and a 0-based ``index``), their prompt token counts, the report."""

    train: list[ProblemRecord]
    val: list[ProblemRecord]
    report: CurationReport
    prompt_lengths: dict[str, list[int]] = field(default_factory=dict)
