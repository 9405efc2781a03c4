"""Orchestration overhead: the default RL step with and without Prefect task runs, MLflow logging and Ray.

Run: ``python -m benchmarks.bench_overhead`` (needs the base model and curated data: ``make run`` first; writes
benchmarks/results/overhead.json and .md). Goal (issue 16): each layer <= 5% of the step time.

Every row runs ``flows.train_step.train_step`` (the step ``dapo train`` runs: generation batches until dynamic sampling
has filled the batch -> reward -> filter -> update -> weight sync) of the default recipe (params.yaml) from the
warm-started base model on the curated prompts. Rows of one phase run in one process, interleaved step by step
(the machine's noise falls on all of them), each with its own executor and prompt sampler from the same seeds, so
rows on the same executor kind take the same steps; the median of the measured steps is compared.

- phase ``prefect+mlflow`` (the default 2 torch threads, in-process executor): ``core`` (the tasks' plain
  functions), ``+prefect`` (each phase a Prefect task run, reported to the flow's temporary API server, as
  ``dapo train`` does), ``+prefect+mlflow`` (and the step's metrics logged to MLflow, SQLite store, with the
  system-metrics sampler on; that sampler thread runs through the whole phase, so every row of it pays its share).
- phase ``ray 1x1`` (1 torch thread): ``core`` vs the same steps through ``RayExecutor`` with one rollout worker and
  one trainer rank on a 1-CPU bundle: the same compute, so the difference is Ray's actor calls, object transfers,
  reward pool and weight copy.
- phase ``ray 2x2`` (2 CPUs): ``core`` at 2 threads vs two rollout workers and two trainer ranks, one CPU each.
  The machine-capacity probe says what 2 processes on this machine can give over one at all.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

BASE = "outputs/base_model"
PHASE_NAMES = ("prefect+mlflow", "ray 1x1", "ray 2x2")
PHASES = ("gen", "reward", "filter", "adv", "old_log_prob", "update_actor", "sync_weights")  # timing_s/* of a step


def _config(overrides: list[str]) -> Any:
    from dapo_core.config import load_config

    return load_config(config_path="params.yaml", overrides=[f"model.path={BASE}", *overrides], env={})


def _items(cfg: Any, tokenizer: Any) -> list[Any]:
    from tasks import train as T

    return T.load_prompts.fn(cfg.data.train_files, tokenizer, cfg.data.max_prompt_length, "data.train_files")


def _cpu_s() -> tuple[float, float]:
    """CPU seconds used so far by this process and by its descendants (Prefect's server, Ray's processes)."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    kids = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            kids += sum(child.cpu_times()[:2])
    return own, kids


