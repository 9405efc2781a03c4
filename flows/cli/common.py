"""Options and helpers shared by every `dapo` command module (flows/cli/__init__.py and flows/cli/*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from dapo_core.config import ConfigError, DapoConfig, load_config

EXIT_USAGE = 2

_stderr = Console(stderr=True, soft_wrap=True)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: params.yaml); excludes --recipe."),
]
RecipeOpt = Annotated[
    str | None, typer.Option("--recipe", "-r", help="Recipe name from recipes/ (see `dapo config recipes`).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one key: dotted.key=value (YAML value); repeatable, last wins."),
]


def fail(message: str) -> NoReturn:
    """Print a red error to stderr (no traceback) and exit with status 2."""
    _stderr.print(f"error: {message}", style="red", markup=False, highlight=False)
    raise typer.Exit(EXIT_USAGE)


def resolve_config(config: Path | None, recipe: str | None, overrides: list[str] | None) -> DapoConfig:
    """`load_config` for a command: a bad config or a missing file becomes `fail(...)`."""
    try:
        return load_config(config_path=config, recipe=recipe, overrides=overrides or ())
    except (ConfigError, FileNotFoundError) as exc:
        fail(str(exc))
