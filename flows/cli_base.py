"""`dapo base-model`: the cached warm start of the tiny base model (wired into the CLI by ``register(app)``).

dapo base-model                              # params.yaml -> outputs/base_model/ (reused when up to date)
dapo base-model --steps 300 --lr 2e-3        # other warm-start knobs
dapo base-model --force                      # rebuild even when the stamp matches
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config


def register(app: typer.Typer) -> None:
    """Add the ``base-model`` command to ``app``."""

    @app.command("base-model")
    def base_model(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        output_dir: Annotated[
            Path, typer.Option("--output-dir", "-o", help="Where the HF model directory goes.")
        ] = Path("outputs/base_model"),
        steps: Annotated[int | None, typer.Option(help="SFT optimizer steps (default: base_model.steps).")] = None,
        lr: Annotated[float | None, typer.Option(help="Peak learning rate (default: base_model.lr).")] = None,
        batch_size: Annotated[
            int | None, typer.Option(help="Problems per SFT step (default: base_model.batch_size).")
        ] = None,
        heldout_size: Annotated[
            int | None, typer.Option(help="Held-out problems (default: base_model.heldout_size).")
        ] = None,
        heldout_k: Annotated[
            int | None, typer.Option(help="Samples per held-out problem (default: base_model.heldout_k).")
        ] = None,
        time_budget: Annotated[
            float | None, typer.Option(help="Stop SFT after this many seconds (breaks determinism).")
        ] = None,
        seed: Annotated[int | None, typer.Option(help="Warm-start seed (default trainer.seed).")] = None,
        force: Annotated[bool, typer.Option("--force", help="Rebuild even when the cached model is current.")] = False,
    ) -> None:
        """Warm-start the tiny Qwen2 on synthetic worked solutions (SFT): the CPU default's base model."""
        resolve_config(config, recipe, overrides)  # a bad config fails here, with a clean message
        from flows.base_model import base_model_flow  # prefect import deferred: `dapo --help` stays fast

        try:
            summary = base_model_flow(
                config_path=str(config) if config else None,
                recipe=recipe,
                overrides=list(overrides or []),
                output_dir=str(output_dir),
                steps=steps,
                lr=lr,
                batch_size=batch_size,
                heldout_size=heldout_size,
                heldout_k=heldout_k,
                time_budget_s=time_budget,
                seed=seed,
                force=force,
            )
        except ValueError as exc:  # invalid knobs (WarmStartConfig) say value, rule and fix
            fail(str(exc))
        metrics = summary.get("metrics", {})
        state = "reused (up to date)" if summary["cached"] else f"trained {summary['steps']} steps"
        typer.echo(f"base model {state}: {summary['output_dir']}  (MLflow run {summary['run_id']})")
        for key in sorted(k for k in metrics if k.startswith("heldout/acc/")):
            typer.echo(f"  {key} = {metrics[key]:.3f}")
