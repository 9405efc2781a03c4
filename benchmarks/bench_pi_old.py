"""pi_old from the sampler (``algorithm.old_log_probs: rollout``) against the trainer's recomputation: the default
RL step side by side, and held-out accuracy after the same steps.

Run: ``python -m benchmarks.bench_pi_old [--steps 16] [--seed 1]`` (writes benchmarks/results/pi_old.json and .md;
the two final models and the evaluation runs go to outputs/bench-pi-old/). Needs the curated data and the base
model (``make run``, or ``dapo curate`` + ``dapo base-model``), or ``--base DIR``.

Both rows run ``flows.train_step.train_step`` (the step ``dapo train`` runs) of the default recipe (params.yaml) from
the warm-started base model on the curated prompts, in-process with 2 torch threads, each on its own executor and
prompt sampler from the same seeds, interleaved step by step (the first row alternates), so the machine's drift
falls on both. ``recompute`` is the default: one trainer forward over the kept batch gives pi_old (and the
entropy) before the updates. ``rollout`` takes pi_old from the log-probs the sampler recorded while generating
(the hf backend samples with the trainer's own module at the rollout temperature) and skips that forward. The
speed figure is the median of the per-step ratios (rollout / recompute) over steps 2..N; the two runs stay on the
same samples only while their weights agree closely enough that no sampled near-tie flips, so later steps may draw
different responses (the report counts the steps whose mean length, score and accuracy agree exactly). Each
final model is then scored as the pipeline's evaluate stage scores (the 200 held-out problems, avg@8, one fixed
sampling seed).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_overhead import interleave
from benchmarks.common import require_base_and_data, write_results

OUT = Path("outputs/bench-pi-old")
ROWS = {"recompute": [], "rollout": ["algorithm.old_log_probs=rollout"]}
PHASES = ("gen", "old_log_prob", "update_actor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--base", default="outputs/base_model")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps ({args.steps}) must be >= 2: step 1 is not timed")
    from dapo_core.env import apply_quiet_env

    apply_quiet_env()  # offline and quiet, as the `dapo` CLI runs (this is called before Prefect is imported)
    require_base_and_data(args.base)
    import torch

    from benchmarks.steps import StepRunner
    from dapo_core.config import load_config
    from dapo_core.engines.executor import LocalExecutor
    from flows.evaluate import evaluate_flow
    from tasks import train as T

    torch.set_num_threads(2)
    OUT.mkdir(parents=True, exist_ok=True)
    common = [f"model.path={args.base}", f"trainer.seed={args.seed}", f"trainer.total_steps={args.steps}"]
    cfgs = {k: load_config(config_path="params.yaml", overrides=[*common, *v], env={}) for k, v in ROWS.items()}
    executors = {k: LocalExecutor(cfg) for k, cfg in cfgs.items()}
    first = cfgs["recompute"]
    items = T.load_prompts.fn(
        first.data.train_files, executors["recompute"].tokenizer, first.data.max_prompt_length, "data.train_files"
    )
    steppers = {k: StepRunner(ex, cfgs[k], items) for k, ex in executors.items()}
    metrics: dict[str, list[dict[str, float]]] = {k: [] for k in steppers}  # every step's, for the checks below

    def row(name: str) -> Callable[[], tuple[float, dict[str, float]]]:
        def step() -> tuple[float, dict[str, float]]:
            secs, m = steppers[name].step(with_tasks=False)
            metrics[name].append(m)
            return secs, m

        return step

    # recompute first: each row's paired ratio is to it, step by step; step 1 warms up
    timed = interleave({k: row(k) for k in steppers}, args.steps - 1, 1)

    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    rows: dict[str, Any] = {}
    for name, ex in executors.items():
        model = ex.export_model(OUT / name / "final")
        ev = evaluate_flow(
            recipe="tiny-dapo", overrides=[f"tracking.uri={uri}"], model=str(model), metrics_path=None,
            run_name=f"pi-old-{name}-s{args.seed}",
        )  # fmt: skip
        t = timed[name]
        rows[name] = {
            "median_step_s": t["median_s"],
            "phases_s": {p: t["phases_s"][p] for p in PHASES},
            "steps_s": t["steps_s"],
            "heldout_acc": ev["mean_acc"],
            "train_acc_last": metrics[name][-1]["train/acc/mean"],
            "entropy_last": metrics[name][-1]["actor/entropy"],
        }
    ratio, iqr = timed["rollout"]["paired_ratio"], timed["rollout"]["paired_ratio_iqr"]
    # the same samples, as far as the step's metrics show: equal mean length, score and accuracy, to the last bit
    keys = ("response_length/mean", "critic/score/mean", "train/acc/mean")
    same = [all(a[k] == b[k] for k in keys) for a, b in zip(*metrics.values(), strict=True)]
    summary = {
        "ratio_rollout_to_recompute": ratio,
        "ratio_iqr": iqr,
        "steps_on_the_same_samples": same.index(False) if False in same else len(same),
        "heldout_acc": {k: r["heldout_acc"] for k, r in rows.items()},
    }
    table = [
        "| pi_old | median step s (steps 2..N) | gen s | old_log_prob s | update s | held-out avg@8 |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ph = r["phases_s"]
        table.append(
            f"| {name} | {r['median_step_s']:.2f} | {ph['gen']:.2f} | {ph['old_log_prob']:.2f} | "
            f"{ph['update_actor']:.2f} | {r['heldout_acc']:.1%} |"
        )
    table += [
        "",
        f"rollout / recompute time per step: **{ratio:.2f}x** (median of the {args.steps - 1} paired steps; "
        f"interquartile {summary['ratio_iqr'][0]:.2f}-{summary['ratio_iqr'][1]:.2f}x). The two runs' mean response "
        f"length, score and accuracy were equal for their first {summary['steps_on_the_same_samples']} of "
        f"{args.steps} steps. Seed {args.seed}, "
        f"params.yaml from {args.base}, 2 torch threads, in process. Written by `python -m benchmarks.bench_pi_old`.",
    ]
    payload = {
        "recipe": "params.yaml",
        "steps": args.steps,
        "seed": args.seed,
        "base_model": args.base,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "summary": summary,
        "rows": rows,
    }
    write_results("pi_old", payload, "\n".join(table))


if __name__ == "__main__":
    main()
