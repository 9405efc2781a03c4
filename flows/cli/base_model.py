"""`dapo base-model`: the cached warm start of the tiny base model (wired into the CLI by ``register(app)``).

dapo base-model                              # params.yaml -> outputs/base_model/ (reused when up to date)
dapo base-model --steps 300 --lr 2e-3        # other warm-start knobs
dapo base-model --force                      # rebuild even when the stamp matches
"""

from __future__ import annotations

import typer

from flows.cli.common import fail
from flows.cli.stage_command import stage_command
from flows.stage_params import BASE_MODEL, StageValues


def _base_model(v: StageValues) -> None:
    """Warm-start (or reuse) the base model; print where it is and its held-out accuracy."""
    from flows import stages

    try:
        summary = stages.run("base-model", v)
    except stages.user_errors("base-model") as exc:  # invalid knobs say value, rule and fix
        fail(str(exc))
    metrics = summary.get("metrics", {})
    state = "reused (up to date)" if summary["cached"] else f"trained {summary['steps']} steps"
    typer.echo(f"base model {state}: {summary['output_dir']}  (MLflow run {summary['run_id']})")
    for key in sorted(k for k in metrics if k.startswith("heldout/acc/")):
        typer.echo(f"  {key} = {metrics[key]:.3f}")


def register(app: typer.Typer) -> None:
    """Add ``dapo base-model`` (its options: flows/stage_params.py's BASE_MODEL) to ``app``."""
    stage_command(app, BASE_MODEL, _base_model)
