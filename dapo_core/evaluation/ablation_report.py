"""The ablation report (DAPO Table 1 in miniature): results dict -> ``ablation.json``, ``ablation.md``, ``ablation.png``.

Pure: plain data in, files out (no MLflow). ``dapo ablation`` (flows/ablation.py) builds the results:

    results = {"regimes": {"tuned": {"lr": 1e-4, "rungs": [summarize_rung("grpo", per_seed), ...]}},
               "base_acc": 0.19, "k": 8, "steps": 24}
    paths = write_report(results, "benchmarks/results")

A rung's entry: ``name``, ``paper_aime``, ``mean`` / ``std`` (over seeds; std null for one seed), ``seeds`` (the
held-out avg@k of each seed), ``seed_ids``, ``wall_s`` (mean per seed; ``wall_s_seeds`` each), ``curve`` ([[step, mean val acc]]) and
the evidence means (``dapo_core.config.ablation.EVIDENCE_KEYS``; null when a run did not log one).

Every results file names the code of its runs (``code_provenance``): top-level ``commits`` (the sorted unique
``git_sha`` of its records), ``dirty`` (true when any record came from a dirty tree, "unknown" when any record does
not say, else false) and ``code_digests``; the markdown states them in one line.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_core.config.ablation import (
    CONTROL_RUNGS,
    EVIDENCE_KEYS,
    PAPER_AIME,
    RUNG_NAMES,
    SFT_CONTROL,
    SFT_CONTROL_CLEAN,
    STOP_KEYS,
    SUCCESSOR_RUNGS,
)
from dapo_core.evaluation.ablation_findings import findings, finite_mean, pct, rungs_by_name
from dapo_core.evaluation.ablation_plot import plot_ablation

NOISE_SIGMAS = 2.0  # a difference counts when mean - 2 std of the per-seed differences is above 0
CLIP_KEYS = ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low")
UNKNOWN = "unknown"
EVIDENCE_LABELS = {
    "actor/pg_clipfrac_high": "clip hi",
    "actor/pg_clipfrac_low": "clip lo",
    "response_length/clip_ratio": "trunc",
    "train/kept_groups_frac": "kept",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
}
STOP_LABELS = {"stop/stopped_rate": "stops", "stop/acc_when_stopped": "acc if stops"}
CONTROL_LABELS = {
    SFT_CONTROL: "DAPO − sft-control (same time, supervised on the warm start's demonstrations)",
    SFT_CONTROL_CLEAN: "DAPO − sft-control-clean (same time, supervised on clean demonstrations)",
}


@dataclass(frozen=True)
class ReportPaths:
    json: Path
    md: Path
    png: Path


@dataclass(frozen=True)
class PairedDiff:
    """``a - b`` per shared seed: mean, sample std (None for one seed) and mean - 2 std (None for one seed)."""

    diffs: list[float]
    mean: float
    std: float | None
    lower: float | None


def _std(values: Sequence[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Mean over seeds of ``[[step, value], ...]`` curves, at the steps every seed has."""
    if not curves:
        return []
    maps = [{int(s): float(v) for s, v in c} for c in curves]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    return [[step, sum(m[step] for m in maps) / len(maps)] for step in steps]


