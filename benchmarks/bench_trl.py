"""Side by side with TRL's GRPOTrainer: time per RL step and held-out accuracy after the same steps, one sitting.

Run: ``python -m benchmarks.bench_trl [--steps 16] [--rounds 2]`` (writes
benchmarks/results/trl.json and .md; models, logs and the MLflow store go to outputs/bench-trl/). Needs the curated
data and the base model (``make run``, or ``dapo curate`` + ``dapo base-model``), or ``--base DIR``. TRL runs in
its own virtualenv, ``.venv-trl``, which this benchmark creates with pinned versions when it is missing (TRL is
never a project dependency; ~1 min and ~2 GB).

Three sides, each round in a rotated order: TRL's GRPOTrainer (transformers' ``generate``), ours with the same
decode path (``rollout.hf_decode=generate``: the framework against the framework) and ours as shipped (the recipe's
static-KV-cache decode loop). The settings live in ``benchmarks.trl_settings`` and a test compares both sides key by
key. All sides train the same base model on the same curated prompts with the same settings: 32 prompts x 8 samples
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
from benchmarks.trl_settings import KNOWN_DIFFERENCES, SIDES, our_overrides

OUT = Path("outputs/bench-trl")
TRL_VENV = Path(".venv-trl")
TORCH_PIN = "torch==2.13.0"
# the set that installed together beside torch 2.13.0+cpu (checked when the race was set up)
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


def run_ours(s: dict[str, Any], side: str, round_: int, extra: list[str]) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from flows.train import train_flow

    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    name = f"bench-trl-{side}-r{round_}"
    sets = [*our_overrides(s, output_dir=f"{OUT}/runs", tracking_uri=uri, run_name=name), *extra]
    t0 = time.perf_counter()
    trained = train_flow(recipe="tiny-dapo", overrides=sets)
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
    parser.add_argument("--rerender", action="store_true", help="rewrite trl.md from the committed trl.json")
    args = parser.parse_args()
    if args.rerender:
        results = Path(__file__).parent / "results"
        (results / "trl.md").write_text(table(json.loads((results / "trl.json").read_text())) + "\n")
        return
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps {args.steps}: need more than the {WARMUP_STEPS} warm-up steps")
    from dapo_core.env import apply_quiet_env

    apply_quiet_env()  # offline and quiet, as the `dapo` CLI runs (before Prefect is imported)
    require_base_and_data(args.base)
    OUT.mkdir(parents=True, exist_ok=True)
    python = ensure_trl_venv()
    s = settings(args)
    names = list(SIDES)
    rounds = []
    for r in range(1, args.rounds + 1):
        order = names[(r - 1) % len(names) :] + names[: (r - 1) % len(names)]  # each side goes first in turn
        got = {}
        for side in order:
            extra = SIDES[side][2]
            got[side] = run_trl(python, s, r) if extra is None else run_ours(s, side, r, [*extra, *args.extra])
            got[side]["median_step_s"] = statistics.median(got[side]["step_s"][WARMUP_STEPS:])
        rounds.append({"round": r, "order": order, **got})
        print(f"round {r}: " + ", ".join(f"{k} {v['median_step_s']:.2f} s/step" for k, v in got.items()), flush=True)
    per_step = {k: statistics.fmean(r[k]["median_step_s"] for r in rounds) for k in names}
    acc = {"base": evaluate(args.base, "bench-trl-base")}
    acc.update({k: evaluate(rounds[0][k]["final"], f"bench-trl-{k}") for k in names})
    record = payload(args, s, rounds, per_step, acc)
    write_results("trl", record, table(record))


def side_record(k: str, per_step: dict, acc: dict) -> dict[str, Any]:
    label, decode, extra = SIDES[k]
    return {
        "label": label,
        "decode": decode,
        "overrides": extra,
        "s_per_step": round(per_step[k], 3),
        "ratio_to_trl": round(per_step[k] / per_step["trl"], 3),
        "val_acc": acc[k],
    }


def payload(args: argparse.Namespace, s: dict, rounds: list, per_step: dict, acc: dict) -> dict[str, Any]:
    trl = per_step["trl"]
    return {
        "sides": {k: side_record(k, per_step, acc) for k in SIDES},
        "ratio_ours_to_trl": round(per_step["ours-static"] / trl, 3),  # as shipped
        "ratio_generate_to_trl": round(per_step["ours-generate"] / trl, 3),  # the same decode path
        "ours_s_per_step": round(per_step["ours-static"], 3),
        "trl_s_per_step": round(trl, 3),
        "ours_val_acc": acc["ours-static"],
        "trl_val_acc": acc["trl"],
        "base_val_acc": acc["base"],
        "steps": args.steps,
        "warmup_steps_excluded": WARMUP_STEPS,
        "settings": s,
        "known_differences": KNOWN_DIFFERENCES,
        "our_extra_overrides": args.extra,
        "trl_versions": TRL_PINS,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "rounds": rounds,
    }


def table(d: dict[str, Any]) -> str:
    """The markdown of a ``payload`` (also ``--rerender`` from trl.json)."""
    s, rounds, sides = d["settings"], d["rounds"], d["sides"]
    extra = f" (ours also with {', '.join(d['our_extra_overrides'])})" if d["our_extra_overrides"] else ""
    lines = [
        f"Side by side with TRL {d['trl_versions'][0].split('==')[1]} GRPOTrainer{extra}, one sitting: {d['steps']} RL "
        f"steps of {s['prompts_per_step']} prompts x {s['n']}, {s['updates']} updates each, lr {s['lr']}, "
        f"{s['threads']} torch threads; median step time over steps {d['warmup_steps_excluded'] + 1}..{d['steps']}, "
        f"mean of {len(rounds)} rounds, each side first in turn. Written by `python -m benchmarks.bench_trl`; the "
        "settings of the sides are compared key by key by `tests/test_trl_settings.py`.",
        "",
        "| side | decode path | s / RL step | rounds | / TRL | / TRL per round | held-out avg@8 after the run |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for k, side in sides.items():
        runs = ", ".join(f"{r[k]['median_step_s']:.2f}" for r in rounds)
        per_round = ", ".join(f"{r[k]['median_step_s'] / r['trl']['median_step_s']:.2f}x" for r in rounds)
        lines.append(
            f"| {side['label']} | {side['decode']} | {side['s_per_step']:.2f} | {runs} | {side['ratio_to_trl']:.2f}x "
            f"| {per_round} | {100 * side['val_acc']:.1f}% |"
        )
    gen, shipped = d["ratio_generate_to_trl"], d["ratio_ours_to_trl"]
    met = [name for name, ratio in (("with the same decode path", gen), ("as shipped", shipped)) if ratio <= 0.7]
    lines += [
        f"| base model | | | | | | {100 * d['base_val_acc']:.1f}% |",
        "",
        f"ours / TRL time per step: **{gen:.2f}x** with the same decode path (`generate`), **{shipped:.2f}x** as "
        f"shipped (static loop). Goal <= 0.7x, judged on the same decode path: "
        f"{'met ' + ' and '.join(met) if met else 'not met'} (mean of the rounds; the per-round ratios show how far "
        "one sitting moves them).",
        "",
        "Known differences: " + "; ".join(f"{k}: {v}" for k, v in d["known_differences"].items()) + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
