"""Prefect tasks of the training flow: thin wrappers, one per phase of Algorithm 1 (so the UI shows each).

Stateful tasks run without caching; only idempotent I/O retries. Executors stay resident across steps and are
passed in-process; no tensors travel through task results (groups hold token-id lists and floats).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig
from dapo_core.data.schema import SchemaError, read_rl_files
from dapo_core.engines.executor import Executor, LocalExecutor, sampling_from
from dapo_core.engines.rollout import RolloutResult
from dapo_core.training.overlap import RolloutPrefetcher, Taken, staleness_metrics
from dapo_core.training.prompts import PromptItem, encode_prompts
from dapo_core.training.step import (
    GenBatch,
    Group,
    batch_metrics,
    build_train_batch,
    entropy_and_prob,
    keep_flags,
    rollout_correction,
    sampler_log_probs,
    score_results,
    use_behaviour_log_probs,
)
from tasks import progress
from tasks.train_logging import val_fields

logger = logging.getLogger(__name__)


def make_executor(cfg: DapoConfig) -> Executor:
    """The configured executor: in-process (``local``) or on a Ray cluster (``ray``)."""
    if cfg.resources.executor == "ray":
        from dapo_core.distributed import RayExecutor  # imported lazily: Ray only when asked for

        return RayExecutor(cfg)
    return LocalExecutor(cfg)


def step_progress(bar: progress.Bar) -> Callable[[int, int, dict[str, float]], None]:
    """A ``flows.train.PROGRESS_HOOKS`` hook moving ``bar`` to each finished RL step, with the step's train
    accuracy (sampled rollouts) and, on validation steps, the validation avg@k (the bar keeps the latest)."""

    def hook(step: int, total: int, metrics: dict[str, float]) -> None:
        acc = {"train acc": metrics["train/acc/mean"]} if "train/acc/mean" in metrics else {}
        bar.update(step, {**acc, **{f"val {k}": v for k, v in val_fields(metrics).items()}}, first=True)

    return hook


@task(name="setup-executor", cache_policy=NO_CACHE)
def setup_executor(cfg: DapoConfig) -> Executor:
    return make_executor(cfg)


@task(name="load-prompts", cache_policy=NO_CACHE, retries=1)
def load_prompts(files: Sequence[str], tokenizer: Any, max_prompt_length: int, key: str) -> list[PromptItem]:
    """Read verl-schema parquet files (``key`` names the config key, for the error message) and tokenize."""
    try:
        records = read_rl_files(list(files))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{key}: {e}") from e
    except SchemaError as e:
        raise SchemaError(f"{key}: {e}") from e
    if not records:
        raise SchemaError(
            f"{key}: {', '.join(map(str, files)) or '(no files)'} hold no rows. If curation kept none, look at its "
            "card (outputs/curated/card.md: what each filter dropped) and loosen curation.* or add sources"
        )
    return encode_prompts(records, tokenizer, max_prompt_length=max_prompt_length)


@task(name="rollout", cache_policy=NO_CACHE)
def rollout(executor: Executor, items: Sequence[PromptItem], cfg: DapoConfig, seed: int) -> list[RolloutResult]:
    """Algorithm 1, line 4: sample G responses per prompt with the current (synced) policy."""
    return executor.generate([list(it.prompt_ids) for it in items], sampling_from(cfg, seed=seed, log_probs=True))


@task(name="take-prefetched", cache_policy=NO_CACHE)
def take_prefetched(prefetcher: RolloutPrefetcher, step: int) -> Taken | None:
    """rollout.mode=one_step_off: the step's first generation batch, generated ahead with older weights."""
    return prefetcher.take(step)


@task(name="prefetch-rollout", cache_policy=NO_CACHE)
def prefetch(prefetcher: RolloutPrefetcher, step: int) -> int:
    """rollout.mode=one_step_off: submit the next steps' first batches before this step's update (they generate
    while it runs, on Ray); returns how many were submitted."""
    return prefetcher.fill(step)


