"""Prefect tasks of the base-model stage: exclusions, the cache stamp, the warm start, MLflow logging.

Thin wrappers: the work is ``dapo_core.warmstart.sft``. The stage is cached by a stamp file written into the
output directory after the model: a hash of everything that changes the weights (the tiny architecture, the
warm-start knobs and seed, the exclusion set's digest, the tokenizer alphabet). Same stamp -> the existing
directory is reused and its recorded metrics are reported again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import Param
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig
from dapo_core.config.serialize import flat_items
from dapo_core.data.schema import read_rl_files
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET
from dapo_core.warmstart.sft import (
    WarmStartConfig,
    WarmStartResult,
    normalize_question,
    run_warm_start,
)
from tasks import progress, tracking

logger = logging.getLogger(__name__)

STAMP_FILE = "base_model_stamp.json"  # written inside the output directory, after the model
STAMP_VERSION = 1  # bump when the warm start changes in a way the knobs do not capture


def _question_of(record: Any) -> str:
    """The bare problem of a curated record: ``raw_problem``, else the last user message."""
    if record.raw_problem:
        return normalize_question(record.raw_problem)
    users = [m["content"] for m in record.prompt if m.get("role") == "user"]
    return normalize_question(users[-1] if users else "")


@task(name="read-exclusions", cache_policy=NO_CACHE)
def read_exclusions(paths: Sequence[str]) -> list[str]:
    """Questions of the curated parquet files that exist (the warm start must never train on them)."""
    existing = [p for p in paths if Path(p).is_file()]
    for p in paths:
        if p not in existing:
            logger.warning("exclusion file %s does not exist (run `dapo curate` first?): not excluded", p)
    questions = sorted({_question_of(r) for r in read_rl_files(existing)}) if existing else []
    logger.info("excluding %d curated questions from the warm start (%d files)", len(questions), len(existing))
    return questions


def stage_stamp(cfg: DapoConfig, ws: WarmStartConfig, exclude_digest: str) -> dict[str, Any]:
    """Everything that determines the base model's weights and reported metrics, plus its sha256."""
    body = {
        "version": STAMP_VERSION,
        "model.tiny": cfg.model.tiny.model_dump(mode="json"),
        "model.dtype": cfg.model.dtype,
        "warm_start": ws.stamp(),
        "exclusion_digest": exclude_digest,
        "alphabet_sha256": hashlib.sha256(DEFAULT_ALPHABET.encode()).hexdigest(),
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {"digest": digest, "inputs": body}


@task(name="check-base-model-cache", cache_policy=NO_CACHE)
def cached_result(output_dir: str, stamp: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded result when ``output_dir`` holds a complete model with this stamp, else None."""
    path = Path(output_dir) / STAMP_FILE
    if not path.is_file() or not (Path(output_dir) / "config.json").is_file():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("unreadable stamp %s (%s): rebuilding the base model", path, e)
        return None
    if recorded.get("digest") != stamp["digest"]:
        logger.info(
            "base model at %s is stale (stamp %s != %s): rebuilding",
            output_dir,
            recorded.get("digest"),
            stamp["digest"],
        )
        return None
    return dict(recorded)


def warm_start_fields(metrics: dict[str, float]) -> dict[str, float]:
    """What the warm start's progress bar shows of a metrics callback: loss and token accuracy while training,
    the probe's greedy accuracy when checked, the held-out avg@k at the end."""
    names = {"sft/loss": "loss", "sft/token_acc": "token acc", "sft/probe_greedy_acc": "probe greedy"}
    fields = {label: metrics[key] for key, label in names.items() if key in metrics}
    for key, value in metrics.items():
        if key.startswith("heldout/acc/mean_at_"):
            fields[f"held-out avg@{key.rsplit('_', 1)[-1]}"] = value
    return fields


@task(name="warm-start", cache_policy=NO_CACHE)
def warm_start(
    cfg: DapoConfig,
    ws: WarmStartConfig,
    exclude: list[str],
    output_dir: str,
    stamp: dict[str, Any],
    run_id: str,
) -> dict[str, Any]:
    """Run the SFT warm start (metrics streamed to MLflow, a progress bar when a command shows one), save the
    model, then write the stamp."""
    with progress.bar("warm start", total=ws.steps, unit="step") as bar:

        def log(step: int, metrics: dict[str, float]) -> None:
            tracking.log_metrics(metrics, step, run_id=run_id)
            bar.update(step, warm_start_fields(metrics))

        result: WarmStartResult = run_warm_start(cfg, ws, exclude=exclude, output_dir=output_dir, on_metrics=log)
    record = {
        **stamp,
        "steps": result.steps,
        "wall_s": round(result.wall_s, 2),
        "stopped_by": result.stopped_by,
        "num_excluded": result.num_excluded,
        "metrics": result.final_metrics,
        "mlflow_run_id": run_id,
    }
    # The stamp goes in last: a crash before this line leaves no stamp, so the next run rebuilds.
    (Path(output_dir) / STAMP_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return record


def log_knobs(ws: WarmStartConfig, run_id: str) -> None:
    """The warm-start knobs as MLflow params ``warm_start.<name>`` (the proposed ``base_model:`` config section)."""
    params = [Param(f"warm_start.{k}", str(v)) for k, v in sorted(flat_items(ws))]
    MlflowClient().log_batch(run_id, params=params)


@task(name="log-base-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def log_base_model(record: dict[str, Any], output_dir: str, run_id: str, *, cached: bool) -> None:
    """Final metrics, the stamp and the model directory as MLflow artifacts of the stage's run."""
    if cached:
        tracking.log_metrics(record.get("metrics", {}), int(record.get("steps", 0)), run_id=run_id)
    tracking.set_tags(
        {
            "base_model.cached": str(cached).lower(),
            "base_model.stamp": record["digest"],
            "base_model.stopped_by": record.get("stopped_by", "unknown"),
            "base_model.built_by_run": record.get("mlflow_run_id", run_id),
        },
        run_id=run_id,
    )
    tracking.log_json(record, "base_model/stamp.json", run_id=run_id)
    tracking.log_artifacts(output_dir, "model", run_id=run_id)
