"""What each stage does with its parameters (``flows/stage_params.py``), shared by `dapo <stage>` and its deployment.

``prepare(stage, values)`` resolves the config and checks every parameter before any work, raising the stage's
user errors (``user_errors(stage)``: a message that says what, where and how to fix); it returns the keyword
arguments of the stage's flow. ``run(stage, values, nested=...)`` calls the flow with them: as a flow run of its
own (the CLI) or, ``nested=True``, as the body of the deployment's flow run (``flow.fn``), so the tasks and
subflows show under the run triggered from the UI.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from dapo_core.config import ConfigError, DapoConfig, load_config
from dapo_core.config.schema import resolved_run_name
from flows.stage_params import StageValues

ErrorTypes = tuple[type[BaseException], ...]


class StageInputError(ValueError):
    """A parameter or the config of a stage call is wrong; raised by ``prepare`` before any work."""


def load(v: StageValues) -> DapoConfig:
    """The resolved config of a call (file or recipe -> environment -> --set items -> knobs)."""
    return load_config(config_path=v.config_path, recipe=v.recipe, overrides=v.overrides)


def _config_kwargs(v: StageValues) -> dict[str, Any]:
    return {"config_path": v.config_path, "recipe": v.recipe, "overrides": list(v.overrides)}


# --- user errors: printed without a traceback by the CLI, a FAILED state with the message in a deployment ---
def _data_errors() -> ErrorTypes:
    from dapo_core.data.freshness import SourceChangedError
    from dapo_core.data.schema import SchemaError

    return (ConfigError, SchemaError, FileNotFoundError, SourceChangedError)


def train_errors() -> ErrorTypes:
    """What `dapo train`, `dapo pipeline` and `dapo ablation` report from the message alone."""
    from dapo_core.algorithm import DynamicSamplingExhausted
    from tasks.train import CheckpointWriteError

    faults = sys.modules.get("dapo_core.distributed.faults")  # only when Ray was loaded: importing it loads Ray
    ray = (faults.ActorFailureError,) if faults is not None else ()
    return (*_data_errors(), DynamicSamplingExhausted, CheckpointWriteError, *ray)


def user_errors(stage: str) -> ErrorTypes:
    """The exceptions of ``stage`` whose message alone tells the user what to fix."""
    extra: dict[str, Callable[[], ErrorTypes]] = {
        "curate": lambda: (*_data_errors(), ImportError),
        "base-model": lambda: (*_data_errors(), ValueError),
        "train": train_errors,
        "evaluate": lambda: (*_data_errors(), ValueError),
        "pipeline": train_errors,
        "ablation": train_errors,
    }
    return (StageInputError, *extra[stage]())


# --- prepare: parameters -> the flow's keyword arguments, every check before any work ---
def _prepare_curate(v: StageValues) -> dict[str, Any]:
    load(v)
    return {**_config_kwargs(v), **v.args}


def _prepare_base_model(v: StageValues) -> dict[str, Any]:
    from flows.base_model import warm_start_settings

    knobs = {k: v[k] for k in ("steps", "lr", "batch_size", "heldout_size", "heldout_k", "time_budget_s", "seed")}
    warm_start_settings(load(v), **knobs)  # an invalid knob fails here with its rule
    return {**_config_kwargs(v), **v.args}


def _prepare_train(v: StageValues) -> dict[str, Any]:
    load(v)
    return {**_config_kwargs(v), "resume": v["resume"], "force": v["force"]}


def _prepare_evaluate(v: StageValues) -> dict[str, Any]:
    load(v)
    k, ks = v["k"], v["ks"]
    if k is not None and k < 1:
        raise ValueError(f"k ({k}) must be >= 1 samples per problem, e.g. 32 (the paper's avg@32)")
    if ks is not None and (not ks or min(ks) < 1):
        raise ValueError(f"ks ({ks}) must list positive integers, e.g. 1,4,8,16,32")
    return {**_config_kwargs(v), **v.args}


def _prepare_pipeline(v: StageValues) -> dict[str, Any]:
    cfg = load(v)
    overrides = list(v.overrides)
    if not cfg.tracking.run_name:  # fix the timestamped default once, so the log path and the run agree
        overrides.append(f"tracking.run_name={resolved_run_name(cfg)}")
    return {"config_path": v.config_path, "recipe": v.recipe, "overrides": overrides, "dvc_commit": v["dvc_commit"]}


def _prepare_ablation(v: StageValues) -> dict[str, Any]:
    from dapo_core.config.ablation import build_ladder, build_regimes, curve_test_freq, parse_rungs
    from dapo_core.evaluation.ablation_report import report_stem
    from flows import ablation as A

    recipe = A.DEFAULT_RECIPE if v.config_path is None and v.recipe is None else v.recipe
    cfg = load_config(config_path=v.config_path, recipe=recipe, overrides=v.overrides)
    quick, steps, seeds, eval_k = v["quick"], v["steps"], v["seeds"], v["eval_k"]
    if quick:
        steps = A.QUICK_STEPS if steps is None else steps
        seeds = A.QUICK_SEEDS if seeds is None else seeds
        eval_k = cfg.rollout.val_n if eval_k is None else eval_k
    if seeds is not None and seeds < 1:
        raise ValueError(f"--seeds ({seeds}) must be >= 1 (seeds 1..N go to trainer.seed), e.g. --seeds 3")
    rungs = parse_rungs(v["rungs"]) if v["rungs"] else None
    report_stem(v["name"])
    build_ladder(cfg, rungs)  # the plan's own checks (a DAPO recipe, regime names, lrs, steps) before any work
    build_regimes(cfg, list(v["regimes"]), tuned_lr=v["tuned_lr"], aggressive_lr=v["aggressive_lr"])
    curve_test_freq(steps if steps is not None else cfg.trainer.total_steps)
    if eval_k is not None:
        A.check_eval_k(eval_k)
    return {
        "config_path": v.config_path, "recipe": recipe, "overrides": list(v.overrides), "regimes": list(v["regimes"]),
        "tuned_lr": v["tuned_lr"], "aggressive_lr": v["aggressive_lr"], "steps": steps,
        "seeds": seeds if seeds is not None else A.DEFAULT_SEEDS, "base": v["base"],
        "out_dir": v["out_dir"] or (A.QUICK_OUT_DIR if quick else A.DEFAULT_OUT_DIR), "rungs": rungs,
        "name": v["name"], "resume": v["resume"], "eval_k": eval_k,
    }  # fmt: skip


_PREPARE: dict[str, Callable[[StageValues], dict[str, Any]]] = {
    "curate": _prepare_curate,
    "base-model": _prepare_base_model,
    "train": _prepare_train,
    "evaluate": _prepare_evaluate,
    "pipeline": _prepare_pipeline,
    "ablation": _prepare_ablation,
}


def prepare(stage: str, v: StageValues) -> dict[str, Any]:
    """The keyword arguments of ``stage``'s flow for the values ``v``; ``StageInputError`` (the check's message) or
    ``FileNotFoundError`` before any work."""
    try:
        return _PREPARE[stage](v)
    except ValueError as exc:  # ConfigError, a knob's rule, a plan check
        raise StageInputError(str(exc)) from exc


def stage_flow(stage: str) -> Any:
    """The Prefect flow that does ``stage``'s work (imported here: Prefect loads only when a stage runs)."""
    if stage == "curate":
        from flows.curate import curate_flow as fl
    elif stage == "base-model":
        from flows.base_model import base_model_flow as fl
    elif stage == "train":
        from flows.train import train_flow as fl
    elif stage == "evaluate":
        from flows.evaluate import evaluate_flow as fl
    elif stage == "pipeline":
        from flows.pipeline import pipeline_flow as fl
    else:
        from flows.ablation import ablation_flow as fl
    return fl


def run(stage: str, v: StageValues, *, nested: bool = False) -> dict[str, Any]:
    """Prepare, then run ``stage``'s flow: its own flow run, or (``nested``) the body of the caller's flow run."""
    kwargs = prepare(stage, v)
    fl = stage_flow(stage)
    return (fl.fn if nested else fl)(**kwargs)
