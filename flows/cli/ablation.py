"""`dapo ablation`: DAPO's Table 1 in miniature (GRPO -> +each technique -> DAPO, and supervised controls)."""

from __future__ import annotations

import time

import typer

from flows.cli.common import fail
from flows.cli.stage_command import stage_command
from flows.stage_params import ABLATION, StageValues


def _ablation(v: StageValues) -> None:
    """Run the ladder; print each regime's held-out scores and where the report went."""
    from flows import stages

    t0 = time.perf_counter()
    try:
        result = stages.run("ablation", v)  # the plan's checks run first, before any work
    except stages.user_errors("ablation") as exc:
        fail(str(exc))
    typer.echo("")
    reused = f", {result['reused_runs']} journaled run(s) reused" if result.get("reused_runs") else ""
    typer.echo(
        f"== dapo ablation finished in {time.perf_counter() - t0:.0f}s (MLflow run {result['parent_run_id']}{reused})"
    )
    for name, regime in result["regimes"].items():
        row = "  ".join(f"{r['name']} {r['mean']:.3f}" for r in regime["rungs"])
        typer.echo(f"{name} (lr {regime['lr']:g}), held-out avg@{result['k']}: {row}")
    for kind, path in result["paths"].items():
        typer.echo(f"{kind}: {path}")


def register(app: typer.Typer) -> None:
    """Add ``dapo ablation`` (its options: flows/stage_params.py's ABLATION) to ``app``."""
    stage_command(app, ABLATION, _ablation)
