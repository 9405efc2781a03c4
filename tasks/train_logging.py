"""MLflow side of the training flow: run tags, per-step metrics, validation logging, final artifacts."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig
from dapo_core.engines.executor import Executor
from dapo_core.faults import armed, fault_point
from dapo_core.training.plots import PANELS, plot_training_dynamics
from dapo_core.training.prompts import PromptItem
from tasks import progress, tracking, tracking_store
from tasks.data import dvc_recorded_md5

logger = logging.getLogger(__name__)

VAL_SEED_PARTS = ("val",)  # one validation seed for every step (not per step): like-for-like curve points


def file_digest(paths: Sequence[str | Path]) -> str:
    """sha256 over the bytes of the given files (the dataset digest tag)."""
    h = hashlib.sha256()
    for p in paths:
        path = Path(p)
        h.update(path.name.encode())
        if path.is_file():
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def val_fields(metrics: dict[str, float]) -> dict[str, float]:
    """``{"avg@8": 0.302}`` from ``val/<source>/acc/mean_at_8`` (the mean over sources when there are several):
    the validation accuracy a progress bar or a summary line shows."""
    by_k: dict[str, list[float]] = {}
    for key, value in metrics.items():
        if key.startswith("val/") and "/acc/mean_at_" in key:
            by_k.setdefault(key.rsplit("_", 1)[-1], []).append(value)
    return {f"avg@{k}": sum(v) / len(v) for k, v in sorted(by_k.items())}


def run_tags(cfg: DapoConfig, run_name: str) -> dict[str, str]:
    return {
        **tracking.git_tags(),
        "recipe": cfg.recipe,
        "seed": str(cfg.trainer.seed),
        "model.id": cfg.model.path,
        "data.dvc_md5": dvc_recorded_md5(),
        "data.train_digest": file_digest(cfg.data.train_files),
        "data.val_digest": file_digest(cfg.data.val_files),
        "run_name": run_name,
        "stage": "train",
    }


@task(name="log-metrics", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def log_step(metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
    """All metrics of one step in one batched call, at ``step = train/step``. With the "logging" fault point
    armed (reliability tests) they go in two halves with the fault point between: a kill leaves half a step."""
    if not armed("logging"):
        tracking.log_metrics(metrics, step=step, timestamp_ms=timestamp_ms)
        return
    keys = sorted(metrics)
    tracking.log_metrics({k: metrics[k] for k in keys[: len(keys) // 2]}, step=step, timestamp_ms=timestamp_ms)
    fault_point("logging", step)
    tracking.log_metrics({k: metrics[k] for k in keys[len(keys) // 2 :]}, step=step, timestamp_ms=timestamp_ms)


@dataclass
class HeldMetrics:
    """Each step logged exactly once across a kill and ``--resume``, without deleting anything from MLflow.

    With checkpoints on, a step's metrics are held (``hold``) until the checkpoint that covers the step is written;
    they travel in that checkpoint (``state``) and go to MLflow right after it (``flush``). A kill before the
    checkpoint loses only held points of steps that ``--resume`` trains again; a kill during the flush is made good
    by the resume, which flushes the checkpoint's points again (``restore`` + ``flush``): MLflow's SQL store (local
    or behind ``mlflow server``) adds nothing for a point it already holds with the same time, and the held points
    keep the time they were held at. Without checkpoints (``trainer.save_freq`` 0 and a run that never resumes
    mid-way) ``hold`` logs at once. The MLflow UI then shows the curves every ``save_freq`` steps; the progress bar
    and the Prefect log show every step as it ends."""

    enabled: bool
    pending: list[tuple[int, dict[str, float], int]] = field(default_factory=list)

    def hold(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        if self.enabled:
            self.pending.append((step, dict(metrics), now))
        else:
            log_step(metrics, step, now)

    def add(self, metrics: dict[str, float], step: int) -> None:
        """More points of ``step`` (held with it, or logged now when nothing of the step is held)."""
        if not self.add_held(metrics, step):
            log_step(metrics, step)

    def add_held(self, metrics: dict[str, float], step: int) -> bool:
        """More points of a held ``step`` (nothing is logged); False when that step is not held."""
        for held_step, held, _ in self.pending:
            if held_step == step:
                held.update(metrics)
                return True
        return False

    def state(self) -> list[list[Any]]:
        """The held points, JSON-ready (``[step, {key: value}, time_ms]`` each) for the checkpoint's metadata."""
        return [[step, metrics, ts] for step, metrics, ts in self.pending]

    def restore(self, state: Sequence[Sequence[Any]]) -> None:
        self.pending = [(int(step), {str(k): float(v) for k, v in m.items()}, int(ts)) for step, m, ts in state]

    def flush(self) -> int:
        """Log every held step (each with its held time), oldest first; returns how many steps went out."""
        done = 0
        while self.pending:
            step, metrics, ts = self.pending[0]
            log_step(metrics, step, ts)
            self.pending.pop(0)
            done += 1
        return done


@task(name="validate", cache_policy=NO_CACHE)
def validate(executor: Executor, items: Sequence[PromptItem], cfg: DapoConfig, *, step: int) -> dict[str, float]:
    """avg@k / pass@k / maj@k on the validation set with the current policy; sample completions as a table.

    Every step samples with the same seed, so the validation curve compares policies on the same noise."""
    from tasks.evaluate import evaluate_items  # the evaluation issue's runner

    t0 = time.perf_counter()
    metrics, rows = evaluate_items(executor, items, cfg, seed_parts=VAL_SEED_PARTS)
    metrics["timing_s/testing"] = time.perf_counter() - t0
    progress.note({f"val {k}": v for k, v in val_fields(metrics).items()})  # the RL bar, when a command shows one
    tracking.log_table(rows[: 8 * max(1, len({r.get("data_source") for r in rows}))], f"samples/step_{step:06d}.json")
    if step == 0:
        tracking.log_metrics(metrics, step=0)
    return metrics


def _histories(run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    keys = [k for k, _ in PANELS if k != "val"]
    keys += [k for k in MlflowClient().get_run(run_id).data.metrics if k.startswith("val/")]
    return {k: tracking_store.metric_history(run_id, k) for k in keys}


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run_artifacts(
    executor: Executor, cfg: DapoConfig, run_id: str, run_name: str, out_dir: Path
) -> dict[str, Any]:
    """Export the final policy (HF dir), register it, draw the training-dynamics plots, log the run's log file."""
    final_dir = executor.export_model(out_dir / "final")
    tracking.wait_for_delivery()  # the plots read the run back: a tracking outage must be over first
    model_uri = tracking.register_hf_model(final_dir, run_name, artifact_path="model")
    plot = plot_training_dynamics(_histories(run_id), out_dir / "training_dynamics.png", title=run_name)
    tracking.log_artifact(plot, "plots")
    log_file = out_dir / "train.log"
    if log_file.is_file():
        tracking.log_artifact(log_file, "logs")
    return {"final_model": str(final_dir), "registered_model": model_uri, "plot": str(plot)}
