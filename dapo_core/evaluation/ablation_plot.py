"""The ablation's figure: validation accuracy against step, one panel per regime (``ablation_report.write_report``
draws it beside the JSON and markdown reports)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dapo_core.config.ablation import CONTROL_RUNGS, SFT_CONTROL
from dapo_core.training.plots import save_figure


def plot_ablation(results: Mapping[str, Any], out_path: str | Path) -> Path:
    """Validation accuracy vs step: one panel per regime, one line per rung (mean over seeds), the control and the
    base model as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    regimes = results["regimes"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4.5), squeeze=False, sharey=True)
    for ax, (name, regime) in zip(axes.flat, regimes.items(), strict=True):
        for r in regime["rungs"]:
            if r["name"] in CONTROL_RUNGS:
                style = "--" if r["name"] == SFT_CONTROL else "-."
                ax.axhline(r["mean"], color="black", linestyle=style, label=f"{r['name']} (final model, same time)")
            elif r.get("curve"):
                steps, values = zip(*r["curve"], strict=True)
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=r["name"])
        if results.get("base_acc") is not None:
            ax.axhline(results["base_acc"], color="grey", linestyle=":", label="base model")
        ax.set_title(f"{name} (lr {regime['lr']:g})")
        ax.set_xlabel("train/step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    curve_k, k = results.get("curve_k") or results.get("k") or "k", results.get("k") or "k"
    axes.flat[0].set_ylabel(f"validation avg@{curve_k} during training (mean over seeds)")
    fig.text(0.01, 0.01, f"horizontal lines: final scores, avg@{k}", fontsize=7)
    fig.suptitle("DAPO ablation ladder")
    return save_figure(fig, out_path)