def summarize_rung(name: str, per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rung's entry from its per-seed records ``{"seed", "acc", "wall_s", "curve", <evidence keys>...}``."""
    if not per_seed:
        raise ValueError(f"rung {name!r} has no seed results: every rung needs at least one run")
    accs = [float(r["acc"]) for r in per_seed]
    entry: dict[str, Any] = {
        "name": name,
        "paper_aime": PAPER_AIME.get(name),
        "mean": sum(accs) / len(accs),
        "std": _std(accs),
        "seeds": accs,
        "seed_ids": [int(r["seed"]) for r in per_seed],
        "wall_s": finite_mean([r.get("wall_s") for r in per_seed]),
        "wall_s_seeds": [r.get("wall_s") for r in per_seed],
        "curve": mean_curve([r["curve"] for r in per_seed if r.get("curve")]),
    }
    for key in (*EVIDENCE_KEYS, *STOP_KEYS):
        entry[key] = finite_mean([r.get(key) for r in per_seed])
    for key in sorted({k for r in per_seed for k in r} - set(entry) - {"acc", "seed", "curve"}):
        entry[key] = [r.get(key) for r in per_seed]  # anything else (run ids, budgets): one value per seed
    return entry


def paired_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> PairedDiff | None:
    """``a - b`` on the seeds both rungs ran (paired: same seed, same data order); None when none is shared."""
    sa = dict(zip(a["seed_ids"], a["seeds"], strict=True))
    sb = dict(zip(b["seed_ids"], b["seeds"], strict=True))
    shared = [s for s in sa if s in sb]
    if not shared:
        return None
    diffs = [float(sa[s]) - float(sb[s]) for s in shared]
    mean = sum(diffs) / len(diffs)
    std = _std(diffs)
    return PairedDiff(diffs, mean, std, None if std is None else mean - NOISE_SIGMAS * std)


# ------------------------------------------------------------------------------------------------ markdown
def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def _evidence_cell(key: str, value: float | None) -> str:
    if key in CLIP_KEYS and value == 0.0:  # exactly 0 in every logged update of every run: the bound never bound
        return "0 (never bound)"
    if key in ("actor/entropy",):
        return _fmt(value)
    if key == "response_length/mean":
        return _fmt(value, ".1f")
    return pct(value)


def _table(regime: Mapping[str, Any]) -> list[str]:
    head = ["rung", "paper AIME", "mean ± std", "seeds", "wall s", *(EVIDENCE_LABELS[k] for k in EVIDENCE_KEYS)]
    head += [STOP_LABELS[k] for k in STOP_KEYS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in regime["rungs"]:
        paper = "–" if r.get("paper_aime") is None else f"{r['paper_aime']:.0f}"
        spread = f"{r['mean']:.3f} ± {_fmt(r['std'])}"
        seeds = ", ".join(f"{v:.3f}" for v in r["seeds"])
        cells = [r["name"], paper, spread, seeds, _fmt(r.get("wall_s"), ".0f")]
        cells += [_evidence_cell(k, r.get(k)) for k in EVIDENCE_KEYS]
        cells += [pct(r.get(k)) for k in STOP_KEYS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def difference_line(label: str, d: PairedDiff | None, k: int | str = "k") -> str:
    """``DAPO − GRPO: +0.050 (per seed +0.04, +0.06; mean − 2·std = +0.030 > 0: beyond seed noise)``."""
    if d is None:
        return f"**{label}**: no seed ran both rungs, nothing to compare."
    per_seed = ", ".join(f"{x:+.3f}" for x in d.diffs)
    if d.std is None or d.lower is None:
        verdict = "one seed: no spread to judge seed noise by"
    elif d.lower > 0:
        verdict = f"mean − 2·std = {d.lower:+.3f} > 0: better beyond seed noise"
    elif d.mean + NOISE_SIGMAS * d.std < 0:
        verdict = f"mean + 2·std = {d.mean + NOISE_SIGMAS * d.std:+.3f} < 0: worse beyond seed noise"
    else:
        verdict = f"mean − 2·std = {d.lower:+.3f} ≤ 0: within seed noise"
    return f"**{label}**: {d.mean:+.3f} held-out avg@{k} (per seed {per_seed}; {verdict})."


def code_provenance(results: Mapping[str, Any]) -> dict[str, Any]:
    """``commits`` (sorted unique ``git_sha`` of the records; "unknown" for a record without one), ``dirty`` (true
    when any record came from a dirty tree, "unknown" when none did but one does not say, else false) and
    ``code_digests`` (sorted unique ``code_digest``; "unknown" for a record without one) of every rung's records."""
    shas: set[str] = set()
    digests: set[str] = set()
    dirty_flags: list[Any] = []
    for regime in results.get("regimes", {}).values():
        for r in regime.get("rungs", []):
            n = len(r.get("seeds") or [])
            shas.update(str(v or UNKNOWN) for v in (r.get("git_sha") or [None] * n))
            digests.update(str(v or UNKNOWN) for v in (r.get("code_digest") or [None] * n))
            dirty_flags += list(r.get("git_dirty") or [None] * n)
    if any(v is True for v in dirty_flags):
        dirty: bool | str = True
    elif all(v is False for v in dirty_flags):
        dirty = False
    else:
        dirty = UNKNOWN
    return {"commits": sorted(shas), "dirty": dirty, "code_digests": sorted(digests)}


def provenance_line(prov: Mapping[str, Any]) -> str:
    """``Code: commit abc123def456 (clean tree); code digest 0123456789ab.`` (several commits named as a mix)."""
    commits = [c[:12] for c in prov.get("commits", [])] or [UNKNOWN]
    what = f"commit {commits[0]}" if len(commits) == 1 else f"{len(commits)} commits ({', '.join(commits)}: a mix)"
    dirty = prov.get("dirty", UNKNOWN)
    tree = {True: "dirty tree: uncommitted changes", False: "clean tree"}.get(dirty, "tree dirty: unknown")
    digests = [d[:12] for d in prov.get("code_digests", [])] or [UNKNOWN]
    return f"Code: {what} ({tree}); code digest {', '.join(digests)}."


def render_markdown(results: Mapping[str, Any], *, png_name: str = "ablation.png") -> str:
    """The report: per regime a table and the DAPO − GRPO / DAPO − sft-control (and successor − DAPO) lines, then
    the findings."""
    k = results.get("k")
    names = {r["name"] for regime in results["regimes"].values() for r in regime["rungs"]}
    lines = _preamble(results, names)
    for name, regime in results["regimes"].items():
        lines += ["", f"## {name} (lr {regime['lr']:g})", "", *_table(regime), ""]
        lines += _difference_lines(rungs_by_name(regime), k if k is not None else "k")
    lines += ["", _notes(results, names, png_name), "", "## What the curves show", ""]
    lines += [f"- {line}" for line in findings(results)]
    return "\n".join(lines) + "\n"


def _preamble(results: Mapping[str, Any], names: set[str]) -> list[str]:
    """The title (the ladder, its successors or both), what the table measures, the run's settings and base model,
    and the code the runs came from."""
    k = results.get("k")
    title = "# DAPO ablation (Table 1 in miniature)"
    if names & set(SUCCESSOR_RUNGS):
        title = (
            "# DAPO and its successors"
            if not names & (set(RUNG_NAMES) - {"grpo", "dapo"})
            else title + " and successors"
        )
    lines = [
        title,
        "",
        f"Held-out avg@{k if k is not None else 'k'} on problems never trained on (one fixed evaluation seed); "
        "paper: AIME 2024 avg@32 of Qwen2.5-32B (Table 1), shown for the shape of the ladder, not the scale.",
    ]
    meta = [f"{key} {results[key]}" for key in ("recipe", "steps", "date") if results.get(key) is not None]
    if results.get("base_acc") is not None:
        stop = results.get("base_stop") or {}
        split = ", ".join(f"{STOP_LABELS[key]} {pct(stop[key])}" for key in STOP_KEYS if key in stop)
        meta.append(f"base model {results['base_acc']:.3f}" + (f" ({split})" if split else ""))
    if meta:
        lines += ["", "; ".join(meta) + "."]
    return [*lines, "", provenance_line({**code_provenance(results), **_given_provenance(results)})]


def _difference_lines(rungs: Mapping[str, Mapping[str, Any]], k: int | str) -> list[str]:
    """A regime's paired differences, as list items: DAPO − GRPO, DAPO − each control, each successor − its base."""
    lines = []
    if "dapo" in rungs and "grpo" in rungs:
        lines.append("- " + difference_line("DAPO − GRPO", paired_difference(rungs["dapo"], rungs["grpo"]), k))
    for control in CONTROL_RUNGS:
        if "dapo" in rungs and control in rungs:
            diff = paired_difference(rungs["dapo"], rungs[control])
            lines.append("- " + difference_line(CONTROL_LABELS[control], diff, k))
    for succ in SUCCESSOR_RUNGS:
        ref = "grpo" if succ == "dr-grpo" else "dapo"
        if succ in rungs and ref in rungs:
            diff = paired_difference(rungs[succ], rungs[ref])
            lines.append("- " + difference_line(f"{succ} − {ref} (same seeds)", diff, k))
    return lines


def _notes(results: Mapping[str, Any], names: set[str], png_name: str) -> str:
    """The paragraph under the tables: the evidence columns, curves vs table, the controls (when run) and the stop
    split."""
    k = results.get("k")
    legend = ", ".join(f"{v} = {k}" for k, v in EVIDENCE_LABELS.items())
    return (
        f"Evidence columns: means over each run of {legend}. Curves ({png_name}): each training run's own "
        f"validation on the same problems (avg@{results.get('curve_k') or k or 'k'}, mean over seeds); the table: "
        f"the final models, scored by one evaluator (avg@{k if k is not None else 'k'})."
        + (
            " sft-control: the base model given the dapo rung's training time (same seed: the CPU seconds of its "
            "training steps, perf/cpu_time_per_step summed, which other jobs on the machine inflate less than wall "
            "time (~1.7x against ~2.3x under full contention); wall time with the Ray executor) of continued "
            "supervised training, on the warm start's own demonstrations (habits included: the paper's situation, "
            "no better demonstrations exist); sft-control-clean: the same on clean demonstrations that stop at their "
            "answer line (where such demonstrations exist, the control to beat)."
            if names & set(CONTROL_RUNGS)
            else ""
        )
        + (
            f" Stop split of each final model's responses: {STOP_LABELS['stop/stopped_rate']} = the share that stop "
            f"at their first answer line (the rest run on past it or give none), {STOP_LABELS['stop/acc_when_stopped']}"
            " = the accuracy of those (the arithmetic, apart from stopping)."
        )
    )


def _given_provenance(results: Mapping[str, Any]) -> dict[str, Any]:
    return {k: results[k] for k in ("commits", "dirty", "code_digests") if k in results}


# ------------------------------------------------------------------------------------------------ files
def check_results(results: Mapping[str, Any]) -> None:
    """ValueError naming the first missing piece of the ``{"regimes": {name: {"lr", "rungs": [...]}}}`` schema."""
    regimes = results.get("regimes")
    if not isinstance(regimes, Mapping) or not regimes:
        raise ValueError("ablation results need a non-empty 'regimes' mapping: {'regimes': {name: {'lr', 'rungs'}}}")
    for name, regime in regimes.items():
        if "lr" not in regime or not regime.get("rungs"):
            raise ValueError(f"ablation results: regime {name!r} needs 'lr' and a non-empty 'rungs' list")
        for i, r in enumerate(regime["rungs"]):
            missing = [k for k in ("name", "mean", "std", "seeds", "wall_s") if k not in r]
            if missing:
                raise ValueError(
                    f"ablation results: regime {name!r} rung #{i} ({r.get('name', '?')}) lacks {missing}; "
                    "build rungs with summarize_rung()"
                )


def report_stem(name: str) -> str:
    """The report files' stem (``ablation``, ``successors``): a plain file name, else ValueError with the fix."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name) or name.endswith(".json"):
        raise ValueError(
            f"--name {name!r}: the report files' stem must be a plain name (letters, digits, . _ -), e.g. "
            "--name successors (writes successors.json, .md, .png)"
        )
    return name


def write_report(results: Mapping[str, Any], out_dir: str | Path, *, name: str = "ablation") -> ReportPaths:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir`` (created); name default ``ablation``. The
    JSON gets the top-level ``commits``, ``dirty`` and ``code_digests`` of its records (``code_provenance``)."""
    check_results(results)
    results = {**results, **code_provenance(results)}
    stem = report_stem(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"{stem}.json"
    js.write_text(json.dumps(results, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    md = out / f"{stem}.md"
    md.write_text(render_markdown(results, png_name=f"{stem}.png"), encoding="utf-8")
    return ReportPaths(json=js, md=md, png=plot_ablation(results, out / f"{stem}.png"))
