"""`dapo pipeline`: curate -> base model -> train -> evaluate, then where to look at the results."""

from __future__ import annotations

import time

import typer

from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config
from flows.cli_train import USER_ERRORS


def _ui_help(tracking_uri: str) -> str:
    store = tracking_uri
    return "\n".join(
        [
            f"MLflow store: {store} (artifacts under ./mlartifacts unless tracking.artifact_location says otherwise)",
            "Open the MLflow UI on it:",
            f"    .venv/bin/mlflow ui --backend-store-uri {store} --host 127.0.0.1 --port 5000 --workers 1",
            "    then browse http://127.0.0.1:5000 (experiment 'dapo-flow': the pipeline run and its nested stages)",
            "Open the Prefect UI (flow runs of this machine live in ./.prefect):",
            "    PREFECT_HOME=$PWD/.prefect .venv/bin/prefect server start --host 127.0.0.1 --port 4200",
            "    then browse http://127.0.0.1:4200",
            "Reproduce with DVC:  source .venv/bin/activate && dvc status && dvc repro",
        ]
    )


def register(app: typer.Typer) -> None:
    @app.command("pipeline")
    def pipeline(config: ConfigOpt = None, recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
        """The whole mission: curate -> base model (warm start) -> train (DAPO) -> evaluate, all tracked."""
        resolve_config(config, recipe, overrides)
        from flows.pipeline import pipeline_flow

        t0 = time.perf_counter()
        try:
            s = pipeline_flow(config_path=str(config) if config else None, recipe=recipe, overrides=overrides or [])
        except USER_ERRORS as exc:
            fail(str(exc))
        typer.echo("")
        typer.echo(f"== dapo pipeline finished in {time.perf_counter() - t0:.0f}s")
        typer.echo(
            f"Held-out accuracy (avg@{s['k']}, sampled, problems never trained on): "
            f"base model {s['base_acc']:.3f} -> after RL {s['final_acc']:.3f}"
        )
        typer.echo(f"Final policy: {s['train']['final_model']} (registered as {s['train']['registered_model']})")
        typer.echo(f"Training dynamics plot: {s['train']['plot']}")
        typer.echo(_ui_help(s["tracking_uri"]))
        if not s["dvc_committed"]:
            typer.echo("note: stage outputs were not recorded in dvc.lock (see the warning above)")
