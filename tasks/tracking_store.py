"""Reading the tracking store back, through MLflow's public client only: a metric's history, a run's tag, status and
existence. The flows use these to resume and report; everything they write goes through ``tasks.tracking`` (its
outbox). A resume edits nothing in the store: each step is logged once (``tasks.train_logging.HeldMetrics``).
"""

from __future__ import annotations

import mlflow
from mlflow.tracking import MlflowClient

from dapo_core.config import DapoConfig
from tasks.tracking import configure_mlflow


def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, ordered by step."""
    hist = MlflowClient().get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)


def run_tag(cfg: DapoConfig, run_id: str, key: str) -> str | None:
    """One tag of a run of the configured store (None when the run or the tag is missing)."""
    configure_mlflow(cfg)
    try:
        return MlflowClient().get_run(run_id).data.tags.get(key)
    except mlflow.exceptions.MlflowException:
        return None


def run_status(cfg: DapoConfig, run_id: str | None) -> str | None:
    """A run's status (``RUNNING``, ``FINISHED``, ``FAILED``, ``KILLED``); None when there is no such run."""
    if not run_id:
        return None
    configure_mlflow(cfg)
    try:
        return str(MlflowClient().get_run(run_id).info.status)
    except mlflow.exceptions.MlflowException:
        return None


def run_exists(cfg: DapoConfig, run_id: str | None) -> bool:
    """Whether ``run_id`` is a live (not deleted) run of the configured store."""
    if not run_id:
        return False
    configure_mlflow(cfg)
    try:
        return MlflowClient().get_run(run_id).info.lifecycle_stage == "active"
    except mlflow.exceptions.MlflowException:
        return False
