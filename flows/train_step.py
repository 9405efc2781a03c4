"""One DAPO step of the training flow (Algorithm 1, lines 3-10): sample -> score -> filter, until the batch is full
(dynamic sampling), then update; and ``RunState``, what the step loop carries from step to step.

``flows/train.py`` runs the loop (resume, validation, checkpoints, MLflow); this module is the step itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prefect import get_run_logger
from prefect.utilities.annotations import quote

from dapo_core.algorithm import GroupAccumulator
from dapo_core.algorithm import metric_names as mn
from dapo_core.config import DapoConfig, flatten_config
from dapo_core.engines.checkpoint import WRITE_S
from dapo_core.faults import fault_point
from dapo_core.seeding import derive_seed
from dapo_core.training.health import HealthMonitor
from dapo_core.training.overlap import RolloutPrefetcher
from dapo_core.training.prompts import PromptSampler
from dapo_core.training.step import zero_variance_flags
from tasks import train as T
from tasks.train_logging import HeldMetrics

# quote(): Prefect walks every task argument looking for futures; for a batch of a few hundred responses that walk
# took ~0.3 s per task call (a tenth of a tiny step), so the large arguments go in unexamined


@dataclass
class RunState:
    """What the step loop carries from step to step; ``checkpoint_meta`` is what a checkpoint saves of it."""

    cfg: DapoConfig
    executor: Any
    train_items: Sequence[Any]
    val_items: Sequence[Any]
    sampler: PromptSampler
    health: HealthMonitor
    prefetcher: RolloutPrefetcher | None  # rollout.mode=one_step_off: batches generated a step ahead
    held: HeldMetrics  # each step's metrics, held until the checkpoint covering the step is written
    run_name: str
    ckpt_root: Path
    run_id: str | None = None  # the MLflow run
    gen_batches_total: int = 0  # generation batches since step 1 (dynamic sampling's cost)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "config": {k: str(v) for k, v in flatten_config(self.cfg).items()},  # what --resume compares
            "mlflow_run_id": self.run_id,
            "gen_batches_total": self.gen_batches_total,
            "sampler": self.sampler.state_dict(),
            "health": self.health.state_dict(),
            "prefetched": self.prefetcher.state_dict() if self.prefetcher is not None else [],
            "run_name": self.run_name,
            "held_metrics": self.held.state(),
        }

    def restore(self, meta: dict[str, Any]) -> int:
        """Take up a checkpoint's state (the weights are loaded by the executor); returns its step."""
        self.gen_batches_total = int(meta.get("gen_batches_total", 0))
        self.sampler.load_state_dict(meta["sampler"])
        self.health.load_state_dict(meta.get("health", {}))
        if self.prefetcher is not None:  # what the interrupted run had generated ahead, with the older weights
            self.prefetcher.load_state_dict(meta.get("prefetched", []))
        self.run_id = meta.get("mlflow_run_id")
        self.held.restore(meta.get("held_metrics", []))
        step = int(meta["step"])
        if WRITE_S in meta:  # its own save time, measured after its held metrics were taken: the same value the
            # interrupted run logged (flows/train.py), or would have, had it not been killed first
            self.held.add_held({"timing_s/save_checkpoint": float(meta[WRITE_S])}, step)
        return step


@dataclass
class StepTally:
    """The counts and timings of one step's generation batches: its ``train/*`` and ``timing_s/*`` metrics."""

    correct: int = 0
    total: int = 0
    zero_var: int = 0
    groups_seen: int = 0
    gen_batches: int = 0
    failed: int = 0
    timings: dict[str, float] = field(default_factory=lambda: {"gen": 0.0, "reward": 0.0, "filter": 0.0})

    def add(self, batch: Any) -> None:
        self.gen_batches += 1
        self.failed += batch.num_failed_rewards
        self.correct += sum(sum(g.acc) for g in batch.groups)
        self.total += sum(len(g.acc) for g in batch.groups)
        self.zero_var += sum(zero_variance_flags(batch))
        self.groups_seen += len(batch.groups)


def _accumulator(cfg: DapoConfig) -> GroupAccumulator:
    """Dynamic sampling's batch (Eq. 11): groups with 0 < #correct < G until ``train_batch_size`` of them."""
    ds = cfg.algorithm.dynamic_sampling
    return GroupAccumulator(
        target_num_groups=cfg.data.train_batch_size,
        max_num_gen_batches=ds.max_num_gen_batches if ds.enable else 1,
        on_exhausted=ds.on_exhausted if ds.enable else "continue",
    )


