"""tasks.tracking against a real MLflow SQLite store in a temp dir."""

from __future__ import annotations

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from dapo_core.config import load_config
from tasks import tracking, tracking_store


@pytest.fixture
def cfg(tmp_path):
    return load_config(
        recipe="tiny-dapo",
        overrides=[
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/artifacts",
            "tracking.log_system_metrics=false",
        ],
        env={},
    )


def test_run_params_metrics_tags_tables(cfg, tmp_path):
    with tracking.start_run(cfg, run_name="t1", tags={"recipe": cfg.recipe}) as run:
        flat = tracking.log_params_flat(cfg)
        tracking.log_metrics({"actor/pg_loss": 0.5, "bad": float("nan")}, step=1)
        tracking.log_metrics({"actor/pg_loss": 0.25}, step=2)
        tracking.set_tags(tracking.git_tags())
        tracking.log_table([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}], "samples/table.json")
        tracking.log_json({"k": 1}, "card.json")
        rid = run.info.run_id
    client = MlflowClient()
    data = client.get_run(rid).data
    assert data.params["trainer.lr"] == flat["trainer.lr"]
    assert data.tags["recipe"] == "tiny-dapo" and "git.sha" in data.tags
    assert tracking_store.metric_history(rid, "actor/pg_loss") == [(1, 0.5), (2, 0.25)]
    assert "bad" not in data.metrics
    assert client.get_run(rid).info.status == "FINISHED"
    assert (tmp_path / "artifacts").is_dir()
    assert sorted(a.path for a in client.list_artifacts(rid)) == ["card.json", "samples"]


def test_resume_same_run_and_failed_status(cfg):
    with tracking.start_run(cfg, run_name="r") as run:
        tracking.log_params_flat(cfg)
        rid = run.info.run_id
    with tracking.start_run(cfg, run_id=rid):
        tracking.log_params_flat(cfg)  # idempotent on resume
    with pytest.raises(RuntimeError), tracking.start_run(cfg, run_name="boom"):
        fail_id = mlflow.active_run().info.run_id
        raise RuntimeError("x")
    assert MlflowClient().get_run(fail_id).info.status == "FAILED"


def test_no_active_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no active MLflow run"):
        tracking.log_metrics({"a": 1.0}, step=0)


def test_validation_metrics_of_any_data_source_name_reach_mlflow(cfg):
    """Data source names come from the data (any text): their validation keys are accepted by a real store."""
    from dapo_core.algorithm.metric_names import val_metric
    from dapo_core.evaluation.runner import val_key

    sources = ["math_dapo", "aime@24", "lighteval/MATH", "../x", " ", "数学 (hard)!", "a" * 400]
    metrics = {val_metric(s, "mean", 8): i / 10 for i, s in enumerate(sources)}
    metrics.update({val_key(s, "response_length"): float(i) for i, s in enumerate(sources)})
    with tracking.start_run(cfg, run_name="sources") as run:
        tracking.log_metrics(metrics, step=3)
        rid = run.info.run_id
    logged = MlflowClient().get_run(rid).data.metrics
    assert logged == metrics and len(logged) == 2 * len(sources)
