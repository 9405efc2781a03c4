"""The ablation report's findings: what the curves and the evidence show, generated from the numbers.

``findings(results)`` gives one line per observation (no placeholders) for the markdown report
(``ablation_report.render_markdown``); the small helpers it shares with the report (``rungs_by_name``, ``pct``,
``finite_mean``) live here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dapo_core.config.ablation import CONTROL_RUNGS, RUNG_NAMES, SUCCESSOR_RUNGS

TIE = 1e-9  # accuracies closer than this are equal (avg@k of the same problems is a ratio of small integers)
TRUNCATION_MIN = 0.01  # response_length/clip_ratio above this counts as truncation worth naming


def rungs_by_name(regime: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A regime's rung entries by name."""
    return {r["name"]: r for r in regime["rungs"]}


def pct(value: float | None) -> str:
    """``12.3%``; ``–`` for None."""
    return "–" if value is None else f"{100 * value:.1f}%"


def finite_mean(values: Sequence[float | None]) -> float | None:
    """The mean of the finite values given (None and NaN skipped); None when there are none."""
    got = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(got) / len(got) if got else None


def findings(results: Mapping[str, Any]) -> list[str]:
    """What the curves and the evidence show, generated from the numbers (one line each, no placeholders): per
    regime, then the per-rung difference between the first two regimes."""
    out: list[str] = []
    for name, regime in results["regimes"].items():
        out += _regime_findings(name, regime)
    names = list(results["regimes"])
    if len(names) >= 2:
        a, b = (rungs_by_name(results["regimes"][n]) for n in names[:2])
        deltas = [f"{n} {b[n]['mean'] - a[n]['mean']:+.3f}" for n in a if n in b]
        out.append(f"{names[1]} − {names[0]} per rung: {', '.join(deltas)}.")
    return out


def _regime_findings(name: str, regime: Mapping[str, Any]) -> list[str]:
    """One regime's findings: the ranking, the successors' clipping, truncation, clip-higher, dynamic sampling,
    entropy and the validation curves; none without a rung of the ladder."""
    rungs = rungs_by_name(regime)
    ladder = [r for r in regime["rungs"] if r["name"] in RUNG_NAMES]
    if not ladder:
        return []
    ranked = [r for r in regime["rungs"] if r["name"] not in CONTROL_RUNGS]  # the ladder and any successors
    out = [_ranking_line(name, ladder, ranked)]
    out += _successor_findings(name, rungs)
    out += _truncation_findings(name, ladder)
    sym = finite_mean([rungs[n].get("actor/pg_clipfrac_high") for n in ("grpo", "overlong-filtering") if n in rungs])
    dec = finite_mean(
        [r.get("actor/pg_clipfrac_high") for r in ladder if r["name"] not in ("grpo", "overlong-filtering")]
    )
    if sym is not None and dec is not None:
        out.append(
            f"{name}: upper-clip fraction (actor/pg_clipfrac_high) {pct(sym)} with eps_high = eps_low vs "
            f"{pct(dec)} from clip-higher on."
        )
    kept = rungs.get("dapo", {}).get("train/kept_groups_frac")
    if kept is not None:
        out.append(
            f"{name}: dynamic sampling kept {pct(kept)} of generated groups (the rest had zero reward variance)."
        )
    return out + _entropy_findings(name, ranked) + _curve_findings(name, ranked)


def _ranking_line(name: str, ladder: Sequence[Mapping[str, Any]], ranked: Sequence[Mapping[str, Any]]) -> str:
    """The best rung (or the tied ones) and, on an ordered ladder of 3+ rungs, which techniques lowered the mean;
    else the span of the means."""
    top = max(r["mean"] for r in ranked)
    best = [r["name"] for r in ranked if math.isclose(r["mean"], top, abs_tol=TIE)]
    lead = f"best rung {best[0]}" if len(best) == 1 else f"tied best ({len(best)} rungs): {', '.join(best)}"
    if len(ladder) >= 3:  # an ordered ladder: does each added technique keep the mean?
        drops = [
            f"{b['name']} ({b['mean'] - a['mean']:+.3f})"
            for a, b in itertools.pairwise(ladder)
            if b["mean"] < a["mean"] - TIE
        ]
        order = "every technique kept or raised the mean" if not drops else "lower than the rung before: "
        return f"{name}: {lead} ({top:.3f}); {order}{', '.join(drops)}."
    spread = top - min(r["mean"] for r in ranked)
    return f"{name}: {lead} ({top:.3f}); the rungs' means span {spread:.3f}."


