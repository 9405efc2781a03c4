"""The DAPO training flow: rounds of rollout -> reward -> filter -> train (Algorithm 1), tracked in MLflow.

Run it: ``dapo train`` (params.yaml), ``dapo train --recipe tiny-grpo --set trainer.total_steps=20``,
``dapo train --resume`` (continue the run named by tracking.run_name from its last complete checkpoint).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from dapo_core.algorithm import GroupAccumulator
from dapo_core.algorithm import metric_names as mn
from dapo_core.config import ConfigError, DapoConfig, flatten_config, load_config
from dapo_core.config.schema import resolved_run_name
from dapo_core.engines.checkpoint import latest_checkpoint
from dapo_core.faults import fault_point
from dapo_core.seeding import derive_seed
from dapo_core.training.health import HealthMonitor
from dapo_core.training.overlap import RolloutPrefetcher
from dapo_core.training.prompts import PromptSampler
from dapo_core.training.step import zero_variance_flags
from tasks import flow_runs, tracking, tracking_store
from tasks import train as T
from tasks.train_logging import (
    HeldMetrics,
    finish_run_artifacts,
    run_tags,
    validate,
)

logger = logging.getLogger(__name__)

# Called after every step with (step, total_steps, metrics); the CLI installs a rich progress bar here.
PROGRESS_HOOKS: list[Callable[[int, int, dict[str, float]], None]] = []


# keys a resume may change without --force: how long the run goes on and how often it saves/validates/logs
RESUME_MUTABLE_PREFIXES: tuple[str, ...] = (
    "trainer.total_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.max_ckpt_to_keep",
    "trainer.val_before_train",
    "tracking.",
)


class ResumeConfigError(ConfigError):
    """--resume with a config that differs from the checkpoint's in keys that change the results."""


def config_changes(saved: dict[str, str], now: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Flattened keys whose value differs between the checkpoint's config and this one (mutable keys left out)."""
    keys = sorted(set(saved) | set(now))
    return {
        k: (saved.get(k), now.get(k))
        for k in keys
        if saved.get(k) != now.get(k) and not k.startswith(RESUME_MUTABLE_PREFIXES)
    }


def _resume_state(ckpt_root: Path, resume: bool, cfg: DapoConfig, force: bool) -> dict[str, Any] | None:
    """The checkpoint to resume from (and its metadata); refuses a changed config unless ``force``."""
    if not resume:
        return None
    path = latest_checkpoint(ckpt_root)
    if path is None:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint under {ckpt_root}. Check tracking.run_name (the run to continue) "
            "and trainer.output_dir, or start without --resume"
        )
    meta = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    saved = meta.get("config")
    if isinstance(saved, dict):
        changes = config_changes(saved, {k: str(v) for k, v in flatten_config(cfg).items()})
        if changes and not force:
            lines = "\n".join(f"  {k}: {old!r} (checkpoint) -> {new!r} (now)" for k, (old, new) in changes.items())
            raise ResumeConfigError(
                f"--resume: the config differs from the one {path} was trained with, in {len(changes)} key(s):\n"
                f"{lines}\nResume with the checkpoint's values (e.g. the same --config/--recipe/--set), or add "
                "--force to continue with the new ones (the run then mixes two configs). Free to change on resume: "
                + ", ".join(RESUME_MUTABLE_PREFIXES)
            )
        if changes:
            logger.warning("--resume --force: continuing with %d changed key(s): %s", len(changes), sorted(changes))
    return {"path": path, "step": int(meta["step"]), "meta": meta}


