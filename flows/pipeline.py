"""The whole mission on the configured recipe: curate -> base model -> train -> evaluate (``dapo pipeline``).

One parent Prefect flow with the four stage flows as subflows, and one parent MLflow run with the stages' runs
nested under it. The stages write the fixed output paths that ``dvc.yaml`` declares; at the end the pipeline
records them with ``dvc commit`` so ``dvc status`` is clean and ``dvc repro`` is a no-op.

Each stage ends with one line (``[2/6] base model  warm start 1200 steps ...  7m58s``): in the Prefect run log, and
on the console when a command attached one (``tasks.progress``; ``dapo pipeline`` does, with progress bars for the
warm start and the RL steps). ``log_file`` (``dapo pipeline`` passes ``outputs/pipeline-<run_name>/pipeline.log``,
outside the DVC-tracked stage outputs) is logged as an artifact of the parent MLflow run.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from dapo_core.config import DapoConfig, load_config
from dapo_core.config.schema import resolved_run_name, resolved_tracking_uri
from dapo_core.evaluation.runner import stop_split
from flows.base_model import base_model_flow
from flows.controls import run_controls
from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.train import PROGRESS_HOOKS, train_flow
from tasks import progress, tracking
from tasks.data import dvc_recorded_md5
from tasks.train import step_progress
from tasks.train_logging import val_fields

logger = logging.getLogger(__name__)

DVC_STAGES = ("curate", "base_model", "train", "evaluate")
STAGES = ("curate", "base model", "evaluate base", "train", "evaluate", "controls", "dvc commit")
LOG_FILE = "pipeline.log"


def pipeline_log_path(cfg: DapoConfig) -> Path:
    """``<trainer.output_dir>/pipeline-<run_name>/pipeline.log``: beside, not inside, the DVC-tracked
    ``outputs/<run_name>/`` (a file still written after ``dvc commit`` would leave ``dvc status`` dirty)."""
    return Path(cfg.trainer.output_dir) / f"pipeline-{resolved_run_name(cfg)}" / LOG_FILE


class _Stages:
    """One line per finished stage: ``[i/n] name  what it did  time``, to the run log and the console."""

    def __init__(self, plog: Any, stages: tuple[str, ...] = STAGES) -> None:
        self.plog, self.done, self.stages = plog, 0, stages
        self.width = max(len(s) for s in stages)

    @contextmanager
    def run(self, name: str) -> Iterator[dict[str, str]]:
        """Time the block; it sets ``info["what"]``. A spinner shows the running stage on a terminal."""
        info = {"what": ""}
        t0 = time.perf_counter()
        with progress.activity(f"{name} ..."):
            yield info
        self.done += 1
        line = (
            f"[{self.done}/{len(self.stages)}] {name:<{self.width}}  {info['what']}  "
            f"({progress.fmt_duration(time.perf_counter() - t0)})"
        )
        self.plog.info(line)
        progress.echo(line)


def _acc(metrics: dict[str, Any], prefix: str) -> str:
    """``avg@8 0.302`` from the first ``<prefix>...mean_at_<k>`` key, '' without one."""
    for key in sorted(metrics):
        if key.startswith(prefix) and "/mean_at_" in key:
            return f"avg@{key.rsplit('_', 1)[-1]} {metrics[key]:.3f}"
    return ""


def _curate_line(c: dict[str, Any]) -> str:
    dropped = sum(int(v) for v in (c.get("dropped") or {}).values())
    return f"{c['rows_in']} problems -> {c['train']} train / {c['val']} val ({dropped} dropped) in {c['output_dir']}"


def _base_line(b: dict[str, Any]) -> str:
    m = b.get("metrics", {})
    held = [x for x in (_acc(m, "heldout/acc/"),) if x]
    if "heldout/acc/greedy" in m:
        held.append(f"greedy {m['heldout/acc/greedy']:.3f}")
    what = "up to date, reused" if b["cached"] else f"warm start {b['steps']} steps ->"
    return f"{what} {b['output_dir']}" + (f"; held-out {', '.join(held)}" if held else "")


def _eval_line(e: dict[str, Any], label: str) -> str:
    out = f" -> {e['metrics_path']}" if e.get("metrics_path") else ""
    return f"{label}: avg@{e['n']} {e['mean_acc']:.3f} on {e['num_problems']} held-out problems{out}"


def _train_line(t: dict[str, Any], steps: int) -> str:
    m = t.get("final_metrics", {})
    parts = [f"{steps} RL steps -> {t['final_model']}"]
    if "train/acc/mean" in m:
        parts.append(f"train acc {m['train/acc/mean']:.3f}")
    parts += [f"val {k} {v:.3f}" for k, v in val_fields(m).items()]
    return "; ".join(parts)


def _controls_line(controls: list[dict[str, Any]]) -> str:
    """``sft-control avg@8 0.170 (254 SFT steps), ...; each given RL's 160 CPU s -> outputs/controls-tiny-dapo``"""
    each = ", ".join(f"{c['name']} avg@{c['k']} {c['acc']:.3f} ({c['steps']} SFT steps)" for c in controls)
    c0 = controls[0]
    where = Path(c0["output_dir"]).parent
    return f"{each}; each given RL's {c0['budget_s']:.0f} {c0['budget_kind'].upper()} s of SFT -> {where}"


