"""`dapo ui start|stop|status`: the Prefect UI, the MLflow UI and `dapo serve` in the background (`make ui`).

dapo ui start                                       # Prefect http://127.0.0.1:4200, MLflow http://127.0.0.1:5000
dapo ui start --host 0.0.0.0 --prefect-port 4300    # reachable from other machines (no authentication!)
dapo ui status
dapo ui stop                                        # exactly the processes `dapo ui start` started

Logs and PID files: outputs/ui/ (``--state-dir``). The MLflow server shows the project's store (``--store``,
default ``$MLFLOW_TRACKING_URI`` when it names a database, else sqlite:///mlflow.db) with artifacts in
./mlartifacts; the Prefect server keeps its database in ``$PREFECT_HOME`` (default ./.prefect).

Other machines (``--host 0.0.0.0``): also export PREFECT_UI_API_URL=http://<this host>:4200/api (the address the
browser calls the API at) and DAPO_MLFLOW_UI_URL=http://<this host>:5000 (the MLflow links of the flow runs); the
MLflow server accepts Host headers of localhost and private addresses (mlflow server --allowed-hosts for others).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import fail
from flows.services import ui

ui_app = typer.Typer(
    help="The Prefect and MLflow UIs (and `dapo serve`) in the background: start, status, stop.",
    no_args_is_help=True,
)

StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="Where the logs, PID files and ui.json go.")
]  # fmt: skip


@ui_app.command("start")
def start(
    host: Annotated[str, typer.Option(help="Interface both servers bind to; 0.0.0.0 exposes them.")] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option("--prefect-port", help="Prefect server (UI + API) port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", help="MLflow server (UI) port.")] = 5000,
    store: Annotated[
        str | None,
        typer.Option(help="MLflow backend store URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)."),
    ] = None,
    artifacts: Annotated[Path, typer.Option(help="MLflow artifact folder of the store.")] = Path("mlartifacts"),
    prefect_home: Annotated[
        Path | None, typer.Option("--prefect-home", help="Prefect's home (database, profiles); default $PREFECT_HOME.")
    ] = None,
    state_dir: StateDirOpt = Path("outputs/ui"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each process to answer.")] = 240.0,
    serve: Annotated[bool, typer.Option("--serve/--no-serve", help="Also run `dapo serve` (the deployments).")] = True,
) -> None:
    """Start the Prefect server, the MLflow server and `dapo serve`; wait until they answer; print the URLs."""
    for port, opt in ((prefect_port, "--prefect-port"), (mlflow_port, "--mlflow-port")):
        if not 0 < port < 65536:
            fail(f"{opt} {port}: a TCP port is 1..65535")
    if prefect_port == mlflow_port:
        fail(f"--prefect-port and --mlflow-port are both {prefect_port}: give them different ports")
    home = prefect_home or Path(os.environ.get("PREFECT_HOME") or ".prefect")
    s = ui.UiSettings(
        host=host, prefect_port=prefect_port, mlflow_port=mlflow_port, prefect_home=str(home.resolve()),
        backend_store_uri=ui.absolute_store_uri(store or ui.default_store_uri()), artifacts=str(artifacts.resolve()),
        state_dir=str(state_dir), timeout_s=timeout,
    )  # fmt: skip
    if serve and not ui.serve_available():
        typer.echo("note: `dapo serve` is not part of this checkout yet: starting the two servers only")
    try:
        s = ui.start(s, serve=serve, say=typer.echo)
    except ui.UiError as exc:
        fail(str(exc))
    _print_urls(s)


def _print_urls(s: ui.UiSettings) -> None:
    typer.echo(f"Prefect UI: {s.prefect_url}  (deployments: {s.prefect_url}/deployments -> Run)")
    typer.echo(f"MLflow UI:  {s.mlflow_url}  (store {s.backend_store_uri})")
    typer.echo("            switch it to 'Model training' (top left) for the runs table and metric charts")
    typer.echo(f"logs: {s.state_dir}/{{prefect,mlflow,serve}}.log; stop with `make ui-stop` (dapo ui stop)")


def _settings(state_dir: Path) -> ui.UiSettings:
    return ui.saved_settings(str(state_dir)) or ui.UiSettings(state_dir=str(state_dir))


@ui_app.command("status")
def status(state_dir: StateDirOpt = Path("outputs/ui")) -> None:
    """Which of the three processes run, and whether the servers answer. Exit status 1 unless all run."""
    s = _settings(state_dir)
    states = ui.status(s)
    for name, state in states.items():
        typer.echo(f"{ui.LABELS[name]:<15} {state}")
    if not all(v.startswith("running") for v in states.values()):
        typer.echo("start with `make ui` (dapo ui start)")
        raise typer.Exit(1)


@ui_app.command("stop")
def stop(state_dir: StateDirOpt = Path("outputs/ui")) -> None:
    """Stop exactly the processes `dapo ui start` started (by their PID files) and remove the PID files."""
    if not ui.stop(_settings(state_dir), say=typer.echo):
        typer.echo(f"nothing to stop (no running process recorded in {state_dir}/)")


def register(app: typer.Typer) -> None:
    """Add the ``ui`` command group to ``app``."""
    app.add_typer(ui_app, name="ui")
