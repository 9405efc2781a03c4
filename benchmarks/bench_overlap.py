"""Overlapped rollout (``rollout.mode: one_step_off``) against ``sync`` on Ray, on this CPU: time per step and
held-out accuracy at equal steps.

Run: ``python -m benchmarks.bench_overlap [--steps 16] [--seeds 1]`` (writes benchmarks/results/overlap.json and
.md; its MLflow store and models go to outputs/bench-overlap/). Needs the curated data and the base model
(``dapo curate`` and ``dapo base-model``, or ``make run``), or ``--base DIR``.

The runs are the default recipe (tiny-dapo, 16 steps from the warm-started base model) on the Ray executor with
one rollout worker and one trainer rank on a 2-CPU local cluster, validation off during training (each step's time
is its own), then every final model is scored the same way as the pipeline's evaluate stage (the 200 held-out
problems, avg@8, one fixed sampling seed). Three layouts, run in turn for each seed:

- ``sync colocate``: the default. Rollout and trainer share one 2-CPU bundle (2 torch threads each) and take turns.
- ``sync split``: one 1-CPU bundle each; still taking turns (half the machine idles in each phase).
- ``one_step_off split``: one 1-CPU bundle each; step t+1's first batch generates while step t updates.

The speed figure is the median ``perf/time_per_step`` over steps 2..N (step 1 has nothing to overlap with) and
the ratio to ``sync colocate`` measured in the same invocation. Dynamic sampling's refill batches are generated
after the sync in every mode, so steps that need them overlap less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import require_base_and_data, write_results

OUT = Path("outputs/bench-overlap")
LAYOUTS: dict[str, list[str]] = {
    "sync colocate": ["rollout.mode=sync", "resources.placement=colocate"],
    "sync split": ["rollout.mode=sync", "resources.placement=split"],
    "one_step_off split": ["rollout.mode=one_step_off", "resources.placement=split"],
}
BASELINE = "sync colocate"


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)]


def one_run(layout: str, seed: int, steps: int, base: str) -> dict[str, Any]:
    from flows.evaluate import evaluate_flow
    from flows.train import train_flow

    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    name = f"overlap-{layout.replace(' ', '-')}-s{seed}"
    sets = [
        *LAYOUTS[layout], f"model.path={base}", f"trainer.seed={seed}", f"trainer.total_steps={steps}",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "resources.executor=ray",
        "resources.num_cpus=2", f"tracking.uri={uri}", f"tracking.run_name={name}", f"trainer.output_dir={OUT}/runs",
    ]  # fmt: skip
    t0 = time.perf_counter()
    trained = train_flow(recipe="tiny-dapo", overrides=sets)
    wall = time.perf_counter() - t0
    ev = evaluate_flow(
        recipe="tiny-dapo", overrides=[f"tracking.uri={uri}"], model=trained["final_model"], metrics_path=None,
        run_name=f"{name}-eval",
    )  # fmt: skip
    rid = trained["run_id"]
    step_s = [v for s, v in _history(uri, rid, "perf/time_per_step") if s > 1]
    return {
        "layout": layout,
        "seed": seed,
        "heldout_acc": ev["mean_acc"],
        "median_step_s": statistics.median(step_s),
        "step_s": [round(v, 3) for v in step_s],
        "median_gen_s": statistics.median(v for s, v in _history(uri, rid, "timing_s/gen") if s > 1),
        "median_update_s": statistics.median(v for s, v in _history(uri, rid, "timing_s/update_actor") if s > 1),
        "staleness_mean": statistics.fmean(v for _, v in _history(uri, rid, "rollout/staleness_mean")),
        "wall_s": wall,
        "run_id": rid,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--base", default="outputs/base_model")
    args = parser.parse_args()
    from dapo_core.env import apply_quiet_env

    apply_quiet_env()  # offline and quiet, as the `dapo` CLI runs (this is called before Prefect is imported)
    require_base_and_data(args.base)
    OUT.mkdir(parents=True, exist_ok=True)
    runs = [one_run(layout, seed, args.steps, args.base) for seed in range(1, args.seeds + 1) for layout in LAYOUTS]
    by_layout = {lay: [r for r in runs if r["layout"] == lay] for lay in LAYOUTS}
    base_step = statistics.fmean(r["median_step_s"] for r in by_layout[BASELINE])
    rows = [
        "| layout | median step s (steps 2..N) | vs sync colocate | gen s | update s | staleness | held-out avg@8 |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for lay, rs in by_layout.items():
        step_s = statistics.fmean(r["median_step_s"] for r in rs)
        acc = [r["heldout_acc"] for r in rs]
        summary[lay] = {"median_step_s": step_s, "speedup_vs_sync_colocate": base_step / step_s, "heldout_acc": acc}
        rows.append(
            f"| {lay} | {step_s:.2f} | {base_step / step_s:.2f}x | "
            f"{statistics.fmean(r['median_gen_s'] for r in rs):.2f} | "
            f"{statistics.fmean(r['median_update_s'] for r in rs):.2f} | "
            f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} | "
            + ", ".join(f"{100 * a:.1f}%" for a in acc)
            + " |"
        )
    payload = {
        "recipe": "tiny-dapo",
        "steps": args.steps,
        "seeds": args.seeds,
        "base_model": args.base,
        "executor": "ray, 1 rollout worker + 1 trainer rank, 2-CPU local cluster",
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "summary": summary,
        "runs": runs,
    }
    write_results("overlap", payload, "\n".join(rows))


if __name__ == "__main__":
    main()
