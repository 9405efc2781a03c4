"""`dapo data generate` and `dapo curate`: registered on the main CLI by ``register(app)`` (see flows/cli/__init__.py).

dapo data generate [--force]                 # the seeded synthetic raw file (curation.synthetic)
dapo curate [--set curation.val_size=100]    # sources -> outputs/curated/ (+ data card, MLflow run)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dapo_core.config import ConfigError
from dapo_core.data.freshness import SourceChangedError
from dapo_core.data.schema import SchemaError
from flows.cli.common import ConfigOpt, RecipeOpt, SetOpt, fail
from flows.cli.stage_command import stage_command
from flows.stage_params import CURATE, StageValues

# What a user can fix from the message alone: print it, no traceback.
_USER_ERRORS = (ConfigError, SchemaError, FileNotFoundError, ImportError, SourceChangedError)


def _check_config(config: Path | None, recipe: str | None, overrides: list[str] | None) -> None:
    """Resolve the config before the flow starts, so a bad config is one red line (no Prefect start-up)."""
    from tasks.data import resolve_curation

    try:
        resolve_curation(config, recipe, overrides or [])
    except (ConfigError, FileNotFoundError) as exc:
        fail(str(exc))


def _summary(result: dict[str, Any]) -> str:
    dropped = ", ".join(f"{k} {v}" for k, v in result["dropped"].items() if v) or "none"
    lines = [
        f"curated {result['rows_in']} rows -> train {result['train']}, val {result['val']} (dropped: {dropped})",
        f"digest {result['digest']}",
        *(f"  {p}" for p in result["files"]),
    ]
    if result["mlflow_run_id"]:
        lines.append(f"MLflow run {result['mlflow_run_id']}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    """Add the `data` command group (`data generate`) and the `curate` command to ``app``."""
    data_app = typer.Typer(help="Raw inputs under data/ (tracked by data.dvc).", no_args_is_help=True)

    @data_app.command("generate")
    def data_generate(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        force: Annotated[bool, typer.Option("--force", help="Rewrite the file even when it exists.")] = False,
    ) -> None:
        """Write the seeded synthetic raw file (curation.synthetic.*): same settings, same bytes."""
        _check_config(config, recipe, overrides)
        from flows.curate import generate_flow

        try:
            result = generate_flow(str(config) if config else None, recipe, overrides or [], force=force)
        except _USER_ERRORS as exc:
            fail(str(exc))
        state = "wrote" if result["created"] else "kept existing"
        typer.echo(f"{state} {result['path']} ({result['n']} problems, seed {result['seed']}, md5 {result['md5']})")

    def curate(v: StageValues) -> None:
        from flows import stages

        try:
            result = stages.run("curate", v)
        except stages.user_errors("curate") as exc:
            fail(str(exc))
        typer.echo(_summary(result))

    stage_command(app, CURATE, curate)
    app.add_typer(data_app, name="data")
