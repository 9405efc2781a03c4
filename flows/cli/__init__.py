"""The `dapo` command line (typer). Every command resolves one config, then starts a flow.

    dapo config show                           # params.yaml, resolved (env + defaults)
    dapo config show --recipe dapo-qwen2.5-32b --set trainer.lr=2e-6 --flat
    dapo config recipes                        # the recipes shipped in recipes/

Config resolution, lowest first: `--config PATH` (default params.yaml) or `--recipe NAME` -> environment
(MLFLOW_TRACKING_URI, RAY_ADDRESS) -> each `--set dotted.key=value`.

Adding a command: reuse `ConfigOpt`, `RecipeOpt`, `SetOpt` and `resolve_config(...)`, then either decorate a
function with `@app.command()` here, or build a `typer.Typer()` group (e.g. `data_app` with `generate`) and
`app.add_typer(data_app, name="data")`. Only real commands are registered: `data`, `curate`, `train`,
`evaluate`, `pipeline` and `compare` appear once their flows exist.
"""

from __future__ import annotations

from dapo_core.env import apply_quiet_env

# Before anything imports prefect / mlflow / ray: the CLI sets the quiet/offline environment itself, so `dapo`
# run outside make (and DVC stages calling it) behave the same.
apply_quiet_env()

import logging  # noqa: E402
from typing import Annotated  # noqa: E402

import typer  # noqa: E402

from dapo_core.config import (  # noqa: E402
    available_recipes,
    dump_yaml,
    flatten_config,
    recipe_summary,
)
from flows.cli.common import (  # noqa: E402  (re-exported: the commands' shared options)
    ConfigOpt,
    RecipeOpt,
    SetOpt,
    resolve_config,
)

app = typer.Typer(
    name="dapo",
    help="DAPO (arXiv 2503.14476) as a reproducible pipeline: data -> curate -> train -> evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect the resolved config and the shipped recipes.", no_args_is_help=True)
app.add_typer(config_app, name="config")


# commands whose subprocesses (Prefect's temporary server, Ray, engines) must not outlive them (flows/services/reaper.py);
# not `ui` or `stack`, whose servers run on in the background by design
REAPED_COMMANDS = frozenset({"train", "pipeline", "ablation", "evaluate", "base-model", "curate", "data", "serve"})


@app.callback()
def main(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at DEBUG level.")] = False,
) -> None:
    """DAPO (arXiv 2503.14476) as a reproducible pipeline: data -> curate -> train -> evaluate."""
    if ctx.invoked_subcommand in REAPED_COMMANDS:
        from flows.services.reaper import start_reaper

        start_reaper()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # one line per HTTP call to the local Prefect/MLflow APIs is noise
        for name in ("httpx", "httpcore", "urllib3", "alembic", "mlflow.store.db.utils"):
            logging.getLogger(name).setLevel(logging.WARNING)


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    recipe: RecipeOpt = None,
    overrides: SetOpt = None,
    flat: Annotated[bool, typer.Option("--flat", help="Print dotted key=value lines (the MLflow params).")] = False,
) -> None:
    """Print the resolved config as YAML (or, with --flat, one dotted key=value per line)."""
    cfg = resolve_config(config, recipe, overrides)
    if flat:
        typer.echo("\n".join(f"{key}={value}" for key, value in flatten_config(cfg).items()))
    else:
        typer.echo(dump_yaml(cfg), nl=False)


@config_app.command("recipes")
def config_recipes() -> None:
    """List the recipes, one line each: name and summary."""
    names = available_recipes()
    width = max((len(n) for n in names), default=0)
    for name in names:
        typer.echo(f"{name:<{width}}  {recipe_summary(name)}")


def _register_commands() -> None:
    """Commands that start flows live in their own modules (flows/cli/*.py) and import Prefect lazily; the stage
    commands (curate, base-model, train, evaluate, pipeline, ablation) take their options from
    flows/stage_params.py, as the Prefect deployments take their form."""
    from flows.cli import ablation, base_model, bench, data, evaluate, pipeline, plan, serve, stack, train, ui

    for module in (data, base_model, train, evaluate, pipeline, ablation, serve, ui, stack, bench, plan):
        module.register(app)


_register_commands()

if __name__ == "__main__":
    app()
