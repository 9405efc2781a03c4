"""`dapo serve`: every stage as a Prefect deployment, run when triggered from the UI (``register(app)`` wires it in).

export PREFECT_API_URL=http://127.0.0.1:4200/api      # a running Prefect server (`make ui` starts one)
dapo serve                                            # until Ctrl-C / SIGTERM; one run at a time
dapo serve --limit 2 --name-prefix lab-               # two at a time; deployments lab-curate, lab-train, ...
"""

from __future__ import annotations

import os
import re
from typing import Annotated

import typer

from flows.cli.common import fail

_NAME_PREFIX = re.compile(r"[A-Za-z0-9_.-]*")


def _banner(api_url: str, names: list[str], limit: int) -> list[str]:
    from prefect.settings import get_current_settings

    from tasks.tracking import MLFLOW_UI_ENV, mlflow_ui_url

    store = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db (the configs' tracking.uri default)"
    ui = get_current_settings().ui_url
    lines = [
        f"serving {len(names)} deployments on {api_url}, at most {limit} run(s) at a time (the others wait):",
        *(f"  {name}" for name in names),
    ]
    if ui:
        lines.append(f"Prefect UI: {ui.rstrip('/')}/deployments  (a deployment -> Run -> Custom run: the parameters)")
    lines += [
        f"runs work in {os.getcwd()}; MLflow store: {store}",
        f"each flow run links to its MLflow run at {mlflow_ui_url()} (set {MLFLOW_UI_ENV} if the MLflow UI is elsewhere)",
        "stop with Ctrl-C or SIGTERM (runs in progress are cancelled)",
    ]
    if limit > 1:
        lines.append(
            f"note: with --limit {limit}, runs share this directory's fixed outputs (outputs/curated, "
            "outputs/<run_name>, metrics/eval.json): give concurrent runs different run_name / output_dir values"
        )
    return lines


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app``."""

    @app.command("serve")
    def serve(
        limit: Annotated[
            int, typer.Option("--limit", min=1, help="Flow runs at once; more wait their turn (1: no shared outputs).")
        ] = 1,
        name_prefix: Annotated[
            str, typer.Option("--name-prefix", help="Prefix of the deployment names, e.g. lab- -> lab-train.")
        ] = "",
    ) -> None:
        """Serve curate, base-model, train, evaluate, pipeline and ablation as Prefect deployments (needs a server)."""
        if not _NAME_PREFIX.fullmatch(name_prefix):
            fail(f"--name-prefix {name_prefix!r}: use letters, digits, '-', '_' or '.', e.g. --name-prefix lab-")
        from flows.serve import ServeError, build_deployments, deployment_names, prefect_api_url, serve_deployments

        try:
            api_url = prefect_api_url()
        except ServeError as exc:
            fail(str(exc))
        deployments = build_deployments(name_prefix)
        for line in _banner(api_url, deployment_names(name_prefix), limit):
            typer.echo(line)
        serve_deployments(deployments, limit=limit)