def _dvc_commit(plog: Any) -> bool:
    """Record the stage outputs in dvc.lock (they were produced by the same code the stage commands run) and the
    generated raw data in the DVC cache, so `dvc status` is clean and `dvc repro` a no-op afterwards."""
    # the venv's dvc first: `.venv/bin/dapo pipeline` (make run) does not put .venv/bin on PATH
    beside = Path(sys.executable).parent / "dvc"
    dvc = str(beside) if beside.is_file() else shutil.which("dvc")
    if dvc is None or not Path("dvc.yaml").is_file() or not Path(".dvc").is_dir():
        plog.warning("dvc (or dvc.yaml / .dvc) not found: stage outputs not recorded; run `dvc commit` yourself")
        return False
    # data.dvc too: `dapo data generate` wrote data/ (same content as recorded) but not into the DVC cache, which
    # `dvc status` reports as "not in cache" until it is committed
    raw = ["data.dvc"] if Path("data.dvc").is_file() else []
    proc = subprocess.run([dvc, "commit", "--force", *raw, *DVC_STAGES], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        plog.warning("`dvc commit` failed (exit %d): %s", proc.returncode, proc.stderr.strip()[-2000:])
        return False
    return True


def _accuracies(base_eval: dict[str, Any], final_eval: dict[str, Any]) -> dict[str, Any]:
    """Held-out accuracy and stop split of the base model and of the policy after RL."""
    return {
        "base_acc": base_eval["mean_acc"],
        "final_acc": final_eval["mean_acc"],
        "base_stop": stop_split(base_eval.get("metrics", {})),
        "final_stop": stop_split(final_eval.get("metrics", {})),
    }


def _dvc_stage(stages: _Stages, plog: Any, dvc_commit: bool) -> bool:
    """The last stage line: the outputs recorded in dvc.lock (or why not); whether they were."""
    with stages.run("dvc commit") as s:
        committed = _dvc_commit(plog) if dvc_commit else False
        if committed:
            s["what"] = "stage outputs recorded in dvc.lock"
        else:
            s["what"] = "not recorded (see the warning above)" if dvc_commit else "skipped (dvc_commit=False)"
    return committed


@flow(name="dapo-pipeline", log_prints=False, validate_parameters=True)
def pipeline_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    dvc_commit: bool = True,
    log_file: str | None = None,
) -> dict[str, Any]:
    """Curate -> base model -> train -> evaluate; returns each stage's summary and base -> final accuracy.

    ``log_file``: this run's log (written by the caller), logged as an artifact of the parent MLflow run.

    Long because it reads as the pipeline: one ``stages.run(...)`` block per stage, in order, in one parent run."""
    plog = get_run_logger()
    common = {"config_path": config_path, "recipe": recipe, "overrides": list(overrides or [])}
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    run_name = resolved_run_name(cfg)
    stages = _Stages(plog, STAGES if cfg.control.pipeline else tuple(s for s in STAGES if s != "controls"))
    t0 = time.perf_counter()
    with tracking.start_run(
        cfg, run_name=f"pipeline-{run_name}", tags={"stage": "pipeline", "recipe": cfg.recipe}
    ) as run:
        tracking.log_params_flat(cfg)
        tracking.set_tags(tracking.git_tags())
        with stages.run("curate") as s:
            curated = curate_flow(**common)
            s["what"] = _curate_line(curated)
        data_tags = {"data.dvc_md5": dvc_recorded_md5(), "data.curated_digest": str(curated.get("digest", ""))}
        tracking.set_tags(data_tags)
        with stages.run("base model") as s:
            base = base_model_flow(**common, extra_tags=data_tags)
            s["what"] = _base_line(base)
        with stages.run("evaluate base") as s:
            base_eval = evaluate_flow(
                **common, model=base["output_dir"], metrics_path=None, run_name="evaluate-base_model",
                extra_tags=data_tags,
            )  # fmt: skip
            s["what"] = _eval_line(base_eval, "base model")
        with stages.run("train") as s:
            trained = _train_with_progress(cfg, common, data_tags)
            s["what"] = _train_line(trained, cfg.trainer.total_steps)
        with stages.run("evaluate") as s:
            final_eval = evaluate_flow(
                **common, model=trained["final_model"], run_name=f"evaluate-{run_name}", extra_tags=data_tags
            )
            s["what"] = _eval_line(final_eval, "trained policy")
        controls: list[dict[str, Any]] = []
        if cfg.control.pipeline:
            with stages.run("controls") as s:
                controls = run_controls(common, cfg, base["output_dir"], trained["run_id"], data_tags)
                s["what"] = _controls_line(controls)
        summary = {
            "curate": curated, "base_model": base, "controls": controls, "k": final_eval.get("n"),
            "train": {k: v for k, v in trained.items() if k != "final_metrics"},
            **_accuracies(base_eval, final_eval), "parent_run_id": run.info.run_id,
            "tracking_uri": resolved_tracking_uri(cfg), "wall_s": time.perf_counter() - t0,
        }  # fmt: skip
        tracking.log_metrics(
            {"pipeline/base_acc": summary["base_acc"], "pipeline/final_acc": summary["final_acc"],
             **{f"pipeline/{c['name']}_acc": c["acc"] for c in controls}},
            0,
        )  # fmt: skip
        if log_file and Path(log_file).is_file():
            tracking.log_artifact(log_file, "logs")
    summary["dvc_committed"] = _dvc_stage(stages, plog, dvc_commit)
    plog.info(
        "pipeline done in %.0fs: held-out avg@%s %.3f (base model) -> %.3f (after %s)",
        summary["wall_s"], summary["k"], summary["base_acc"], summary["final_acc"], run_name,
    )  # fmt: skip
    return summary


def _train_with_progress(cfg: DapoConfig, common: dict[str, Any], data_tags: dict[str, str]) -> dict[str, Any]:
    """The train subflow with a bar over its RL steps (live train accuracy, latest validation accuracy)."""
    with progress.bar("RL", total=cfg.trainer.total_steps, unit="step") as bar:
        hook = step_progress(bar)
        PROGRESS_HOOKS.append(hook)
        try:
            return train_flow(**common, extra_tags=data_tags)
        finally:
            PROGRESS_HOOKS.remove(hook)