@task(name="score-and-filter", cache_policy=NO_CACHE)
def score_and_filter(
    executor: Executor,
    items: Sequence[PromptItem],
    results: Sequence[RolloutResult],
    cfg: DapoConfig,
    version: int | None = None,
) -> tuple[GenBatch, list[bool], dict[str, float]]:
    """Line 5: rule-based reward (+1/-1) plus the soft overlong penalty (Eq. 13) when enabled; line 6: dynamic
    sampling keeps the groups whose raw accuracy varies. ``version``: the weights that sampled ``results``
    (default: the current ones). One task run for both: each task run costs Prefect's API server ~30 ms of CPU,
    more than the filter itself. Returns (batch, keep flags, seconds of each part)."""
    t0 = time.perf_counter()
    batch = score_results(executor, items, results, cfg, version=version)
    t1 = time.perf_counter()
    flags = keep_flags(batch, cfg)
    return batch, flags, {"reward": t1 - t0, "filter": time.perf_counter() - t1}


@task(name="update-policy", cache_policy=NO_CACHE)
def update_policy(
    executor: Executor, groups: Sequence[Group], cfg: DapoConfig
) -> tuple[dict[str, float], dict[str, float]]:
    """Lines 9-12: advantages, pi_old log-probs on the kept batch (a trainer forward, or the sampler's own with
    ``algorithm.old_log_probs: rollout``), ppo_epochs x mini-batch updates.

    Returns (metrics, timings)."""
    t0 = time.perf_counter()
    batch, stats = build_train_batch(groups, cfg, pad_token_id=executor.tokenizer.pad_token_id)
    metrics = batch_metrics(stats, batch)
    t1 = time.perf_counter()
    recompute = cfg.algorithm.old_log_probs == "recompute"
    if recompute:
        old_log_probs, entropy = executor.compute_log_probs(batch, with_entropy=True)
        batch.old_log_probs = old_log_probs
        metrics.update(entropy_and_prob(old_log_probs, entropy, batch.response_mask))
        metrics.update(rollout_correction(batch, cfg))  # mismatch/*; TIS weights when enabled
        use_behaviour_log_probs(batch, cfg)  # one_step_off: the ratio's pi_old is the sampler's (behaviour) policy
    else:  # old_log_probs=rollout: the sampler's log-probs are pi_old, no forward (entropy: from the updates)
        batch.old_log_probs = sampler_log_probs(batch)
        metrics.update(entropy_and_prob(batch.old_log_probs, None, batch.response_mask))
    metrics.update(staleness_metrics([g.version for g in groups], executor.weight_version))
    t2 = time.perf_counter()
    actor = executor.update(batch)
    t3 = time.perf_counter()
    for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ppo_kl", "grad_norm", "lr"):
        metrics[f"actor/{k}"] = actor[k]
    if not recompute:  # the policy's entropy over the updates' forwards (the first mini-batch's: pi_old's)
        metrics["actor/entropy"] = actor["entropy"]
    metrics["actor/pg_clipfrac_last"] = actor["pg_clipfrac_last"]
    metrics["actor/num_updates"] = actor["num_updates"]
    tokens = int(batch.attention_mask.sum())
    metrics["perf/batch_tokens"] = float(tokens)
    timings = {"adv": t1 - t0, "old_log_prob": t2 - t1, "update_actor": t3 - t2}
    return metrics, timings


@task(name="sync-weights", cache_policy=NO_CACHE)
def sync_weights(executor: Executor) -> int:
    """Line 13 / DESIGN step 6: push the new weights to the rollout engines; returns the version."""
    return executor.sync_weights()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, permissions...); the previous ones are intact."""


@task(name="save-checkpoint", cache_policy=NO_CACHE)
def save_checkpoint(executor: Executor, root: Path, step: int, meta: dict[str, Any]) -> Path:
    try:
        return executor.save_checkpoint(root, step, meta)
    except OSError as exc:
        from dapo_core.engines.checkpoint import latest_checkpoint

        previous = latest_checkpoint(root)
        raise CheckpointWriteError(
            exc.errno,
            f"writing the step-{step} checkpoint under {root} failed: {exc.strerror or exc}. Nothing half-written is "
            f"kept; the last complete checkpoint is {previous or 'none (no step saved yet)'}. Free space there (or "
            "set trainer.output_dir to a larger disk, or lower trainer.max_ckpt_to_keep), then `dapo train --resume`",
        ) from exc


@task(name="export-model", cache_policy=NO_CACHE, retries=1)
def export_model(executor: Executor, path: Path) -> Path:
    return executor.export_model(path)
