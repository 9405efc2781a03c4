"""Compare runs: overlay their metric curves in one PNG and tabulate their final values in markdown.

The input is plain data, ``{run name: {metric key: [(step, value), ...]}}``, so this module knows nothing about
MLflow; ``dapo compare`` (flows/cli/evaluate.py) reads the histories from MLflow and calls ``compare_runs``:

    result = compare_runs({"dapo": hist_a, "grpo": hist_b}, "outputs/compare")
    result.png          # outputs/compare/compare.png: one panel per metric, one line per run
    result.table        # "| run | val/math_dapo/acc/mean_at_8 | ... |" (also written to compare.md)

The default panels are what one looks at after DAPO vs GRPO (Figs. 2-3 of the paper): validation accuracy,
training accuracy and reward, entropy, response length, clip fractions, reflection rate.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_core.algorithm import metric_names as mn

logger = logging.getLogger(__name__)

History = Sequence[tuple[int, float]]
RunHistories = Mapping[str, Mapping[str, History]]

VAL_ACC_PATTERN = re.compile(r"^val/[^/]+/acc/mean_at_\d+$")
"""Validation avg@k keys (one per data source); they come first in the default panels."""

DEFAULT_CURVES: tuple[str, ...] = (
    mn.TRAIN_ACC_MEAN,
    mn.stat(mn.CRITIC_SCORE, "mean"),
    mn.ACTOR_ENTROPY,
    mn.RESPONSE_LENGTH_MEAN,
    mn.ACTOR_PG_CLIPFRAC,
    mn.ACTOR_PG_CLIPFRAC_HIGH,
    mn.ACTOR_PG_CLIPFRAC_LOW,
    mn.ROLLOUT_REFLECTION_RATE,
)
"""Training curves in the default panels, in this order (when any run has them)."""

PNG_NAME = "compare.png"
TABLE_NAME = "compare.md"


@dataclass(frozen=True)
class CompareResult:
    png: Path
    table_path: Path
    table: str
    metrics: list[str]


def default_metrics(histories: RunHistories) -> list[str]:
    """Validation avg@k keys (sorted), then ``DEFAULT_CURVES``; only keys some run has logged."""
    present = {key for run in histories.values() for key, hist in run.items() if hist}
    val = sorted(key for key in present if VAL_ACC_PATTERN.match(key))
    return val + [key for key in DEFAULT_CURVES if key in present]


def final_value(history: History) -> float | None:
    """The value at the largest step (the last logged one on ties); None for an empty history."""
    if not history:
        return None
    return max(enumerate(history), key=lambda item: (item[1][0], item[0]))[1][1]


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if math.isnan(value):
        return "nan"
    return f"{value:.4g}"


def final_metrics_table(histories: RunHistories, metrics: Sequence[str] | None = None) -> str:
    """Markdown table: one row per run, one column per metric, the final value of each (``n/a`` if absent)."""
    keys = list(metrics) if metrics is not None else default_metrics(histories)
    header = "| run | " + " | ".join(keys) + " |"
    rule = "|---|" + "---:|" * len(keys)
    lines = [header, rule]
    for run, hist in histories.items():
        cells = [_fmt(final_value(hist.get(key, ()))) for key in keys]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(
    histories: RunHistories,
    out_png: str | Path,
    metrics: Sequence[str] | None = None,
    *,
    title: str | None = None,
    ncols: int = 3,
) -> Path:
    """One panel per metric, one line per run (step on x), written as a PNG with the Agg backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = list(metrics) if metrics is not None else default_metrics(histories)
    if not keys:
        raise ValueError(
            "nothing to plot: none of the runs logged any of the requested metrics; pass metric keys the runs "
            f"have (runs: {sorted(histories)})"
        )
    ncols = max(1, min(ncols, len(keys)))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, key in enumerate(keys):
        ax = axes[i // ncols][i % ncols]
        for r, (run, hist) in enumerate(histories.items()):
            points = sorted(hist.get(key, ()))
            if points:  # one colour per run in every panel, even where another run is missing
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, color=f"C{r % 10}", marker="." if len(points) < 30 else None, label=run)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for j in range(len(keys), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    seen: dict[str, Any] = {}  # one legend entry per run, from whichever panel has it
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    labels, handles = list(seen), list(seen.values())
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    logger.info("wrote %s (%d panels, %d runs)", out, len(keys), len(histories))
    return out


def compare_runs(
    histories: RunHistories, out_dir: str | Path, metrics: Sequence[str] | None = None, *, title: str | None = None
) -> CompareResult:
    """Write ``compare.png`` and ``compare.md`` (final metrics) under ``out_dir``."""
    if not histories:
        raise ValueError("no runs to compare: pass at least one run's metric histories")
    keys = list(metrics) if metrics is not None else default_metrics(histories)
    out = Path(out_dir)
    png = plot_curves(histories, out / PNG_NAME, keys, title=title)
    table = final_metrics_table(histories, keys)
    table_path = out / TABLE_NAME
    table_path.write_text(table, encoding="utf-8")
    return CompareResult(png=png, table_path=table_path, table=table, metrics=keys)
