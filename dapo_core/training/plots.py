"""Paper-style training-dynamics plots (DAPO Fig. 2-4: length, reward, entropy, mean probability, accuracy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PANELS: tuple[tuple[str, str], ...] = (
    ("response_length/mean", "mean response length"),
    ("critic/rewards/mean", "reward (shaped)"),
    ("actor/entropy", "entropy"),
    ("actor/mean_prob", "mean token probability"),
    ("train/acc/mean", "train accuracy"),
    ("val", "validation avg@k"),
)


def save_figure(fig: Any, out_path: str | Path) -> Path:
    """Lay out ``fig``, write it as a PNG at ``out_path`` (its folder created), close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_training_dynamics(
    histories: Mapping[str, Sequence[tuple[int, float]]], out_path: str | Path, *, title: str = ""
) -> Path:
    """One PNG with a panel per curve; ``histories`` maps metric key -> [(step, value)]. Missing keys: empty panel.

    The ``val`` panel draws every key starting with ``val/`` and containing ``mean_at_``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        keys = [k for k in histories if k.startswith("val/") and "mean_at_" in k] if key == "val" else [key]
        for k in keys:
            points = sorted(histories.get(k, []))
            if points:
                ax.plot(
                    [s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None, label=k
                )
        ax.set_title(label)
        ax.set_xlabel("train/step")
        ax.grid(alpha=0.3)
        if key == "val" and keys:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return save_figure(fig, out_path)
