"""The data card of a curation: what went in, what was kept, what was dropped and why, and what the data looks
like (prompt token-length percentiles, answer magnitudes). Written as JSON (for machines, MLflow) and markdown
(for people) next to the curated parquet files.

The card holds no timestamps and no absolute paths unless the config used them, so the same inputs and settings
give the same bytes (it is a DVC stage output).

    card = build_card(result, settings={"template": "tiny", "max_prompt_length": 32})
    write_card(card, "outputs/curated")     # card.json + card.md
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dapo_core.data.curate_report import DROP_REASONS, CurationResult
from dapo_core.data.schema import ProblemRecord

CARD_VERSION = 1
CARD_JSON, CARD_MD = "card.json", "card.md"
PERCENTILES = (0, 50, 90, 99, 100)
# |answer| buckets by number of digits: "0", "1-9", "10-99", ..., then everything larger.
MAGNITUDE_BUCKETS = ("0", "1-9", "10-99", "100-999", "1000-9999", ">=10000")


def percentiles(values: Sequence[int], qs: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """Nearest-rank percentiles (``p50`` ...) and the mean; zeros for no values."""
    ordered = sorted(values)
    out: dict[str, float] = {}
    for q in qs:
        rank = max(1, math.ceil(q / 100 * len(ordered))) if ordered else 0
        out[f"p{q}"] = float(ordered[rank - 1]) if ordered else 0.0
    out["mean"] = round(sum(ordered) / len(ordered), 3) if ordered else 0.0
    return out


def answer_magnitudes(truths: Iterable[str]) -> dict[str, int]:
    """Histogram of ``|answer|`` by digit count (``MAGNITUDE_BUCKETS``) plus the count of negative answers."""
    counts = dict.fromkeys(MAGNITUDE_BUCKETS, 0)
    negative = 0
    for truth in truths:
        digits = truth.lstrip("-").lstrip("0")
        negative += truth.startswith("-") and bool(digits)
        counts[MAGNITUDE_BUCKETS[min(len(digits), len(MAGNITUDE_BUCKETS) - 1)]] += 1
    return {**counts, "negative": negative}


def _fields(r: ProblemRecord) -> list[str]:
    messages = [part for m in r.prompt for part in (m["role"], m["content"])]
    return [r.data_source, r.ability, r.style, r.ground_truth, str(r.index), r.split or "", r.raw_problem, *messages]


def dataset_digest(splits: Mapping[str, Sequence[ProblemRecord]]) -> str:
    """sha256 of the curated content (every written field of every row, split by split), independent of the
    parquet writer and its version: the same digest means the same dataset."""
    h = hashlib.sha256()
    for name in sorted(splits):
        h.update(f"\x1d{name}\x1d{len(splits[name])}".encode())
        for record in splits[name]:
            h.update("\x1f".join(_fields(record)).encode("utf-8") + b"\x1e")  # unit / record separators
    return f"sha256:{h.hexdigest()}"


def _split_stats(records: Sequence[ProblemRecord], lengths: Sequence[int]) -> dict[str, Any]:
    return {
        "rows": len(records),
        "data_sources": dict(sorted(Counter(r.data_source for r in records).items())),
        "prompt_tokens": percentiles(lengths),
        "answer_magnitude": answer_magnitudes(r.ground_truth for r in records),
    }


def build_card(result: CurationResult, *, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The card as a JSON-ready dict; ``settings`` records the knobs that produced it (template, lengths, ...)."""
    report = result.report
    splits = {"train": result.train, "val": result.val}
    return {
        "card_version": CARD_VERSION,
        "dataset_digest": dataset_digest(splits),
        "settings": dict(settings),
        "counts": {
            "rows_in": report.rows_in,
            "kept": report.kept,
            "train": len(result.train),
            "val": len(result.val),
            "dropped": report.dropped,
            "dropped_total": sum(report.dropped.values()),
            "duplicates_removed": report.dropped["duplicate"],
            "conflicting_answers": report.conflicting_answers,
        },
        "sources": [vars(s) for s in report.sources],
        "splits": {
            name: _split_stats(records, result.prompt_lengths.get(name, [])) for name, records in splits.items()
        },
        "drop_examples": [vars(e) for e in report.examples],
    }


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return lines


def _source_row(s: Mapping[str, Any]) -> tuple[Any, ...]:
    dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items() if v) or "-"
    templates = ", ".join(f"{k} {v}" for k, v in s["templates"].items()) or "-"
    return (s["source"], s["role"], s["loader"], s["digest"], s["rows"], s["kept"], dropped, templates)


def render_markdown(card: Mapping[str, Any]) -> str:
    """The card for people: counts, drops by reason, sources, per-split statistics, examples of drops."""
    c = card["counts"]
    lines = [
        "# Data card: curated RL dataset",
        "",
        f"- dataset digest: `{card['dataset_digest']}`",
        f"- rows in: {c['rows_in']} = kept {c['kept']} (train {c['train']}, val {c['val']}) "
        f"+ dropped {c['dropped_total']}",
        f"- duplicates removed: {c['duplicates_removed']} (with a different answer than the kept copy: "
        f"{c['conflicting_answers']})",
        "- settings: " + ", ".join(f"{k}={v}" for k, v in card["settings"].items()),
        "",
        "## Dropped rows by reason",
        "",
        *_table(("reason", "rows"), ((r, c["dropped"][r]) for r in DROP_REASONS)),
        "",
        "## Sources",
        "",
        *_table(
            ("source", "role", "format", "md5", "rows", "kept", "dropped", "templates"),
            map(_source_row, card["sources"]),
        ),
        "",
        "## Splits",
        "",
    ]
    for name, stats in card["splits"].items():
        tokens, mags = stats["prompt_tokens"], stats["answer_magnitude"]
        lines += [
            f"### {name} ({stats['rows']} rows)",
            "",
            "- data sources: " + (", ".join(f"{k} {v}" for k, v in stats["data_sources"].items()) or "-"),
            "- prompt tokens: " + ", ".join(f"{k} {v:g}" for k, v in tokens.items()),
            "",
            *_table(("abs(answer)", *mags.keys()), [("rows", *mags.values())]),
            "",
        ]
    lines += ["## Examples of dropped rows", ""]
    examples = card["drop_examples"]
    rows = ((e["reason"], e["source"], e["row"], e["detail"]) for e in examples)
    lines += _table(("reason", "source", "row", "detail"), rows) if examples else ["None."]
    return "\n".join(lines) + "\n"


def write_card(card: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``card.json`` and ``card.md`` into ``out_dir`` (each through a temp file and a rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / CARD_JSON, out / CARD_MD)
    texts = (json.dumps(card, indent=2, sort_keys=False, ensure_ascii=False) + "\n", render_markdown(card))
    for path, text in zip(paths, texts, strict=True):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return paths
