"""Every stage as a Prefect deployment, started from the Prefect UI (or its REST API): ``dapo serve``.

    make ui                                              # a Prefect server, an MLflow server and `dapo serve`
    export PREFECT_API_URL=http://127.0.0.1:4200/api     # or by hand: a running Prefect server ...
    dapo serve                                           # ... then serve dapo-curate/curate, dapo-train/train, ...
    dapo serve --limit 2 --name-prefix lab-              # two runs at once; deployments lab-curate, lab-train, ...
    prefect deploy --all                                 # prefect.yaml: the same flows on your own work pool

Each deployment runs one flow of this module: typed parameters with descriptions and defaults (the UI shows them as
a form), checked the way the CLI checks them, then the body of the existing flow (``flows/curate.py`` ...) in the
triggered flow run, so its tasks and subflows show under it. Config parameters mean what the CLI options mean:
``config_path`` (``--config``, relative to the directory ``dapo serve`` runs in; default params.yaml) or ``recipe``
(``--recipe``), then ``overrides`` (``--set``, one ``dotted.key=value`` per item), then the named parameters
(``run_name``, ``model_path``, ``seed`` ...), which are ``--set`` overrides of their config keys applied last.

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

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed
from pydantic import Field

ErrorTypes = tuple[type[BaseException], ...]

# Python loggers whose records also go to the flow run's log in the UI (not only Prefect's run logger).
EXTRA_LOGGERS = "dapo_core,tasks,flows"
TAGS = ["dapo"]

# --- parameters shared by the deployments (the UI form's defaults and help) ---
CONFIG_PATH: Any = Field(
    None,
    description="YAML config file (--config), relative to the directory `dapo serve` runs in; empty: params.yaml "
    "(or the recipe below). Pass either this or a recipe.",
)
RECIPE: Any = Field(None, description="Recipe name from recipes/ (--recipe), e.g. tiny-dapo or tiny-grpo.")
OVERRIDES: Any = Field(
    [],
    description='--set overrides, one "dotted.key=value" per item (value parsed as YAML), applied in order, '
    'e.g. "trainer.total_steps=4". Unknown keys fail the run before any work.',
)
RUN_NAME: Any = Field(
    None, description="tracking.run_name: the MLflow run name and the output folder outputs/<run_name>/."
)
SEED: Any = Field(None, description="trainer.seed (every sample's seed derives from it); empty: the config's.")


def _with_keys(overrides: Sequence[str], values: Mapping[str, Any]) -> list[str]:
    """``overrides`` plus ``key=<JSON value>`` for each value that is set (JSON is YAML: quoted paths stay strings)."""
    return [*overrides, *(f"{key}={json.dumps(value)}" for key, value in values.items() if value is not None)]


def _run_stage(body: Callable[[], Any], user_errors: Callable[[], ErrorTypes]) -> Any:
    """Run ``body``; an error the user can fix from its message fails the run with that message (no traceback)."""
    try:
        return body()
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        get_run_logger().error("error: %s", exc)
        return Failed(message=str(exc))


def _config_errors() -> ErrorTypes:
    from dapo_core.config import ConfigError

    return (ConfigError, FileNotFoundError)


def _train_errors() -> ErrorTypes:
    """What `dapo train` / `dapo pipeline` print without a traceback (flows/cli_train.py's USER_ERRORS)."""
    from dapo_core.algorithm import DynamicSamplingExhausted
    from dapo_core.config import ConfigError
    from dapo_core.data.schema import SchemaError

    return (FileNotFoundError, ConfigError, SchemaError, DynamicSamplingExhausted)


def _load(config_path: str | None, recipe: str | None, overrides: Sequence[str]) -> Any:
    """The resolved config, so a bad one fails the run here, before any work (as the CLI does)."""
    from dapo_core.config import load_config

    return load_config(config_path=config_path, recipe=recipe, overrides=overrides)


@flow(name="dapo-curate", log_prints=False, validate_parameters=True)
def curate_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = RECIPE,
    overrides: list[str] = OVERRIDES,
    output_dir: str = Field("outputs/curated", description="Where train/val parquet and the data card go."),
    generate_missing: bool = Field(True, description="Create the seeded synthetic raw file when it is missing."),
) -> Any:
    """`dapo curate`: validate, de-duplicate and split the curation sources into parquet + a data card."""

    def body() -> dict[str, Any]:
        from flows.curate import curate_flow
        from tasks.data import resolve_curation

        resolve_curation(config_path, recipe, list(overrides))
        return curate_flow.fn(
            config_path, recipe, list(overrides), output_dir=output_dir, generate_missing=generate_missing
        )

    def errors() -> ErrorTypes:
        from dapo_core.data.schema import SchemaError

        return (*_config_errors(), SchemaError, ImportError)

    return _run_stage(body, errors)


