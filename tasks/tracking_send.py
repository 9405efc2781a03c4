"""One tracking write, as the outbox (tasks/spool.py) stores it, performed against the MLflow store.

Items are plain JSON: ``{"kind": ..., "run_id": ...}`` plus the kind's fields (metrics as [key, value, timestamp,
step], params and tags as [key, value], artifacts as a local path). ``send`` returns what the write gives back
(the ``models:/<name>/<version>`` of a registration; None otherwise).
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient


def register(client: MlflowClient, rid: str, local_dir: str, artifact_path: str, name: str) -> str:
    """Log an HF model directory as the run's artifacts and make a version of registered model ``name``."""
    client.log_artifacts(rid, local_dir, artifact_path)
    try:
        client.create_registered_model(name)
    except mlflow.exceptions.MlflowException as e:
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    version = client.create_model_version(name, source=f"runs:/{rid}/{artifact_path}", run_id=rid)
    return f"models:/{name}/{version.version}"


def send(item: dict[str, Any]) -> Any:
    """Perform one outbox item's MLflow write."""
    client, rid, kind = MlflowClient(), item["run_id"], item["kind"]
    if kind == "metrics":
        metrics = [Metric(key=k, value=v, timestamp=t, step=s) for k, v, t, s in item["metrics"]]
        return client.log_batch(rid, metrics=metrics)
    if kind == "params":
        return client.log_batch(rid, params=[Param(k, v) for k, v in item["params"]])
    if kind == "tags":
        return client.log_batch(rid, tags=[RunTag(k, v) for k, v in item["tags"]])
    if kind == "text":
        return client.log_text(rid, item["text"], item["artifact_file"])
    if kind == "table":
        return client.log_table(rid, data=item["columns"], artifact_file=item["artifact_file"])
    if kind == "artifact":
        return client.log_artifact(rid, item["local"], item["artifact_path"])
    if kind == "artifacts":
        return client.log_artifacts(rid, item["local"], item["artifact_path"])
    if kind == "register":
        return register(client, rid, item["local"], item["artifact_path"], item["name"])
    if kind == "end":
        return client.set_terminated(rid, item["status"])
    raise ValueError(f"unknown tracking outbox item kind {kind!r}")
