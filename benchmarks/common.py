"""Helpers for benchmarks: timing side by side, machine facts, result files (JSON + markdown)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
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
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), **payload}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)
    return out
