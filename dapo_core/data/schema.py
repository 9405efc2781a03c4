"""The RL dataset record, in the verl / DAPO parquet schema, and its reader/writer.

One row per problem::

    data_source   str                       e.g. "math_dapo" (selects the reward function family; names val metrics)
    prompt        list[{"role", "content"}] chat messages with the prompt template already applied
    ability       str                       e.g. "MATH"
    reward_model  {"ground_truth": str, "style": str}
    extra_info    {"index": int, "raw_problem": str, "split": str | None}

DAPO-Math-17k and AIME-2024 are published this way; curated outputs are written this way too, so everything
downstream (training, evaluation) reads one format.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


@dataclass
class ProblemRecord:
    """One RL problem: chat prompt (template applied), integer ground truth as a string, provenance."""

    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: str
    index: int
    raw_problem: str = ""
    ability: str = "MATH"
    style: str = "rule"
    split: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def uid(self) -> str:
        """Stable id of the problem within its source (groups of G responses are keyed by it)."""
        return f"{self.data_source}:{self.index}"

    def to_row(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": [dict(m) for m in self.prompt],
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.style},
            "extra_info": {"index": int(self.index), "raw_problem": self.raw_problem, "split": self.split},
        }


class SchemaError(ValueError):
    """A file does not follow the verl RL schema; the message names the file, the row/column and the fix."""


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    items = list(value) if not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__") else None
    if not items:
        raise SchemaError(
            f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages, got {value!r:.80}"
        )
    out = []
    for m in items:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise SchemaError(f"{where}: every prompt message needs string 'role' and 'content', got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def record_from_row(row: dict[str, Any], where: str) -> ProblemRecord:
    """Parse one verl-schema row; raise SchemaError naming ``where`` (file:row) on any structural problem."""
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise SchemaError(f"{where}: 'reward_model' must be a dict with 'ground_truth', got {rm!r:.80}")
    gt = rm["ground_truth"]
    if not isinstance(gt, str):
        raise SchemaError(f"{where}: reward_model.ground_truth must be a string, got {type(gt).__name__}")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise SchemaError(f"{where}: 'extra_info' must be a dict, got {type(extra).__name__}")
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise SchemaError(f"{where}: 'data_source' must be a non-empty string, got {source!r:.80}")
    index = extra.get("index")
    return ProblemRecord(
        data_source=source,
        prompt=_messages(row.get("prompt"), where),
        ground_truth=gt,
        index=int(index) if index is not None else -1,
        raw_problem=str(extra.get("raw_problem") or ""),
        ability=str(row.get("ability") or ""),
        style=str(rm.get("style") or ""),
        split=extra.get("split"),
        extra={k: v for k, v in extra.items() if k not in ("index", "raw_problem", "split")},
    )


def read_rl_parquet(path: str | Path) -> list[ProblemRecord]:
    """Read a verl-schema parquet file. Missing file / columns -> a clear error naming the file and the fix."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such dataset file. It is made by the curation stage (`dapo curate`, `dvc repro curate`); "
            "or point data.train_files / data.val_files at an existing verl-schema parquet file"
        )
    df = pd.read_parquet(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise SchemaError(
            f"{path}: missing column(s) {missing}; a verl RL parquet needs {list(REQUIRED_COLUMNS)} "
            "(run it through `dapo curate` to convert problem/answer files)"
        )
    records = []
    for i, row in enumerate(df.to_dict(orient="records")):
        rec = record_from_row(row, f"{path}:row {i}")
        if rec.index < 0:
            rec.index = i
        records.append(rec)
    return records


def read_rl_files(paths: Sequence[str | Path]) -> list[ProblemRecord]:
    out: list[ProblemRecord] = []
    for p in paths:
        out.extend(read_rl_parquet(p))
    return out


def write_rl_parquet(records: Iterable[ProblemRecord], path: str | Path) -> Path:
    """Write records in the verl schema (atomically: temp file then rename)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pd.DataFrame([r.to_row() for r in records], columns=list(REQUIRED_COLUMNS)).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path