def _sample(run: RunState, step: int, gen_idx: int) -> tuple[list[Any], Any, int]:
    """One generation batch: the prompts, the responses and the weight version that generated them (the first
    batch of a step comes from the prefetcher when it runs ahead)."""
    ahead = T.take_prefetched(run.prefetcher, step) if run.prefetcher is not None and gen_idx == 0 else None
    if ahead is not None:
        return ahead.items, ahead.results, ahead.version
    cfg = run.cfg
    items = [run.train_items[i] for i in run.sampler.next_indices(cfg.data.gen_batch_size)]
    version = run.executor.weight_version
    seed = derive_seed(cfg.trainer.seed, "train", step, gen_idx)
    return items, T.rollout(run.executor, quote(items), quote(cfg), seed), version


def _update(run: RunState, groups: list[Any], tally: StepTally, step: int) -> dict[str, float]:
    """The policy update on the kept groups and the weight sync to the rollout engines (none when nothing was
    kept: no group has signal, so there is no gradient to follow)."""
    executor = run.executor
    if not groups:
        get_run_logger().warning(
            "step %d: dynamic sampling kept no group in %d generation batches: skipping the update",
            step, tally.gen_batches,
        )  # fmt: skip
        return {"perf/batch_tokens": 0.0}
    metrics, t_update = T.update_policy(executor, quote(groups), quote(run.cfg))
    t0 = time.perf_counter()
    T.sync_weights(executor)
    tally.timings["sync_weights"] = time.perf_counter() - t0
    if executor.last_sync is not None:
        metrics[mn.PERF_SYNC_BYTES] = float(executor.last_sync.bytes)
        metrics[mn.TIMING_WEIGHT_SYNC] = executor.last_sync.seconds
    tally.timings.update(t_update)
    return metrics


def _step_metrics(
    run: RunState, step: int, tally: StepTally, acc: GroupAccumulator, kept: int, t_step: float, cpu_step: float
) -> dict[str, float]:
    """The step's bookkeeping metrics (``train/*``, ``reward/num_failed``, ``perf/*`` and ``timing_s/*``)."""
    step_time = time.perf_counter() - t_step
    tally.timings["step"] = step_time
    return {
        **{f"timing_s/{k}": v for k, v in tally.timings.items()},
        "train/step": float(step),
        "train/gen_batches_total": float(run.gen_batches_total),
        "train/num_gen_batches": float(tally.gen_batches),
        "train/acc/mean": tally.correct / max(tally.total, 1),
        "train/kept_groups_frac": acc.kept_groups_frac,
        "train/zero_std_groups_frac": tally.zero_var / max(tally.groups_seen, 1),
        "train/num_groups": float(kept),
        "train/update_skipped": float(not kept),
        "reward/num_failed": float(tally.failed),
        "perf/time_per_step": step_time,
        # this process's CPU seconds (all its threads): the step's compute with the local executor, less sensitive
        # than wall time to other jobs on the machine (the ablation's control budget)
        "perf/cpu_time_per_step": time.process_time() - cpu_step,
        "perf/cpu_memory_used_gb": psutil.Process().memory_info().rss / 2**30,
    }


def train_step(run: RunState, step: int) -> dict[str, float]:
    """One rollout step: sample -> score -> filter until the batch is full (dynamic sampling), then update.

    With a prefetcher (rollout.mode=one_step_off) the first batch comes from its queue (generated ahead with older
    weights), and the next steps' first batches are submitted before the update, to generate while it runs."""
    t_step, cpu_step = time.perf_counter(), time.process_time()
    acc, tally = _accumulator(run.cfg), StepTally()
    while acc.need_more():
        t0 = time.perf_counter()
        items, results, version = _sample(run, step, tally.gen_batches)
        fault_point("rollout", step)  # samples generated, not yet scored
        t1 = time.perf_counter()
        batch, flags, parts = T.score_and_filter(run.executor, quote(items), quote(results), quote(run.cfg), version)
        tally.timings["gen"] += t1 - t0
        tally.timings["reward"] += time.perf_counter() - t1 - parts["filter"]  # the task run's own cost included
        tally.timings["filter"] += parts["filter"]
        acc.add(batch.groups, flags)
        tally.add(batch)
    groups = acc.take()
    if run.prefetcher is not None:  # the next steps' first batches generate during this update (on Ray)
        t0 = time.perf_counter()
        T.prefetch(run.prefetcher, step)
        tally.timings["prefetch_submit"] = time.perf_counter() - t0
    metrics = _update(run, groups, tally, step)
    run.gen_batches_total += tally.gen_batches
    metrics.update(_step_metrics(run, step, tally, acc, len(groups), t_step, cpu_step))
    metrics["perf/total_num_tokens"] = metrics.pop("perf/batch_tokens")
    metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / metrics["perf/time_per_step"]
    return metrics
