"""Helpers for benchmarks: timing side by side, machine facts, result files (JSON + markdown)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from dapo_core.engines.batch import PolicyBatch, build_policy_batch

RESULTS = Path(__file__).parent / "results"


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file (None off Linux or when absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """The facts every result JSON records (``benchmarks/summary.py`` compares them across suites)."""
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")  # "131072000 kB"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def best_of(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Minimum wall time of ``repeats`` runs after ``warmup`` runs (min is the least noisy estimator)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_gflops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """This machine's dense matmul throughput (the roofline MFU is measured against)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    t = best_of(lambda: a @ b, repeats=repeats, warmup=2)
    return 2 * n**3 / t / 1e9


def write_results(name: str, payload: dict[str, Any], table: str) -> Path:
    """``results/<name>.json`` (payload + benchmark name, machine facts and the ``written`` local time, ISO 8601:
    the summary's date) and ``results/<name>.md`` (``table``)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    written = datetime.now().isoformat(timespec="seconds")
    payload = {"benchmark": name, "machine": machine(), "written": written, **payload}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)
    return out


def random_policy_batch(
    *, groups: int, g: int, prompt_len: int, resp_len: int, vocab: int, pad: int = 0, seed: int = 0
) -> PolicyBatch:
    """``groups`` prompts x ``g`` responses of random tokens (lengths resp_len/2..resp_len), with advantages: the
    seeded batch the update benchmarks time (callers add ``old_log_probs`` when they need them)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, gids = [], [], []
    for k in range(groups):
        prompt = torch.randint(5, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(g):
            n = int(torch.randint(resp_len // 2, resp_len + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(5, vocab, (n,), generator=gen).tolist())
            gids.append(k)
    batch = build_policy_batch(prompts, responses, pad_token_id=pad, group_ids=gids)
    batch.advantages = torch.randn(len(prompts), generator=gen)  # (N,)
    batch.old_log_probs = -3.0 + 0.1 * torch.randn(batch.response_mask.shape, generator=gen)  # (N, T)
    return batch


def require_base_and_data(base: str | Path) -> None:
    """Exit with the fix when the base model or the curated data a training benchmark starts from is missing."""
    from benchmarks.suites import CURATED_FILES, PREPARE_FIX

    if not (Path(base) / "config.json").is_file():
        raise SystemExit(f"{base}: no base model (config.json): {PREPARE_FIX}")
    for f in CURATED_FILES:
        if not Path(f).is_file():
            raise SystemExit(f"{f} is missing: {PREPARE_FIX}")
