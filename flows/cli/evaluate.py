"""`dapo evaluate` and `dapo compare` (wired into the CLI by ``register(app)``).

dapo evaluate                                               # model.path on data.val_files, k = rollout.val_n
dapo evaluate --model outputs/tiny-dapo/final --k 32 --data data/aime-2024.parquet
dapo evaluate --model runs:/<run_id>/model                 # or models:/<name>/<version>, or an HF hub id
dapo compare tiny-dapo tiny-grpo --out outputs/compare      # run names or ids; writes compare.png + compare.md
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config
from flows.cli.stage_command import stage_command
from flows.stage_params import EVALUATE, StageValues


def _evaluate(v: StageValues) -> None:
    """Score a model; print where the metrics went and its accuracies."""
    from flows import stages

    try:
        summary = stages.run("evaluate", v)
    except stages.user_errors("evaluate") as exc:  # missing model/data, bad file, bad knob
        fail(str(exc))
    typer.echo(
        f"evaluated {summary['model']} on {summary['num_problems']} problems x {summary['n']} samples "
        f"(MLflow run {summary['run_id']}; metrics in {summary['metrics_path']})"
    )
    for key in sorted(summary["metrics"]):
        if "/acc/" in key:
            typer.echo(f"  {key} = {summary['metrics'][key]:.4f}")


def register(app: typer.Typer) -> None:
    """Add the ``evaluate`` and ``compare`` commands to ``app``."""

    stage_command(app, EVALUATE, _evaluate)

    @app.command("compare")
    def compare(
        runs: Annotated[list[str], typer.Argument(help="MLflow run ids or run names (newest run of that name).")],
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")] = Path("outputs/compare"),
        metric: Annotated[
            list[str] | None,
            typer.Option(
                "--metric",
                help="Metric key to plot; repeatable (default: accuracy, entropy, length, reward, clip fractions).",
            ),
        ] = None,
        title: Annotated[str | None, typer.Option(help="Figure title.")] = None,
    ) -> None:
        """Overlay runs' curves in one PNG and tabulate their final metrics (markdown)."""
        resolve_config(config, recipe, overrides)
        from flows.evaluate import compare_flow

        try:
            result = compare_flow(
                runs=list(runs),
                out_dir=str(out),
                metrics=list(metric) if metric else None,
                config_path=str(config) if config else None,
                recipe=recipe,
                overrides=list(overrides or []),
                title=title,
            )
        except ValueError as exc:  # unknown run, nothing to plot
            fail(str(exc))
        typer.echo(result["table"], nl=False)
        typer.echo(f"wrote {result['png']} and {result['table_path']} (also in MLflow run {result['run_id']})")
