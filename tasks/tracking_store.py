"""Reading the tracking store back, and the one edit a resume needs: a metric's history, a run's tag, status and
existence, and removing a killed run's metric points past its last checkpoint. The flows use these to resume and
report; everything they write goes through ``tasks.tracking`` (its outbox).
"""

from __future__ import annotations

import logging

import mlflow
from mlflow.tracking import MlflowClient

from dapo_core.config import DapoConfig
from tasks.tracking import configure_mlflow

logger = logging.getLogger(__name__)


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


def truncate_metrics_after(run_id: str, step: int) -> int:
    """Delete metric points with ``step`` > ``step`` from a run (exact resume: the killed run's points after its
    last checkpoint must not appear twice). Works on SQL stores (sqlite, postgres, mysql); on other stores it
    logs a warning and returns -1. Returns the number of points removed."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service.utils import _get_store

    store = _get_store()
    if not isinstance(store, SqlAlchemyStore):
        logger.warning(
            "tracking store %s is not SQL: metric points after step %d of run %s cannot be removed and may appear "
            "twice after this resume",
            type(store).__name__,
            step,
            run_id,
        )
        return -1
    with store.ManagedSessionMaker(read_only=False) as session:
        removed = (
            session.query(SqlMetric)
            .filter(SqlMetric.run_uuid == run_id, SqlMetric.step > step)
            .delete(synchronize_session=False)
        )
        stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.step > step)
        keys = [row.key for row in stale]
        stale.delete(synchronize_session=False)
        for key in keys:  # the latest value is now the newest remaining point of that key
            newest = (
                session.query(SqlMetric)
                .filter(SqlMetric.run_uuid == run_id, SqlMetric.key == key)
                .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc())
                .first()
            )
            if newest is not None:
                session.add(
                    SqlLatestMetric(
                        run_uuid=run_id,
                        key=key,
                        value=newest.value,
                        timestamp=newest.timestamp,
                        step=newest.step,
                        is_nan=newest.is_nan,
                    )
                )
    return int(removed)