@flow(name="dapo-base-model", log_prints=False, validate_parameters=True)
def base_model_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = RECIPE,
    overrides: list[str] = OVERRIDES,
    output_dir: str = Field("outputs/base_model", description="Where the HF model directory goes."),
    steps: int | None = Field(None, description="SFT optimizer steps; empty: base_model.steps."),
    seed: int | None = Field(None, description="Warm-start seed; empty: trainer.seed."),
    force: bool = Field(False, description="Rebuild even when the cached model's stamp matches."),
) -> Any:
    """`dapo base-model`: the cached SFT warm start of the tiny model (the CPU default's base model)."""

    def body() -> dict[str, Any]:
        from flows.base_model import base_model_flow, warm_start_settings

        warm_start_settings(_load(config_path, recipe, overrides), steps=steps, seed=seed)  # invalid knobs fail here
        return base_model_flow.fn(
            config_path=config_path, recipe=recipe, overrides=list(overrides), output_dir=output_dir,
            steps=steps, seed=seed, force=force,
        )  # fmt: skip

    return _run_stage(body, lambda: (ValueError, FileNotFoundError))


@flow(name="dapo-train", log_prints=False, validate_parameters=True)
def train_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = RECIPE,
    overrides: list[str] = OVERRIDES,
    run_name: str | None = RUN_NAME,
    model_path: str | None = Field(None, description="model.path: the policy to start from (a local HF dir)."),
    train_files: list[str] | None = Field(None, description="data.train_files: verl-schema parquet files."),
    val_files: list[str] | None = Field(None, description="data.val_files: held-out parquet files."),
    seed: int | None = SEED,
    resume: bool = Field(False, description="Continue the run named run_name from its last complete checkpoint."),
) -> Any:
    """`dapo train`: DAPO (or the recipe's GRPO baseline): rollout -> reward -> filter -> update, in MLflow."""
    keys = {
        "tracking.run_name": run_name,
        "model.path": model_path,
        "data.train_files": train_files,
        "data.val_files": val_files,
        "trainer.seed": seed,
    }
    all_overrides = _with_keys(overrides, keys)

    def body() -> dict[str, Any]:
        from flows.train import train_flow

        _load(config_path, recipe, all_overrides)
        return train_flow.fn(config_path=config_path, recipe=recipe, overrides=all_overrides, resume=resume)

    return _run_stage(body, _train_errors)


@flow(name="dapo-evaluate", log_prints=False, validate_parameters=True)
def evaluate_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = RECIPE,
    overrides: list[str] = OVERRIDES,
    model: str | None = Field(
        None, description="Local HF dir, runs:/ID/PATH, models:/NAME/VERSION or an HF id; empty: model.path."
    ),
    data: list[str] | None = Field(None, description="verl-schema parquet files; empty: data.val_files."),
    k: int | None = Field(None, description="Samples per problem; empty: rollout.val_n (paper: 32)."),
    seed: int | None = Field(None, description="Sampling seed; empty: derived from trainer.seed."),
    run_name: str | None = Field(None, description="MLflow run name; empty: eval-<model>."),
    metrics_path: str = Field("metrics/eval.json", description="Metrics JSON for DVC."),
) -> Any:
    """`dapo evaluate`: avg@k, pass@k, maj@k and reflection rate of a model, in MLflow and metrics/eval.json."""

    def body() -> dict[str, Any]:
        from flows.evaluate import evaluate_flow

        _load(config_path, recipe, overrides)
        if k is not None and k < 1:
            raise ValueError(f"k ({k}) must be >= 1 samples per problem, e.g. 32 (the paper's avg@32)")
        return evaluate_flow.fn(
            config_path=config_path, recipe=recipe, overrides=list(overrides), model=model, data=data, k=k,
            seed=seed, metrics_path=metrics_path, run_name=run_name,
        )  # fmt: skip

    def errors() -> ErrorTypes:
        from dapo_core.data.schema import SchemaError

        return (FileNotFoundError, SchemaError, ValueError)

    return _run_stage(body, errors)