@flow(name="dapo-train", log_prints=False, validate_parameters=True)
def train_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    nested: bool = False,
    extra_tags: dict[str, str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Train a policy with DAPO (or GRPO, per the recipe). Returns a summary (run id, paths, final metrics).

    ``resume``: continue from the run's last checkpoint (refused when the config changed, unless ``force``)."""
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    return run_training(cfg, resume=resume, nested=nested, extra_tags=extra_tags or {}, force=force)


def run_training(
    cfg: DapoConfig, *, resume: bool, nested: bool, extra_tags: dict[str, str], force: bool = False
) -> dict[str, Any]:
    plog = get_run_logger()
    run_name = resolved_run_name(cfg)
    out_dir = Path(cfg.trainer.output_dir) / run_name
    ckpt_root = out_dir / "checkpoints"
    resume_from = _resume_state(ckpt_root, resume, cfg, force)
    if _finished(resume_from, cfg, out_dir):
        plog.info(
            "--resume: %s already finished (checkpoint %s at step %d of %d, final model %s): nothing to do",
            run_name, resume_from["path"], resume_from["step"], cfg.trainer.total_steps, out_dir / "final",
        )  # fmt: skip
        return {
            "run_id": resume_from["meta"].get("mlflow_run_id"), "run_name": run_name, "final_metrics": {},
            "final_model": str(out_dir / "final"), "registered_model": None, "already_finished": True,
        }  # fmt: skip

    out_dir.mkdir(parents=True, exist_ok=True)
    log_handler = logging.FileHandler(out_dir / "train.log")
    log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(log_handler)
    executor = T.setup_executor(cfg)
    try:
        tok = executor.tokenizer
        train_items = T.load_prompts(cfg.data.train_files, tok, cfg.data.max_prompt_length, "data.train_files")
        val_items = T.load_prompts(cfg.data.val_files, tok, cfg.data.max_prompt_length, "data.val_files")
        sampler = PromptSampler(
            len(train_items),
            seed=cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed,
            shuffle=cfg.data.shuffle,
        )
        health = HealthMonitor()
        prefetcher = (
            RolloutPrefetcher(executor, cfg, train_items, sampler) if cfg.rollout.mode == "one_step_off" else None
        )
        start_step, gen_batches_total, run_id = 0, 0, None
        held = HeldMetrics(enabled=cfg.trainer.save_freq > 0)  # each step's metrics: logged once per run
        if resume_from is not None:
            meta = executor.load_checkpoint(resume_from["path"])
            start_step = int(meta["step"])
            gen_batches_total = int(meta.get("gen_batches_total", 0))
            sampler.load_state_dict(meta["sampler"])
            health.load_state_dict(meta.get("health", {}))
            if prefetcher is not None:  # what the interrupted run had generated ahead, with the older weights
                prefetcher.load_state_dict(meta.get("prefetched", []))
            run_id = meta.get("mlflow_run_id")
            plog.info("resuming %s from %s (step %d)", run_name, resume_from["path"], start_step)

        tags = {**run_tags(cfg, run_name), **extra_tags}
        # the flow run of the interrupted process (linked on the MLflow run), before this one's link replaces it
        interrupted = tracking_store.run_tag(cfg, run_id, "prefect.flow_run_id") if run_id else None
        with tracking.start_run(cfg, run_name=run_name, run_id=run_id, nested=nested, tags=tags) as run:
            run_id = run.info.run_id
            tracking.log_params_flat(cfg)
            tracking.set_tags(tags)
            if resume_from is not None:
                if flow_runs.mark_resumed(interrupted):
                    tracking.set_tags({"prefect.resumed_flow_run_id": str(interrupted)})
                # the checkpoint's held points: logged again (MLflow adds nothing it holds) in case the
                # interrupted run was killed while flushing them; its later points were never logged
                held.restore(resume_from["meta"].get("held_metrics", []))
                plog.info("resuming at step %d: %d held step(s) flushed", start_step, held.flush())
            elif cfg.trainer.val_before_train:
                validate(executor, quote(val_items), quote(cfg), step=0)

            last_metrics: dict[str, float] = {}
            for step in range(start_step + 1, cfg.trainer.total_steps + 1):
                last_metrics, gen_batches_total = _train_step(
                    executor, train_items, sampler, cfg, step, gen_batches_total, prefetcher
                )
                for alert in health.update(step, last_metrics):
                    plog.warning("training-health alert %s at step %d: %s", alert.name, alert.step, alert.message)
                    tracking.set_tags({f"alert.{alert.name}": f"step {alert.step}: {alert.message}"})
                fault_point("update", step)  # the policy has moved; nothing of this step is saved or logged
                if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0:
                    last_metrics.update(validate(executor, quote(val_items), quote(cfg), step=step))
                # held until the checkpoint that covers the step is written (HeldMetrics): logged exactly once
                held.hold(last_metrics, step)
                due_save = cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0
                if due_save or step == cfg.trainer.total_steps:
                    t0 = time.perf_counter()
                    meta = {
                        "config": {k: str(v) for k, v in flatten_config(cfg).items()},  # what --resume compares
                        "mlflow_run_id": run_id,
                        "gen_batches_total": gen_batches_total,
                        "sampler": sampler.state_dict(),
                        "health": health.state_dict(),
                        "prefetched": prefetcher.state_dict() if prefetcher is not None else [],
                        "run_name": run_name,
                        "held_metrics": held.state(),
                    }
                    path = T.save_checkpoint(executor, ckpt_root, step, meta)
                    tracking.log_artifacts(path, f"checkpoints/{path.name}")
                    last_metrics["timing_s/save_checkpoint"] = time.perf_counter() - t0
                    held.add({"timing_s/save_checkpoint": last_metrics["timing_s/save_checkpoint"]}, step)
                    held.flush()
                fault_point("between-steps", step)
                for hook in PROGRESS_HOOKS:
                    hook(step, cfg.trainer.total_steps, last_metrics)
            summary = finish_run_artifacts(executor, cfg, run_id, run_name, out_dir)
            summary.update({"run_id": run_id, "run_name": run_name, "final_metrics": last_metrics})
            return summary
    finally:
        executor.shutdown()
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()


def _finished(resume_from: dict[str, Any] | None, cfg: DapoConfig, out_dir: Path) -> bool:
    """A resume of a run that has nothing left: every step checkpointed, the final model written, and its MLflow
    run ended FINISHED. A kill after the final export but before the model's registration and the run's end leaves
    the run RUNNING: that resume runs no step and does the rest."""
    if resume_from is None or resume_from["step"] < cfg.trainer.total_steps or not (out_dir / "final").is_dir():
        return False
    status = tracking_store.run_status(cfg, resume_from["meta"].get("mlflow_run_id"))
    return status in (None, "FINISHED")  # None: no such run in the store (nothing to finish there)


def _train_step(
    executor: Any,
    train_items: Sequence[Any],
    sampler: PromptSampler,
    cfg: DapoConfig,
    step: int,
    gen_batches_total: int,
    prefetcher: RolloutPrefetcher | None = None,
) -> tuple[dict[str, float], int]:
    """One rollout step: generation batches until the batch is full (dynamic sampling), then the update.

    ``prefetcher`` (rollout.mode=one_step_off): the first batch comes from its queue (generated ahead with older
    weights), and the next steps' first batches are submitted before the update, to generate while it runs."""
    t_step, cpu_step = time.perf_counter(), time.process_time()
    ds = cfg.algorithm.dynamic_sampling
    acc = GroupAccumulator(
        target_num_groups=cfg.data.train_batch_size,
        max_num_gen_batches=ds.max_num_gen_batches if ds.enable else 1,
        on_exhausted=ds.on_exhausted if ds.enable else "continue",
    )
    timings = {"gen": 0.0, "reward": 0.0, "filter": 0.0}
    correct, total, zero_var, groups_seen, gen_idx, failed = 0, 0, 0, 0, 0, 0
    # quote(): Prefect walks every task argument looking for futures; for a batch of a few hundred responses that
    # walk took ~0.3 s per task call (a tenth of a tiny step), so the large arguments go in unexamined
    while acc.need_more():
        t0 = time.perf_counter()
        ahead = T.take_prefetched(prefetcher, step) if prefetcher is not None and gen_idx == 0 else None
        if ahead is not None:
            items, results, version = ahead.items, ahead.results, ahead.version
        else:
            items = [train_items[i] for i in sampler.next_indices(cfg.data.gen_batch_size)]
            version = executor.weight_version
            results = T.rollout(
                executor, quote(items), quote(cfg), derive_seed(cfg.trainer.seed, "train", step, gen_idx)
            )
        fault_point("rollout", step)  # samples generated, not yet scored
        t1 = time.perf_counter()
        batch, flags, parts = T.score_and_filter(executor, quote(items), quote(results), quote(cfg), version)
        timings["gen"] += t1 - t0
        timings["reward"] += time.perf_counter() - t1 - parts["filter"]  # the task run's own cost included
        timings["filter"] += parts["filter"]
        acc.add(batch.groups, flags)
        gen_idx += 1
        failed += batch.num_failed_rewards
        correct += sum(sum(g.acc) for g in batch.groups)
        total += sum(len(g.acc) for g in batch.groups)
        zero_var += sum(zero_variance_flags(batch))
        groups_seen += len(batch.groups)
    groups = acc.take()
    if prefetcher is not None:  # the next steps' first batches generate during this update (on Ray)
        t0 = time.perf_counter()
        T.prefetch(prefetcher, step)
        timings["prefetch_submit"] = time.perf_counter() - t0
    if groups:
        metrics, t_update = T.update_policy(executor, quote(groups), quote(cfg))
        t0 = time.perf_counter()
        T.sync_weights(executor)
        timings["sync_weights"] = time.perf_counter() - t0
        if executor.last_sync is not None:
            metrics[mn.PERF_SYNC_BYTES] = float(executor.last_sync.bytes)
            metrics[mn.TIMING_WEIGHT_SYNC] = executor.last_sync.seconds
        timings.update(t_update)
    else:
        # graceful dynamic sampling kept nothing: no group has signal, so there is no gradient to follow
        get_run_logger().warning(
            "step %d: dynamic sampling kept no group in %d generation batches: skipping the update", step, gen_idx
        )
        metrics = {"perf/batch_tokens": 0.0}
    gen_batches_total += gen_idx
    step_time = time.perf_counter() - t_step
    timings["step"] = step_time
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics.update(
        {
            "train/step": float(step),
            "train/gen_batches_total": float(gen_batches_total),
            "train/num_gen_batches": float(gen_idx),
            "train/acc/mean": correct / max(total, 1),
            "train/kept_groups_frac": acc.kept_groups_frac,
            "train/zero_std_groups_frac": zero_var / max(groups_seen, 1),
            "train/num_groups": float(len(groups)),
            "train/update_skipped": float(not groups),
            "reward/num_failed": float(failed),
            "perf/time_per_step": step_time,
            # this process's CPU seconds (all its threads): the step's compute with the local executor, less
            # sensitive than wall time to other jobs on the machine (the ablation's control budget)
            "perf/cpu_time_per_step": time.process_time() - cpu_step,
            "perf/total_num_tokens": metrics.pop("perf/batch_tokens"),
            "perf/cpu_memory_used_gb": psutil.Process().memory_info().rss / 2**30,
        }
    )
    metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / step_time
    return metrics, gen_batches_total
