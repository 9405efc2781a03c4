"""Side by side with TRL's GRPOTrainer: time per RL step and held-out accuracy after the same steps, one sitting.

Run: ``python -m benchmarks.bench_trl [--steps 16] [--rounds 2] [--set rollout.hf_decode=static]`` (writes
benchmarks/results/trl.json and .md; models, logs and the MLflow store go to outputs/bench-trl/). Needs the curated
data and the base model (``make run``, or ``dapo curate`` + ``dapo base-model``), or ``--base DIR``. TRL runs in
its own virtualenv, ``.venv-trl``, which this benchmark creates with pinned versions when it is missing (TRL is
never a project dependency; ~1 min and ~2 GB).

Both sides train the same base model on the same curated prompts with the same settings: 32 prompts x 8 samples
per RL step (256 completions), 2 optimizer updates per generation batch, up to 80 new tokens, temperature 1.0 and
no top-k/top-p, constant lr with no warm-up, grad-norm clip 1.0, clip 0.2 / 0.28, no KL, group-std advantages,
token-level loss (TRL ``loss_type="dapo"``), float32, no gradient checkpointing, the project's rule reward. Dynamic
sampling and overlong shaping are off on our side (TRL has neither); TRL keeps its fused AdamW. Threads: torch's
default on both sides (one process at a time).

Time per step: the median over steps 3..N (steps 1-2 warm up) — ours from ``perf/time_per_step`` (the flow's
whole step: rollout, reward, filter, old log-probs, advantages, updates, weight sync, logging), TRL's between the
ends of consecutive RL steps (a callback). The rounds alternate which side runs first; the figure is the mean of
the rounds' medians and every round is in the JSON. Accuracy: each side's final model of round 1 (and the base
model) evaluated by the pipeline's evaluate flow on the held-out problems, avg@8, one fixed sampling seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import require_base_and_data, write_results

OUT = Path("outputs/bench-trl")
TRL_VENV = Path(".venv-trl")
TORCH_PIN = "torch==2.13.0"
# the set that installed together beside torch 2.13.0+cpu (shared/notes/trl-baseline.md)
TRL_PINS = ["trl==1.16.0", "transformers==5.24.0", "accelerate==1.15.0", "datasets==5.2.0", "pandas", "pyarrow"]
WARMUP_STEPS = 2


def ensure_trl_venv() -> Path:
    """``.venv-trl/bin/python`` with the pinned TRL, created here when missing or different."""
    python = TRL_VENV / "bin" / "python"
    check = [str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != '1.16.0')"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {TRL_VENV} with {' '.join(TRL_PINS)} (once; ~1 min)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)  # first, so the CPU build is used (not a CUDA one)
    subprocess.run([*pip, *TRL_PINS], check=True)
    subprocess.run(check, check=True)
    return python


def settings(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {
        "model": args.base,
        "train_file": "outputs/curated/train.parquet",
        "prompts_per_step": 32,
        "n": 8,
        "updates": 2,
        "max_new_tokens": 80,
        "temperature": 1.0,
        "lr": args.lr,
        "grad_clip": 1.0,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "steps": args.steps,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
    }


def our_overrides(s: dict[str, Any], name: str, extra: list[str]) -> list[str]:
    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    return [
        f"model.path={s['model']}", f"data.train_files=[{s['train_file']}]",
        f"data.gen_batch_size={s['prompts_per_step']}", f"data.train_batch_size={s['prompts_per_step']}",
        f"rollout.n={s['n']}", f"trainer.ppo_mini_batch_size={s['prompts_per_step'] // s['updates']}",
        f"rollout.max_new_tokens={s['max_new_tokens']}", f"rollout.temperature={s['temperature']}",
        "rollout.top_p=1.0", "rollout.top_k=-1",
        "algorithm.dynamic_sampling.enable=false", "algorithm.overlong.shaping=false",
        "algorithm.overlong.filtering=false", f"algorithm.clip_low={s['clip_low']}",
        f"algorithm.clip_high={s['clip_high']}", "algorithm.loss_agg=token-mean", "algorithm.kl_coef=0.0",
        f"trainer.lr={s['lr']}", "trainer.lr_warmup_steps=0", "trainer.lr_scheduler=constant",
        f"trainer.grad_clip={s['grad_clip']}", f"trainer.total_steps={s['steps']}", f"trainer.seed={s['seed']}",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
        f"trainer.output_dir={OUT}/runs", f"tracking.uri={uri}", f"tracking.run_name={name}", *extra,
    ]  # fmt: skip


def run_ours(s: dict[str, Any], round_: int, extra: list[str]) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from flows.train import train_flow

    t0 = time.perf_counter()
    trained = train_flow(recipe="tiny-dapo", overrides=our_overrides(s, f"bench-trl-ours-r{round_}", extra))
    wall = time.perf_counter() - t0
    client = MlflowClient(tracking_uri=f"sqlite:///{OUT.resolve()}/mlflow.db")
    hist = sorted(client.get_metric_history(trained["run_id"], "perf/time_per_step"), key=lambda m: m.step)
    return {"step_s": [m.value for m in hist], "wall_s": wall, "final": str(trained["final_model"])}


def run_trl(python: Path, s: dict[str, Any], round_: int) -> dict[str, Any]:
    out = OUT / f"trl-r{round_}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(s, indent=1))
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(out / "trl.log", "w") as log:
        done = subprocess.run(
            [str(python), "-m", "benchmarks.trl_runner", "--settings", str(out / "settings.json"), "--out", str(out)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    if done.returncode != 0:
        tail = (out / "trl.log").read_text()[-3000:]
        raise SystemExit(f"TRL run failed (exit {done.returncode}); log {out / 'trl.log'}:\n{tail}")
    steps = json.loads((out / "steps.json").read_text())
    return {"step_s": steps["step_s"], "wall_s": time.perf_counter() - t0, "final": str(out / "final")}


def evaluate(model: str, name: str) -> float:
    from flows.evaluate import evaluate_flow

    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    ev = evaluate_flow(
        recipe="tiny-dapo", overrides=[f"tracking.uri={uri}"], model=model, metrics_path=None, run_name=name
    )
    return float(ev["mean_acc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="RL steps per run (steps 1-2 are warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs both sides)")
    parser.add_argument("--lr", type=float, default=1e-4, help="constant learning rate of both sides")
    parser.add_argument("--seed", type=int, default=42, help="training seed of both sides")
    parser.add_argument("--base", default="outputs/base_model")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="an override for our side")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps {args.steps}: need more than the {WARMUP_STEPS} warm-up steps")
    from dapo_core.env import apply_quiet_env

    apply_quiet_env()  # offline and quiet, as the `dapo` CLI runs (before Prefect is imported)
    require_base_and_data(args.base)
    OUT.mkdir(parents=True, exist_ok=True)
    python = ensure_trl_venv()
    s = settings(args)
    rounds = []
    for r in range(1, args.rounds + 1):
        order = ["trl", "ours"] if r % 2 else ["ours", "trl"]
        got = {side: run_trl(python, s, r) if side == "trl" else run_ours(s, r, args.extra) for side in order}
        for side in order:
            got[side]["median_step_s"] = statistics.median(got[side]["step_s"][WARMUP_STEPS:])
        rounds.append({"round": r, "order": order, **got})
        print(f"round {r}: ours {got['ours']['median_step_s']:.2f} s/step, TRL {got['trl']['median_step_s']:.2f}")
    ours_s = statistics.fmean(r["ours"]["median_step_s"] for r in rounds)
    trl_s = statistics.fmean(r["trl"]["median_step_s"] for r in rounds)
    base_acc = evaluate(args.base, "bench-trl-base")
    ours_acc = evaluate(rounds[0]["ours"]["final"], "bench-trl-ours")
    trl_acc = evaluate(rounds[0]["trl"]["final"], "bench-trl-trl")
    payload = {
        "ours_s_per_step": round(ours_s, 3),
        "trl_s_per_step": round(trl_s, 3),
        "ratio_ours_to_trl": round(ours_s / trl_s, 3),
        "ours_val_acc": ours_acc,
        "trl_val_acc": trl_acc,
        "base_val_acc": base_acc,
        "steps": args.steps,
        "warmup_steps_excluded": WARMUP_STEPS,
        "settings": s,
        "our_extra_overrides": args.extra,
        "trl_versions": TRL_PINS,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "rounds": rounds,
    }
    extra = f" (ours with {', '.join(args.extra)})" if args.extra else ""
    ours_rounds = ", ".join(f"{r['ours']['median_step_s']:.2f}" for r in rounds)
    trl_rounds = ", ".join(f"{r['trl']['median_step_s']:.2f}" for r in rounds)
    table = "\n".join(
        [
            f"Side by side with TRL {TRL_PINS[0].split('==')[1]} GRPOTrainer{extra}: {args.steps} RL steps of 32 "
            f"prompts x 8, 2 updates each, lr {args.lr}, {s['threads']} torch threads; median step time over steps "
            f"{WARMUP_STEPS + 1}..{args.steps}, mean of {args.rounds} alternating rounds. Written by "
            "`python -m benchmarks.bench_trl`.",
            "",
            "| side | s / RL step | rounds | held-out avg@8 after the run |",
            "|---|---:|---|---:|",
            f"| dapo-flow | {ours_s:.2f} | {ours_rounds} | {100 * ours_acc:.1f}% |",
            f"| TRL GRPOTrainer | {trl_s:.2f} | {trl_rounds} | {100 * trl_acc:.1f}% |",
            f"| base model | | | {100 * base_acc:.1f}% |",
            "",
            f"ours / TRL time per step: **{ours_s / trl_s:.2f}x** (goal <= 0.7x).",
        ]
    )
    write_results("trl", payload, table)


if __name__ == "__main__":
    main()
