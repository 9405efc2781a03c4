"""`dapo stack start|status|env|stop`: the team topology on one machine (`make stack`, `make stack-stop`).

dapo stack start                  # PostgreSQL, MLflow server, Prefect server + work pool + deployments, Ray head
                                  # and a worker node, a Prefect worker, a DVC remote; logs and PIDs in
                                  # outputs/stack/; run again, it starts whatever has stopped
eval "$(dapo stack env)"          # point this shell at it (PREFECT_API_URL, MLFLOW_TRACKING_URI, RAY_ADDRESS, ...)
dapo stack status
dapo stack stop                   # every process it started; the databases, artifacts and remote stay

flows/services/stack.py says what runs where; docs/team-stack.md how the same maps onto several machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import fail
from flows.services import stack

stack_app = typer.Typer(
    help="The team topology on this machine (PostgreSQL-backed MLflow, Prefect work pool + worker, Ray head, DVC "
    "remote): start, status, env, stop.",
    no_args_is_help=True,
)

StateDirOpt = Annotated[Path, typer.Option("--state-dir", help="Where the logs, PID files, databases and remote go.")]
DEFAULT = stack.StackSettings()


def _port(value: int, option: str) -> int:
    if not 0 < value < 65536:
        fail(f"{option} {value}: a TCP port is 1..65535")
    return value


@stack_app.command("start")
def start(
    postgres_port: Annotated[int, typer.Option("--postgres-port", help="PostgreSQL port.")] = DEFAULT.postgres_port,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", help="MLflow server port.")] = DEFAULT.mlflow_port,
    prefect_port: Annotated[int, typer.Option("--prefect-port", help="Prefect server port.")] = DEFAULT.prefect_port,
    ray_port: Annotated[int, typer.Option("--ray-port", help="Ray head (GCS) port.")] = DEFAULT.ray_port,
    dashboard_port: Annotated[
        int, typer.Option("--dashboard-port", help="Ray dashboard port (the state API).")
    ] = DEFAULT.dashboard_port,
    ray_cpus: Annotated[
        int | None, typer.Option("--ray-cpus", help="CPUs the Ray worker node offers; default all.", min=1)
    ] = None,
    crash_after: Annotated[
        int,
        typer.Option(
            "--crash-after",
            min=45,
            help="Seconds without a heartbeat after which Prefect marks a flow run CRASHED (its process is gone; "
            "flow runs send one every 30 s).",
        ),
    ] = DEFAULT.crash_after_s,
    pool: Annotated[str, typer.Option(help="Prefect work pool (prefect.yaml's is dapo-process).")] = DEFAULT.pool,
    project_dir: Annotated[
        Path, typer.Option("--project-dir", help="The project folder: prefect.yaml, where the worker runs flows.")
    ] = Path("."),
    state_dir: StateDirOpt = Path(DEFAULT.state_dir),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each component to answer.")] = DEFAULT.timeout_s,
) -> None:
    """Start every component, wait until each answers, and print where they are. Partly running (a component
    died): start what is missing, with the settings the stack was started with."""
    s = stack.StackSettings(
        postgres_port=_port(postgres_port, "--postgres-port"), mlflow_port=_port(mlflow_port, "--mlflow-port"),
        prefect_port=_port(prefect_port, "--prefect-port"), ray_port=_port(ray_port, "--ray-port"),
        dashboard_port=_port(dashboard_port, "--dashboard-port"), ray_cpus=ray_cpus, pool=pool, crash_after_s=crash_after,
        project_dir=str(project_dir.resolve()), state_dir=str(state_dir.resolve()), timeout_s=timeout,
    )  # fmt: skip
    try:
        s = stack.start(s, say=typer.echo)
    except stack.StackError as exc:
        fail(str(exc))
    typer.echo(f"Prefect UI:  {s.prefect_api.removesuffix('/api')}  (work pool {s.pool}, one worker)")
    typer.echo(f"MLflow UI:   {s.mlflow_url}  (PostgreSQL on {s.host}:{s.postgres_port})")
    typer.echo(f"Ray:         {s.ray_address}  (dashboard {s.dashboard_url}; the work runs on its worker node)")
    typer.echo(f"DVC remote:  {s.dvc_remote}  (default in .dvc/config.local)")
    typer.echo(f'this shell:  eval "$(dapo stack env --state-dir {state_dir})"; stop with `make stack-stop`')


def _settings(state_dir: Path) -> stack.StackSettings:
    return stack.saved_settings(str(state_dir)) or stack.StackSettings(state_dir=str(state_dir))


@stack_app.command("status")
def status(state_dir: StateDirOpt = Path(DEFAULT.state_dir)) -> None:
    """Which components run and whether they answer. Exit status 1 unless all do."""
    states = stack.status(_settings(state_dir))
    for name, state in states.items():
        typer.echo(f"{stack.LABELS[name]:<15} {state}")
    if not all(" answers " in v for v in states.values()):
        typer.echo("start it with `make stack` (dapo stack start)")
        raise typer.Exit(1)


@stack_app.command("env")
def env(state_dir: StateDirOpt = Path(DEFAULT.state_dir)) -> None:
    """`export` lines pointing a shell at the running stack: eval "$(dapo stack env)"."""
    s = stack.saved_settings(str(state_dir))
    if s is None:
        fail(f"no stack recorded in {state_dir}/: start it with `make stack` (dapo stack start)")
    for key, value in s.env().items():
        typer.echo(f"export {key}={value}")


@stack_app.command("stop")
def stop(state_dir: StateDirOpt = Path(DEFAULT.state_dir)) -> None:
    """Stop every process `dapo stack start` started (by their PID files); the data folders stay."""
    if not stack.stop(_settings(state_dir), say=typer.echo):
        typer.echo(f"nothing to stop (no running process recorded in {state_dir}/)")


def register(app: typer.Typer) -> None:
    """Add the ``stack`` command group to ``app``."""
    app.add_typer(stack_app, name="stack")
