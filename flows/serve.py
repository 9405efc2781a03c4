"""Every stage as a Prefect deployment, started from the Prefect UI (or its REST API): ``dapo serve``.

    make ui                                              # a Prefect server, an MLflow server and `dapo serve`
    export PREFECT_API_URL=http://127.0.0.1:4200/api     # or by hand: a running Prefect server ...
    dapo serve                                           # ... then serve dapo-curate/curate, dapo-train/train, ...
    dapo serve --limit 2 --name-prefix lab-              # two runs at once; deployments lab-curate, lab-train, ...
    prefect deploy --all                                 # prefect.yaml: the same flows on your own work pool

Each deployment runs one flow of this module, built from the stage's parameters (``flows/stage_params.py``, the
same list `dapo <stage>` takes its options from): typed fields with help and defaults (the UI shows them as a form),
checked by the stage's ``prepare`` (``flows/stages.py``, as the CLI), then the body of the stage's flow
(``flows/curate.py`` ...) in the triggered flow run, so its tasks and subflows show under it. Config parameters
mean what the CLI options mean:
``config_path`` (``--config``, relative to the directory ``dapo serve`` runs in; default params.yaml) or ``recipe``
(``--recipe``), then ``overrides`` (``--set``, one ``dotted.key=value`` per item), then the named parameters
(``run_name``, ``lr``, ``clip_high``, ``dynamic_sampling`` ...), which are ``--set`` overrides of their config keys
applied last; empty ones keep the config's value.

Errors: a bad parameter (unknown ``--set`` key, unknown recipe, missing file, broken rule) fails the run before
any work: the run log shows ``error: <the CLI's message>`` and the FAILED state's message is that text. Other
exceptions fail the run with their traceback in the log.

Isolation: runs execute in the directory ``dapo serve`` runs in and write the same fixed paths as the CLI
(``outputs/curated``, ``outputs/<run_name>``, ``metrics/eval.json``, DVC's ``dvc.lock``). ``dapo serve`` therefore
runs one flow at a time by default (``--limit 1``): a second triggered run waits (state Late) and starts when the
first ends; each gets its own Prefect flow run and MLflow run, linked both ways (``tasks.tracking.link_flow_run``).
With ``--limit`` above 1, give concurrent runs different ``run_name`` / ``output_dir`` values.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed
from pydantic import Field

# Python loggers whose records also go to the flow run's log in the UI (not only Prefect's run logger).
EXTRA_LOGGERS = "dapo_core,tasks,flows"
TAGS = ["dapo"]


def _run_stage(stage: str, values: dict[str, Any]) -> Any:
    """Run ``stage`` in this flow run; an error the user can fix from its message fails the run with that message
    (no traceback)."""
    from flows import stages
    from flows.stage_params import STAGES, stage_values

    try:
        return stages.run(stage, stage_values(STAGES[stage], values), nested=True)
    except Exception as exc:
        if not isinstance(exc, stages.user_errors(stage)):
            raise
        get_run_logger().error("error: %s", exc)
        return Failed(message=str(exc))


def _deployment_flow(stage: str, attr: str) -> Any:
    """The Prefect flow of ``stage``'s deployment: one keyword parameter per ``Param`` of the stage (its type, its
    default and its help as a pydantic ``Field``: the UI's form), and a body that runs the stage."""
    from flows.stage_params import STAGES

    spec = STAGES[stage]

    def body(**values: Any) -> Any:
        return _run_stage(stage, values)

    form = [p for p in spec.params if p.form]
    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                p.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=p.type,
                default=Field(list(p.default) if isinstance(p.default, list) else p.default, description=p.help),
            )
            for p in form
        ]
    )
    body.__annotations__ = {p.name: p.type for p in form}
    body.__name__ = body.__qualname__ = attr  # the module attribute: MODULE_PATH entrypoints import it by name
    body.__module__ = __name__
    body.__doc__ = f"`dapo {stage}`: {spec.summary}"
    return flow(name=spec.flow_name, log_prints=False, validate_parameters=True)(body)


curate_deployment = _deployment_flow("curate", "curate_deployment")
base_model_deployment = _deployment_flow("base-model", "base_model_deployment")
train_deployment = _deployment_flow("train", "train_deployment")
evaluate_deployment = _deployment_flow("evaluate", "evaluate_deployment")
pipeline_deployment = _deployment_flow("pipeline", "pipeline_deployment")
ablation_deployment = _deployment_flow("ablation", "ablation_deployment")


# deployment name (without prefix) -> flow; the order `dapo serve` lists them in
DEPLOYMENTS: dict[str, Any] = {
    "curate": curate_deployment,
    "base-model": base_model_deployment,
    "train": train_deployment,
    "evaluate": evaluate_deployment,
    "pipeline": pipeline_deployment,
    "ablation": ablation_deployment,
}


class ServeError(RuntimeError):
    """`dapo serve` cannot start (no Prefect server to register on); the message says how to fix it."""


def prefect_api_url(timeout_s: float = 10.0) -> str:
    """The Prefect API the environment points to (PREFECT_API_URL or the active profile), checked to answer."""
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    start = "`make ui` starts one (or `prefect server start --host 127.0.0.1 --port 4200`)"
    if not url:
        raise ServeError(
            "PREFECT_API_URL is not set: `dapo serve` registers its deployments on a running Prefect server; "
            f"{start}, then export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise ServeError(
            f"no Prefect server answers at PREFECT_API_URL={url} ({exc}): {start}; or fix the URL"
        ) from exc
    return url


def build_deployments(name_prefix: str = "") -> list[Any]:
    """One ``RunnerDeployment`` per stage, named ``<name_prefix><stage>``, loaded by module path (any cwd)."""
    from prefect.deployments.runner import EntrypointType

    return [
        fl.to_deployment(name=f"{name_prefix}{stage}", tags=TAGS, entrypoint_type=EntrypointType.MODULE_PATH)
        for stage, fl in DEPLOYMENTS.items()
    ]


def deployment_names(name_prefix: str = "") -> list[str]:
    """``<flow name>/<deployment name>`` of every deployment, as the Prefect UI and CLI show them."""
    return [f"{fl.name}/{name_prefix}{stage}" for stage, fl in DEPLOYMENTS.items()]


def serve_deployments(deployments: Sequence[Any], *, limit: int = 1) -> None:
    """Serve ``deployments`` until SIGINT/SIGTERM (in-flight runs are cancelled); at most ``limit`` runs at once."""
    from prefect import serve

    # set before the runner starts: its flow-run processes inherit it, so library logs reach the UI too
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", EXTRA_LOGGERS)
    serve(*deployments, limit=limit, print_starting_message=False)