def _truncation_findings(name: str, ladder: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ladder rungs that truncated more than ``TRUNCATION_MIN`` of their responses, or that none did."""
    trunc = [(r["name"], r.get("response_length/clip_ratio")) for r in ladder]
    hit = [f"{n} {pct(v)}" for n, v in trunc if v is not None and v > TRUNCATION_MIN]
    if hit:
        return [f"{name}: truncation at max_response_length (response_length/clip_ratio): {', '.join(hit)}."]
    if any(v is not None for _, v in trunc):
        return [
            f"{name}: no rung truncated more than {pct(TRUNCATION_MIN)} of its responses: the overlong "
            "techniques had little to act on at this response length."
        ]
    return []


def _entropy_findings(name: str, ranked: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the entropy was lowest and highest (or that it was about equal), given two rungs that logged it."""
    ent = [(r["name"], r["actor/entropy"]) for r in ranked if r.get("actor/entropy") is not None]
    if len(ent) < 2:
        return []
    lo, hi = min(ent, key=lambda x: x[1]), max(ent, key=lambda x: x[1])
    if math.isclose(lo[1], hi[1], rel_tol=1e-3, abs_tol=TIE):
        return [f"{name}: entropy about equal on every rung ({hi[1]:.3f})."]
    return [f"{name}: entropy lowest at {lo[0]} ({lo[1]:.3f}), highest at {hi[0]} ({hi[1]:.3f})."]


def _curve_findings(name: str, ranked: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rungs whose validation curve ended below, and above, its step-0 value."""
    out = []
    fell = [f"{r['name']} ({r['curve'][0][1]:.3f} → {r['curve'][-1][1]:.3f})" for r in ranked
            if len(r.get("curve") or []) >= 2 and r["curve"][-1][1] < r["curve"][0][1]]  # fmt: skip
    rose = [r["name"] for r in ranked if len(r.get("curve") or []) >= 2 and r["curve"][-1][1] > r["curve"][0][1]]
    if fell:
        out.append(f"{name}: validation accuracy ended below its step-0 value for {', '.join(fell)}.")
    if rose:
        out.append(f"{name}: validation accuracy ended above its step-0 value for {', '.join(rose)}.")
    return out


def _successor_findings(name: str, rungs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """How often each successor's own clip bound acted, beside its base rung (GSPO counts sequences)."""
    out = []
    for succ in SUCCESSOR_RUNGS:
        ref = "grpo" if succ == "dr-grpo" else "dapo"
        if succ not in rungs or ref not in rungs:
            continue
        hi, lo = rungs[succ].get("actor/pg_clipfrac_high"), rungs[succ].get("actor/pg_clipfrac_low")
        ref_hi, ref_lo = rungs[ref].get("actor/pg_clipfrac_high"), rungs[ref].get("actor/pg_clipfrac_low")
        if hi is None or lo is None:
            continue
        # GSPO clips a sequence's ratio, but its clip fraction is a token mean: the share of response tokens that
        # belong to clipped sequences (longer sequences weigh more), not a share of sequences
        unit = "tokens (the tokens of sequences whose sequence ratio was clipped)" if succ == "gspo" else "token ratios"
        line = f"{name}: {succ} clipped {pct(hi)} (upper) / {pct(lo)} (lower) of its {unit}"
        if ref_hi is not None and ref_lo is not None:
            line += f", {ref} {pct(ref_hi)} / {pct(ref_lo)} of its token ratios"
        out.append(line + ".")
        if succ == "cispo" and hi == 0.0:
            out.append(
                f"{name}: cispo's weight clip (r ≤ 1 + eps_high) never bound: no token ratio reached it in any "
                "update. It binds only where later updates are off-policy enough (ppo_epochs > 1, several "
                "mini-batches per rollout step, a larger lr, or a smaller eps_high; checked in "
                "tests/test_objectives.py::test_cispo_clip_binds_in_later_off_policy_updates)."
            )
    return out
