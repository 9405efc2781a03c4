"""The DAPO training flow: rounds of rollout -> reward -> filter -> train (Algorithm 1), tracked in MLflow.

Run it: ``dapo train`` (params.yaml), ``dapo train --recipe tiny-grpo --set trainer.total_steps=20``,
``dapo train --resume`` (continue the run named by tracking.run_name from its last complete checkpoint).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from dapo_core.config import ConfigError, DapoConfig, flatten_config, load_config
from dapo_core.config.schema import resolved_data_seed, resolved_run_name
from dapo_core.engines.checkpoint import WRITE_S, latest_checkpoint, read_meta
from dapo_core.faults import fault_point
from dapo_core.training.health import HealthMonitor
from dapo_core.training.overlap import RolloutPrefetcher
from dapo_core.training.prompts import PromptSampler
from flows.train_step import RunState
from flows.train_step import train_step as _train_step  # called by this name: tests replace it to crash a step
from tasks import flow_runs, tracking, tracking_store
from tasks import train as T
from tasks.train_logging import HeldMetrics, finish_run_artifacts, run_tags, validate

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


def _open_state(cfg: DapoConfig, executor: Any, run_name: str, ckpt_root: Path) -> RunState:
    """The loop's state at step 0: the prompts, the sampler, the health monitor, the prefetcher, the held metrics."""
    tok = executor.tokenizer
    train_items = T.load_prompts(cfg.data.train_files, tok, cfg.data.max_prompt_length, "data.train_files")
    val_items = T.load_prompts(cfg.data.val_files, tok, cfg.data.max_prompt_length, "data.val_files")
    sampler = PromptSampler(len(train_items), seed=resolved_data_seed(cfg), shuffle=cfg.data.shuffle)
    prefetcher = RolloutPrefetcher(executor, cfg, train_items, sampler) if cfg.rollout.mode == "one_step_off" else None
    return RunState(
        cfg=cfg, executor=executor, train_items=train_items, val_items=val_items, sampler=sampler,
        health=HealthMonitor(), prefetcher=prefetcher, held=HeldMetrics(enabled=cfg.trainer.save_freq > 0),
        run_name=run_name, ckpt_root=ckpt_root,
    )  # fmt: skip


def _after_update(run: RunState, step: int, metrics: dict[str, float]) -> None:
    """The rest of a step: health alerts, validation, then its metrics held until a checkpoint covers them (logged
    exactly once), the checkpoint when due, and the progress hooks. The fault points mark where a kill is tested."""
    cfg, plog = run.cfg, get_run_logger()
    for alert in run.health.update(step, metrics):
        plog.warning("training-health alert %s at step %d: %s", alert.name, alert.step, alert.message)
        tracking.set_tags({f"alert.{alert.name}": f"step {alert.step}: {alert.message}"})
    fault_point("update", step)  # the policy has moved; nothing of this step is saved or logged
    if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0:
        metrics.update(validate(run.executor, quote(run.val_items), quote(cfg), step=step))
    run.held.hold(metrics, step)
    due_save = cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0
    if due_save or step == cfg.trainer.total_steps:
        path = T.save_checkpoint(run.executor, run.ckpt_root, step, run.checkpoint_meta())
        # the write time as the checkpoint records it: a resume from it holds the same value (RunState.restore),
        # so a kill before these lines loses nothing and one after them logs nothing twice
        metrics["timing_s/save_checkpoint"] = float(read_meta(path)[WRITE_S])
        run.held.add({"timing_s/save_checkpoint": metrics["timing_s/save_checkpoint"]}, step)
        run.held.flush()
        tracking.log_artifacts(path, f"checkpoints/{path.name}")  # a resume from it sends it again if incomplete
    fault_point("between-steps", step)
    for hook in PROGRESS_HOOKS:
        hook(step, cfg.trainer.total_steps, metrics)


def _start_tracking(run: RunState, resumed_from: Path | None, interrupted: str | None) -> None:
    """A new run: its params and tags, and a validation at step 0 when asked. A resumed one: the link to the flow
    run it resumes, the checkpoint's held points logged again (MLflow adds nothing it holds) in case the
    interrupted run was killed while flushing them (its later points were never logged), and the checkpoint
    itself sent again unless the server holds all of it (the kill may have struck during its upload)."""
    tracking.log_params_flat(run.cfg)
    if resumed_from is not None:
        if flow_runs.mark_resumed(interrupted):
            tracking.set_tags({"prefect.resumed_flow_run_id": str(interrupted)})
        get_run_logger().info("resuming: %d held step(s) flushed", run.held.flush())
        artifact_path = f"checkpoints/{resumed_from.name}"
        if not tracking.holds_artifacts(resumed_from, artifact_path):
            get_run_logger().info("resuming: %s sent again (the server did not hold all of it)", artifact_path)
            tracking.log_artifacts(resumed_from, artifact_path)
    elif run.cfg.trainer.val_before_train:
        validate(run.executor, quote(run.val_items), quote(run.cfg), step=0)


def _already_finished(resume_from: dict[str, Any], cfg: DapoConfig, run_name: str, out_dir: Path) -> dict[str, Any]:
    get_run_logger().info(
        "--resume: %s already finished (checkpoint %s at step %d of %d, final model %s): nothing to do",
        run_name, resume_from["path"], resume_from["step"], cfg.trainer.total_steps, out_dir / "final",
    )  # fmt: skip
    return {
        "run_id": resume_from["meta"].get("mlflow_run_id"), "run_name": run_name, "final_metrics": {},
        "final_model": str(out_dir / "final"), "registered_model": None, "already_finished": True,
    }  # fmt: skip


def run_training(
    cfg: DapoConfig, *, resume: bool, nested: bool, extra_tags: dict[str, str], force: bool = False
) -> dict[str, Any]:
    """The run: resume or start, then each step (``_train_step``, then ``_after_update``), then the final model."""
    run_name = resolved_run_name(cfg)
    out_dir = Path(cfg.trainer.output_dir) / run_name
    resume_from = _resume_state(out_dir / "checkpoints", resume, cfg, force)
    if resume_from is not None and _finished(resume_from, cfg, out_dir):
        return _already_finished(resume_from, cfg, run_name, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_handler = logging.FileHandler(out_dir / "train.log")
    log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(log_handler)
    executor = T.setup_executor(cfg)
    try:
        run = _open_state(cfg, executor, run_name, out_dir / "checkpoints")
        start_step = 0
        if resume_from is not None:
            start_step = run.restore(executor.load_checkpoint(resume_from["path"]))
            get_run_logger().info("resuming %s from %s (step %d)", run_name, resume_from["path"], start_step)
        tags = {**run_tags(cfg, run_name), **extra_tags}
        # the flow run of the interrupted process (linked on the MLflow run), before this one's link replaces it
        interrupted = tracking_store.run_tag(cfg, run.run_id, "prefect.flow_run_id") if run.run_id else None
        with tracking.start_run(cfg, run_name=run_name, run_id=run.run_id, nested=nested, tags=tags) as mlrun:
            run.run_id = mlrun.info.run_id
            tracking.set_tags(tags)
            _start_tracking(run, Path(resume_from["path"]) if resume_from else None, interrupted)
            last_metrics: dict[str, float] = {}
            for step in range(start_step + 1, cfg.trainer.total_steps + 1):
                last_metrics = _train_step(run, step)
                _after_update(run, step, last_metrics)
            summary = finish_run_artifacts(executor, cfg, run.run_id, run_name, out_dir)
            summary.update({"run_id": run.run_id, "run_name": run_name, "final_metrics": last_metrics})
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