def interleave(rows: dict[str, Any], steps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """``rows``: name -> callable running one step and returning (seconds, metrics). Round-robin, rotating which
    row goes first; returns each row's measured step times, medians, CPU seconds (this process / its descendants,
    e.g. Prefect's server or Ray's workers) and generation batches per step."""
    times: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    gen_batches: dict[str, list[int]] = {k: [] for k in rows}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in rows}
    names = list(rows)
    for r in range(warmup + steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            own0, kids0 = _cpu_s()
            secs, metrics = rows[name]()
            own1, kids1 = _cpu_s()
            print(f"  step {r + 1:2d} {name:<16} {secs:6.2f} s  gen batches {metrics['train/num_gen_batches']:.0f}")
            if r >= warmup:
                times[name].append(secs)
                cpu[name].append((own1 - own0, kids1 - kids0))
                gen_batches[name].append(int(metrics["train/num_gen_batches"]))
                phases[name].append({p: metrics.get(f"timing_s/{p}", 0.0) for p in PHASES})
    core = times[names[0]]
    out = {}
    for k in rows:
        paired = sorted(t / c for t, c in zip(times[k], core, strict=True))
        out[k] = {
            "median_s": round(statistics.median(times[k]), 4),
            "paired_ratio": round(statistics.median(paired), 4),  # vs the first row, step by step
            "paired_ratio_iqr": [round(paired[len(paired) // 4], 4), round(paired[(3 * len(paired)) // 4], 4)],
            "steps_s": [round(t, 3) for t in times[k]],
            "cpu_own_s": round(statistics.fmean(c[0] for c in cpu[k]), 3),
            "cpu_children_s": round(statistics.fmean(c[1] for c in cpu[k]), 3),
            "gen_batches": gen_batches[k],
            "phases_s": {p: round(statistics.median(x[p] for x in phases[k]), 4) for p in PHASES},
        }
    return out


def phase_prefect_mlflow(steps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    import torch
    from prefect import flow

    from benchmarks.steps import StepRunner
    from dapo_core.engines.executor import LocalExecutor
    from tasks import tracking
    from tasks.train_logging import log_step

    torch.set_num_threads(2)
    cfg = _config([f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.artifact_location={tmp}/mlartifacts"])
    runners = {name: LocalExecutor(cfg) for name in ("core", "+prefect", "+prefect+mlflow")}
    items = _items(cfg, runners["core"].tokenizer)
    steppers = {name: StepRunner(ex, cfg, items) for name, ex in runners.items()}

    def logged() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        _, metrics = steppers["+prefect+mlflow"].step(with_tasks=True)
        log_step(metrics, steppers["+prefect+mlflow"].step_no)
        return time.perf_counter() - t0, metrics

    @flow(name="bench-overhead", log_prints=False)
    def measure() -> dict[str, dict[str, Any]]:
        with tracking.start_run(cfg, run_name="bench-overhead"):
            tracking.log_params_flat(cfg)
            return interleave(
                {
                    "core": lambda: steppers["core"].step(with_tasks=False),
                    "+prefect": lambda: steppers["+prefect"].step(with_tasks=True),
                    "+prefect+mlflow": logged,
                },
                steps,
                warmup,
            )

    return {"torch_threads": 2, "executor": "local", "rows": measure()}


def phase_ray(label: str, workers: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from benchmarks.steps import StepRunner
    from dapo_core.distributed import RayExecutor, connect, shutdown
    from dapo_core.engines.executor import LocalExecutor

    torch.set_num_threads(workers)  # the local row gets the CPUs the Ray layout gets
    ray_cfg = _config(
        [
            "resources.executor=ray",
            f"resources.num_cpus={workers}",
            f"resources.rollout_workers={workers}",
            f"resources.trainer_world_size={workers}",
        ]
    )
    local_cfg = _config([])
    local = LocalExecutor(local_cfg)
    items = _items(local_cfg, local.tokenizer)
    connect(ray_cfg.resources)
    try:
        t0 = time.perf_counter()
        remote = RayExecutor(ray_cfg)
        startup = time.perf_counter() - t0
        try:
            a, b = StepRunner(local, local_cfg, items), StepRunner(remote, ray_cfg, items)
            rows = interleave(
                {"core": lambda: a.step(with_tasks=False), label: lambda: b.step(with_tasks=False)}, steps, warmup
            )
        finally:
            remote.shutdown()
    finally:
        shutdown()
    return {"torch_threads": workers, "ray_startup_s": round(startup, 2), "rows": rows}


def _spin(n: int, start: Any, out: Any) -> None:
    """A fixed torch workload at one thread (the tiny policy's forward+backward), timed after ``start``."""
    import torch

    from dapo_core.engines.models import build_tiny_qwen2
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    torch.set_num_threads(1)
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, seed=0)
    ids = torch.randint(5, len(tok), (32, 96), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.sum().backward()  # warm-up
    start.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        model(input_ids=ids).logits.sum().backward()
    out.put(time.perf_counter() - t0)


def capacity(n: int = 20) -> dict[str, float]:
    """How much two single-thread processes get done side by side on this machine, against one alone."""
    ctx = mp.get_context("spawn")

    def run(k: int) -> list[float]:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(n, start, out)) for _ in range(k)]
        for p in procs:
            p.start()
        time.sleep(8.0)  # every process imported torch and built its model
        start.set()
        times = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        return times

    alone = min(run(1)[0] for _ in range(2))
    pair = max(run(2))
    return {"one_process_s": round(alone, 3), "two_processes_s": round(pair, 3), "speedup": round(2 * alone / pair, 3)}


def _frac(rows: dict[str, Any], name: str, base: str = "core") -> float:
    """``name``'s step time over ``base``'s, step by step (same steps, same round), minus 1: the median."""
    return round(rows[name]["paired_ratio"] / rows[base]["paired_ratio"] - 1.0, 4)


def _cpu_frac(rows: dict[str, Any], name: str, base: str = "core") -> float:
    """The extra CPU seconds per step ``name`` costs (all processes), over ``base``'s."""
    total = {k: rows[k]["cpu_own_s"] + rows[k]["cpu_children_s"] for k in (name, base)}
    return round(total[name] / total[base] - 1.0, 4)


def main() -> None:
    from dapo_core.env import apply_quiet_env

    apply_quiet_env()  # offline and quiet, as `dapo` runs (before Prefect is imported)
    from benchmarks.common import require_base_and_data, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="measured steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--phases", default=",".join(PHASE_NAMES), help=f"comma-separated subset of {PHASE_NAMES}")
    args = p.parse_args()
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = sorted(set(phases) - set(PHASE_NAMES))
    if unknown:
        raise SystemExit(f"--phases: unknown {unknown}; choose from {', '.join(PHASE_NAMES)}")
    require_base_and_data(BASE)

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        if "prefect+mlflow" in phases:
            print("phase prefect+mlflow")
            out["prefect+mlflow"] = phase_prefect_mlflow(args.steps, args.warmup, Path(tmp))
    if "ray 1x1" in phases:
        print("phase ray 1x1")
        out["ray 1x1"] = phase_ray("ray 1x1", 1, args.steps, args.warmup)
    if "ray 2x2" in phases:
        print("phase ray 2x2")
        out["ray 2x2"] = phase_ray("ray 2x2", 2, args.steps, args.warmup)
    print("machine capacity: 2 single-thread processes vs 1")
    cap = capacity()

    summary: dict[str, float] = {}
    lines = [
        "| phase | row | torch threads | median step s | step vs core (IQR) | CPU s per step: own + children | "
        "CPU vs core | generation batches per step |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for phase, res in out.items():
        for name, row in res["rows"].items():
            lo, hi = (100 * (x - 1) for x in row["paired_ratio_iqr"])
            vs = "" if name == "core" else f"{100 * _frac(res['rows'], name):+.1f}% ({lo:+.0f}..{hi:+.0f})"
            cpu = "" if name == "core" else f"{100 * _cpu_frac(res['rows'], name):+.1f}%"
            lines.append(
                f"| {phase} | {name} | {res['torch_threads']} | {row['median_s']:.2f} | {vs} | "
                f"{row['cpu_own_s']:.2f} + {row['cpu_children_s']:.2f} | {cpu} | "
                f"{', '.join(map(str, row['gen_batches']))} |"
            )
    lines += [
        "",
        "Median seconds per step in each phase (`timing_s/*`; Prefect's and MLflow's costs fall between them):",
        "",
    ]
    lines += ["| phase | row | " + " | ".join(PHASES) + " |", "|---|---|" + "---:|" * len(PHASES)]
    for phase, res in out.items():
        for name, row in res["rows"].items():
            cells = " | ".join(f"{row['phases_s'][p]:.3f}" for p in PHASES)
            lines.append(f"| {phase} | {name} | {cells} |")
    if "prefect+mlflow" in out:
        rows = out["prefect+mlflow"]["rows"]
        summary["core_step_s"] = rows["core"]["median_s"]
        summary["prefect_frac"] = _frac(rows, "+prefect")
        summary["mlflow_frac"] = _frac(rows, "+prefect+mlflow", "+prefect")
        summary["prefect_mlflow_frac"] = _frac(rows, "+prefect+mlflow")
        summary["prefect_mlflow_cpu_frac"] = _cpu_frac(rows, "+prefect+mlflow")
    if "ray 1x1" in out:
        summary["ray_1x1_frac"] = _frac(out["ray 1x1"]["rows"], "ray 1x1")
        summary["ray_1x1_cpu_frac"] = _cpu_frac(out["ray 1x1"]["rows"], "ray 1x1")
    if "ray 2x2" in out:
        summary["ray_2x2_vs_local_frac"] = _frac(out["ray 2x2"]["rows"], "ray 2x2")
    lines.append("")
    lines.append(
        f"Machine capacity: a fixed single-thread torch workload takes {cap['one_process_s']:.2f} s alone and "
        f"{cap['two_processes_s']:.2f} s with a second copy beside it: 2 processes do {cap['speedup']:.2f}x the "
        "work of one (2.0 would be two free cores)."
    )
    payload = {
        "recipe": "params.yaml (tiny-dapo)",
        "model": BASE,
        "steps_measured": args.steps,
        "warmup_steps": args.warmup,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "goal": "each layer <= 5% of the step time",
        "phases": out,
        "capacity": cap,
        "summary": summary,
    }
    write_results("overhead", payload, "\n".join(lines))


if __name__ == "__main__":
    main()
