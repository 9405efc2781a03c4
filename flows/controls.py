"""The supervised controls beside a trained policy: what the same time of SFT would have given instead of RL.

`dapo pipeline` runs them after its evaluate stage when ``control.pipeline`` names any (tiny-dapo names both):

- ``sft-control``: the base model, trained on for RL's time on the warm start's own demonstrations, habits
  included (the paper's situation: no better demonstrations exist, only a verifier);
- ``sft-control-clean``: the same on clean demonstrations that stop at their answer line (``control.clean_lr``):
  where such demonstrations exist, the supervised baseline RL has to beat.

RL's time is the CPU seconds its training steps took (``perf/cpu_time_per_step`` summed; per-step wall time with
the Ray executor, whose workers' CPU time is not the driver's), as the ablation's controls get. Each control is a
nested MLflow run (``stage=control``), its model is saved under ``<trainer.output_dir>/controls-<run name>/<name>``
(outside the DVC-tracked stage outputs) and evaluated like the policy (same problems, k and sampling seed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_core.config import DapoConfig
from dapo_core.config.schema import resolved_run_name
from dapo_core.evaluation.runner import stop_split
from flows.ablation_runs import sft_control, warm_start_steps
from flows.base_model import warm_start_settings
from flows.evaluate import evaluate_flow
from tasks import tracking
from tasks.base_model import read_exclusions
from tasks.evaluate import load_run_histories

STEP_TIME_KEY = "timing_s/step"  # per-step training wall time
STEP_CPU_KEY = "perf/cpu_time_per_step"  # per-step CPU seconds of the training process
CONTROL_WHAT = {
    "sft-control": "the warm start's demonstrations",
    "sft-control-clean": "clean demonstrations",
}


def rl_budget(cfg: DapoConfig, train_run_id: str) -> tuple[float, str]:
    """``(seconds, "cpu" | "wall")``: the training run's summed per-step CPU seconds (local executor), else its
    summed per-step wall time. RuntimeError when the run logged none (nothing to match)."""
    key, kind = (STEP_CPU_KEY, "cpu") if cfg.resources.executor == "local" else (STEP_TIME_KEY, "wall")
    hist = next(iter(load_run_histories(cfg, [train_run_id], [key]).values()), {})
    budget = sum(v for _, v in hist.get(key, []))
    if budget <= 0:
        raise RuntimeError(
            f"the training run {train_run_id} logged no {key}: the controls have no time to match. Train with "
            "this version of dapo-flow (it logs the metric every step), or set control.pipeline=[] to skip them"
        )
    return budget, kind


def controls_dir(cfg: DapoConfig) -> Path:
    """Where the pipeline's controls save their models: beside, not inside, the DVC-tracked run directory."""
    return Path(cfg.trainer.output_dir) / f"controls-{resolved_run_name(cfg)}"


def run_controls(
    common: dict[str, Any], cfg: DapoConfig, base_dir: str, train_run_id: str, extra_tags: dict[str, str]
) -> list[dict[str, Any]]:
    """Each control of ``control.pipeline``: SFT from ``base_dir`` for the training run's time, then the same
    evaluation as the policy; one dict each (name, acc, stop split, steps, CPU/wall seconds, lr, run ids)."""
    if not cfg.control.pipeline:
        return []
    budget_s, kind = rl_budget(cfg, train_run_id)
    ws = warm_start_settings(cfg)
    exclude = read_exclusions([*cfg.data.train_files, *cfg.data.val_files])
    skip = warm_start_steps(base_dir)
    run_name = resolved_run_name(cfg)
    out = []
    for name in cfg.control.pipeline:
        tags = {"stage": "control", "control": name, **extra_tags}
        with tracking.start_run(cfg, run_name=f"{name}-{run_name}", nested=True, tags=tags) as run:
            res = sft_control(
                cfg, ws, base_dir, budget_s=budget_s, budget_kind=kind, exclude=exclude, skip_steps=skip,
                output_dir=str(controls_dir(cfg) / name), clean=name == "sft-control-clean",
            )  # fmt: skip
            tracking.log_metrics(
                {f"control/{kind}_budget_s": budget_s, "control/cpu_s": res["cpu_s"], "control/wall_s": res["wall_s"],
                 "control/steps": res["steps"], "control/lr": res["lr"], "control/final_loss": res["final_loss"]},
                step=res["steps"],
            )  # fmt: skip
            control_run_id = run.info.run_id
        ev = evaluate_flow(
            **common, model=res["output_dir"], metrics_path=None, run_name=f"evaluate-{name}-{run_name}",
            extra_tags=tags,
        )  # fmt: skip
        out.append(
            {"name": name, "acc": ev["mean_acc"], "k": ev.get("n"), "stop": stop_split(ev.get("metrics", {})), "budget_s": budget_s,
             "budget_kind": kind, **res, "run_id": control_run_id, "eval_run_id": ev["run_id"]}
        )  # fmt: skip
    return out