@flow(name="dapo-pipeline", log_prints=False, validate_parameters=True)
def pipeline_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = RECIPE,
    overrides: list[str] = OVERRIDES,
    run_name: str | None = RUN_NAME,
    seed: int | None = SEED,
    dvc_commit: bool = Field(True, description="Record the stage outputs in dvc.lock at the end (as make run)."),
) -> Any:
    """`dapo pipeline`: curate -> base model -> train (DAPO) -> evaluate, one parent MLflow run."""
    all_overrides = _with_keys(overrides, {"tracking.run_name": run_name, "trainer.seed": seed})

    def body() -> dict[str, Any]:
        from flows.pipeline import pipeline_flow

        _load(config_path, recipe, all_overrides)
        return pipeline_flow.fn(config_path=config_path, recipe=recipe, overrides=all_overrides, dvc_commit=dvc_commit)

    return _run_stage(body, _train_errors)


@flow(name="dapo-ablation", log_prints=False, validate_parameters=True)
def ablation_deployment(
    config_path: str | None = CONFIG_PATH,
    recipe: str | None = Field(
        None, description="Recipe name (--recipe); empty (and no config file): tiny-dapo-table1."
    ),
    overrides: list[str] = OVERRIDES,
    regimes: list[str] = Field(["tuned", "aggressive"], description="tuned (the recipe's lr), aggressive (4x)."),
    tuned_lr: float | None = Field(None, description="lr of the tuned regime; empty: the recipe's trainer.lr."),
    aggressive_lr: float | None = Field(None, description="lr of the aggressive regime; empty: 4x the recipe's."),
    steps: int | None = Field(None, description="Gradient steps per run; empty: trainer.total_steps (quick: 2)."),
    seeds: int | None = Field(None, description="Seeds 1..N per rung; empty: 3 (quick: 1)."),
    base: str | None = Field(None, description="Base model dir; empty: curate + warm start (reused if current)."),
    out_dir: str | None = Field(
        None, description="Report dir; empty: benchmarks/results (quick: outputs/ablation-quick)."
    ),
    quick: bool = Field(False, description="A smoke run: one seed, 2 steps, both regimes."),
    rungs: list[str] | None = Field(
        None,
        description="Rungs to run; empty: the Table-1 ladder and sft-control. Also gspo, cispo, gmpo, dr-grpo "
        "(DAPO's successors); sft-control needs dapo.",
    ),
    name: str = Field("ablation", description="Report file stem: <out_dir>/<name>.json/.md/.png."),
    resume: bool = Field(
        False, description="Reuse the finished runs journaled in <out_dir>/<name>.journal.jsonl (after a kill)."
    ),
    eval_k: int | None = Field(
        None,
        description="Samples per held-out problem of each final score; empty: 32, Table 1's avg@32 (quick: "
        "rollout.val_n). Journaled runs scored at another k are scored again, not trained again.",
    ),
) -> Any:
    """`dapo ablation`: Table 1 in miniature (GRPO -> + each DAPO technique -> DAPO) vs a supervised control."""

    def body() -> dict[str, Any]:
        from dapo_core.config.ablation import build_ladder, build_regimes, curve_test_freq, parse_rungs
        from dapo_core.evaluation.ablation_report import report_stem
        from flows import ablation as A

        recipe_name = A.DEFAULT_RECIPE if config_path is None and recipe is None else recipe
        cfg = _load(config_path, recipe_name, overrides)
        n_steps = steps if steps is not None else (A.QUICK_STEPS if quick else None)
        n_seeds = seeds if seeds is not None else (A.QUICK_SEEDS if quick else A.DEFAULT_SEEDS)
        rung_names = parse_rungs(rungs) if rungs else None
        report_stem(name)
        build_ladder(cfg, rung_names)  # the plan's own checks, before any work (as `dapo ablation`)
        build_regimes(cfg, list(regimes), tuned_lr=tuned_lr, aggressive_lr=aggressive_lr)
        curve_test_freq(n_steps if n_steps is not None else cfg.trainer.total_steps)
        k = eval_k if eval_k is not None else (cfg.rollout.val_n if quick else None)
        if k is not None:
            A.check_eval_k(k)
        return A.ablation_flow.fn(
            config_path=config_path, recipe=recipe_name, overrides=list(overrides), regimes=list(regimes),
            tuned_lr=tuned_lr, aggressive_lr=aggressive_lr, steps=n_steps, seeds=n_seeds, base=base,
            out_dir=out_dir or (A.QUICK_OUT_DIR if quick else A.DEFAULT_OUT_DIR), rungs=rung_names, name=name,
            resume=resume, eval_k=k,
        )  # fmt: skip

    return _run_stage(body, lambda: (*_train_errors(), ValueError))


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
