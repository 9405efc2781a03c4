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

from dapo_core.data.schema import SchemaError
from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config


def parse_ks(text: str | None) -> list[int] | None:
    """``"1,4,8"`` -> [1, 4, 8]; None stays None (the default list)."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"--ks {text!r} must be comma-separated positive integers, e.g. --ks 1,4,8,16,32")
    if not values or min(values) < 1:
        fail(f"--ks {text!r} must list positive integers, e.g. --ks 1,4,8,16,32")
    return values


def register(app: typer.Typer) -> None:
    """Add the ``evaluate`` and ``compare`` commands to ``app``."""

    @app.command("evaluate")
    def evaluate(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        model: Annotated[
            str | None,
            typer.Option(
                "--model",
                "-m",
                help="Local HF dir, runs:/ID/PATH, models:/NAME/VERSION or an HF id (default: model.path).",
            ),
        ] = None,
        data: Annotated[
            list[str] | None,
            typer.Option("--data", "-d", help="verl-schema parquet file; repeatable (default: data.val_files)."),
        ] = None,
        k: Annotated[
            int | None, typer.Option("--k", min=1, help="Samples per problem (default: rollout.val_n; paper 32).")
        ] = None,
        ks: Annotated[
            str | None,
            typer.Option("--ks", help="k values for pass@k / maj@k, comma-separated (default 1,2,4,...,32; <= k)."),
        ] = None,
        seed: Annotated[int | None, typer.Option(help="Sampling seed (default: derived from trainer.seed).")] = None,
        out: Annotated[Path, typer.Option("--out", "-o", help="Metrics JSON for DVC.")] = Path("metrics/eval.json"),
        run_name: Annotated[str | None, typer.Option(help="MLflow run name (default: eval-<model>).")] = None,
    ) -> None:
        """Sample k responses per problem, score them, log avg@k / pass@k / maj@k to MLflow and metrics/eval.json."""
        resolve_config(config, recipe, overrides)  # a bad config fails here, with a clean message
        from flows.evaluate import evaluate_flow  # prefect import deferred: `dapo --help` stays fast

        try:
            summary = evaluate_flow(
                config_path=str(config) if config else None,
                recipe=recipe,
                overrides=list(overrides or []),
                model=model,
                data=list(data) if data else None,
                k=k,
                ks=parse_ks(ks),
                seed=seed,
                metrics_path=str(out),
                run_name=run_name,
            )
        except (FileNotFoundError, SchemaError, ValueError) as exc:  # missing model/data, bad file, bad knob
            fail(str(exc))
        typer.echo(
            f"evaluated {summary['model']} on {summary['num_problems']} problems x {summary['n']} samples "
            f"(MLflow run {summary['run_id']}; metrics in {summary['metrics_path']})"
        )
        for key in sorted(summary["metrics"]):
            if "/acc/" in key:
                typer.echo(f"  {key} = {summary['metrics'][key]:.4f}")

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
