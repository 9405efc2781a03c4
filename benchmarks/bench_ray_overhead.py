"""Per-step overhead of ``RayExecutor`` vs ``LocalExecutor`` at the tiny recipe's sizes (goal: < 5% of step time).

Run: ``python -m benchmarks.bench_ray_overhead`` (writes benchmarks/results/ray_overhead.json and .md).

One step = Algorithm 1 without the flow around it: generate ``gen_batch_size`` (48) prompts x n (8) with up to
64 new tokens -> score -> overlong shaping -> advantages -> keep ``train_batch_size`` (32) groups -> old
log-probs -> update (4 mini-batches) -> weight sync. The model is the tiny recipe's Qwen2 (hidden 128, 4 layers).
Both executors run the same steps with the same seeds, interleaved, so the machine's noise falls on both; the
median step of each is compared.

Every torch process runs one thread (the driver's local executor too): on a shared, oversubscribed 2-core box,
multi-threaded torch mostly measures OpenMP spin-waits, not the executor. ``ray 1x1`` (one rollout worker and
one trainer rank colocated on a 1-CPU bundle, taking turns) then does exactly the local executor's compute, so
its extra time is Ray's overhead: actor calls, object-store transfers, the reward pool's per-item streaming and
the weight copy of the sync. ``ray 2x2`` (two of each, one bundle per CPU) shows data parallelism on 2 cores.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_results
from dapo_core.algorithm import group_advantages, overlong_penalty
from dapo_core.config import load_config
from dapo_core.distributed import RayExecutor, connect, shutdown
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.executor import Executor, LocalExecutor, sampling_from
from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.seeding import derive_seed

STEPS, WARMUP = 3, 1
PHASES = ("gen", "reward", "old_log_prob", "update_actor", "sync_weights")


def build_model(cfg: Any, path: Path) -> str:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, **cfg.model.tiny.model_dump(), seed=0)
    return str(save_hf_dir(model, tok, path))


def problems(n: int) -> list[tuple[str, str]]:
    gen = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, 100, (n, 2), generator=gen).tolist()
    return [(f"Q: {a}+{b}\n", str(a + b)) for a, b in pairs]


def timed(times: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    times[name] = time.perf_counter() - t0
    return out


def step(ex: Executor, step_no: int, data: list[tuple[str, str]]) -> dict[str, float]:
    """One DAPO step through ``ex``; returns seconds per phase (timing_s/* names) and the total."""
    cfg, tok, times = ex.cfg, ex.tokenizer, {}
    t0 = time.perf_counter()
    prompts = [tok.encode(q) for q, _ in data]
    sampling = sampling_from(cfg, seed=derive_seed(cfg.trainer.seed, step_no, 0))
    results = timed(times, "gen", lambda: ex.generate(prompts, sampling))
    truths = [data[r.prompt_index][1] for r in results]
    scored = timed(times, "reward", lambda: ex.score([r.text for r in results], truths))
    ov = cfg.algorithm.overlong
    lengths = torch.tensor([r.response_length for r in results])
    rewards = torch.tensor([s["score"] for s in scored.results]) + overlong_penalty(
        lengths, max_response_length=cfg.data.max_response_length, buffer_length=ov.buffer_length
    )
    keep = cfg.data.train_batch_size * cfg.rollout.n  # the first train_batch_size groups, as after filtering
    gids = [r.prompt_index for r in results][:keep]
    batch = build_policy_batch(
        [r.prompt_ids for r in results[:keep]],
        [r.response_ids for r in results[:keep]],
        pad_token_id=tok.pad_token_id,
        group_ids=gids,
        advantages=group_advantages(rewards[:keep], gids),
    )
    batch.old_log_probs, _ = timed(times, "old_log_prob", lambda: ex.compute_log_probs(batch))
    timed(times, "update_actor", lambda: ex.update(batch))
    timed(times, "sync_weights", ex.sync_weights)
    times["step"] = time.perf_counter() - t0
    return times


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def compare(cfg: Any, data: list[tuple[str, str]], label: str) -> dict[str, Any]:
    local = LocalExecutor(cfg)
    t0 = time.perf_counter()
    remote = RayExecutor(cfg)
    startup = time.perf_counter() - t0
    runs: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    try:
        for s in range(WARMUP + STEPS):
            for name, ex in (("local", local), ("ray", remote)):
                times = step(ex, s, data)
                if s >= WARMUP:
                    runs[name].append(times)
    finally:
        remote.shutdown()
    med_local, med_ray = medians(runs["local"]), medians(runs["ray"])
    overhead = (med_ray["step"] - med_local["step"]) / med_local["step"]
    return {
        "config": label,
        "startup_s": round(startup, 2),
        "local_s": {k: round(v, 4) for k, v in med_local.items()},
        "ray_s": {k: round(v, 4) for k, v in med_ray.items()},
        "overhead_frac": round(overhead, 4),
        "local_steps_s": [round(r["step"], 3) for r in runs["local"]],
        "ray_steps_s": [round(r["step"], 3) for r in runs["ray"]],
    }


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        base = load_config(recipe="tiny-dapo", env={})
        model_path = build_model(base, Path(tmp) / "model")
        data = problems(base.data.gen_batch_size)
        cases = []
        for label, (workers, world) in {"ray 1x1": (1, 1), "ray 2x2": (2, 2)}.items():
            cfg = load_config(
                recipe="tiny-dapo",
                overrides=[
                    f"model.path={model_path}",
                    "resources.executor=ray",
                    f"resources.num_cpus={max(workers, world)}",  # one CPU (and torch thread) per bundle
                    f"resources.rollout_workers={workers}",
                    f"resources.trainer_world_size={world}",
                ],
                env={},
            )
            connect(cfg.resources)
            try:
                cases.append(compare(cfg, data, label))
            finally:
                shutdown()
    rows = [
        "| layout | local step s | ray step s | overhead | " + " | ".join(f"ray-local {p} s" for p in PHASES) + " |"
    ]
    rows.append("|---" * (4 + len(PHASES)) + "|")
    for c in cases:
        deltas = " | ".join(f"{c['ray_s'][p] - c['local_s'][p]:+.3f}" for p in PHASES)
        rows.append(
            f"| {c['config']} | {c['local_s']['step']:.2f} | {c['ray_s']['step']:.2f} | "
            f"{100 * c['overhead_frac']:+.1f}% | {deltas} |"
        )
    payload = {
        "recipe": "tiny-dapo",
        "gen_batch": f"{base.data.gen_batch_size} prompts x {base.rollout.n}",
        "train_batch_groups": base.data.train_batch_size,
        "max_new_tokens": base.data.max_response_length,
        "steps_measured": STEPS,
        "torch_threads_per_process": 1,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "goal": "overhead < 5% of step time (ray 1x1)",
        "cases": cases,
    }
    write_results("ray_overhead", payload, "\n".join(rows))


if __name__ == "__main__":
    main()
