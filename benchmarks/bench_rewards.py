"""Per-item latency of the reward functions on typical completions and on hostile inputs.

Run::

    .venv/bin/python -m benchmarks.bench_rewards          # writes benchmarks/results/rewards.json (+ rewards.md)
    .venv/bin/python -m benchmarks.bench_rewards --quick  # fewer repetitions

Every class is timed item by item (``time.perf_counter_ns`` around one call); the JSON holds median, p99 and max
in microseconds per reward function and input class. Informational only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import write_results
from dapo_core.rewards import get_reward_fn

REWARDS = ["math_dapo", "boxed"]
FIVE_MB = 5 * 1024 * 1024

_WORDS = ["so", "we", "let", "x", "be", "the", "value", "then", "it", "follows", "that", "since", "and",
          "therefore", "check", "again", "wait"]  # fmt: skip
_FINALS = [
    "Answer: {n}",
    "Answer: $\\boxed{{{n}}}$",
    "Answer: {n} degrees",
    "Answer: \\frac{{{n}}}{{7}}",
    "the answer is \\boxed{{{n}}}.",  # no "Answer:" line: invalid for math_dapo
]


def typical_items(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Synthetic completions of 0.5-8 KB of reasoning-like text ending in one of a few answer forms."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        n = rng.randint(-10_000, 10_000)
        words = rng.choices(_WORDS, k=rng.randint(100, 1600))
        body = " ".join(words).replace("again", "again.\n")
        final = rng.choice(_FINALS).format(n=n)
        truth = str(n) if rng.random() < 0.7 else str(n + 1)
        items.append((f"{body}\n{final}", truth))
    return items


def hostile_items() -> dict[str, tuple[str, str]]:
    """One (completion, ground_truth) pair per hostile class; the last two attack the ground truth."""
    return {
        "5mb_text": ("lorem ipsum " * (FIVE_MB // 12) + "\nAnswer: 42", "42"),
        "5mb_answer_lines": ("Answer: 1\n" * (FIVE_MB // 10), "1"),
        "nested_braces_100k": ("\\boxed{" + "{" * 100_000 + "}" * 100_001, "42"),
        "boxed_openers_100k": ("\\boxed{" * 100_000, "42"),
        "nul_bytes_5mb": ("\x00" * FIVE_MB + "Answer: 4\x002", "4\x002"),
        "huge_number_1m_digits": ("Answer: " + "9" * 1_000_000, "9" * 1_000_000),
        "unicode_5mb": ("Ａｎｓｗｅｒ：４２ 🤖" * (FIVE_MB // 11) + "\nAnswer: ٤٢", "٤٢"),
        "gt_5mb_one_dollar_line": ("Answer: 42", "$" + "x" * FIVE_MB),
        "gt_text_openers_1m": ("Answer: 42", "\\text{\n" * 1_000_000 + "}"),
    }


def _stats(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "n": len(ordered),
        "median_us": round(statistics.median(ordered) / 1e3, 2),
        "p99_us": round(p99 / 1e3, 2),
        "max_us": round(ordered[-1] / 1e3, 2),
    }


def _time_items(fn: Callable[[str, str], dict[str, Any]], items: list[tuple[str, str]]) -> dict[str, float]:
    samples = []
    for completion, ground_truth in items:
        start = time.perf_counter_ns()
        fn(completion, ground_truth)
        samples.append(time.perf_counter_ns() - start)
    return _stats(samples)


def run(typical_count: int = 2000, hostile_repeats: int = 10) -> dict[str, Any]:
    """Time every reward in ``REWARDS`` on ``typical_count`` typical items and each hostile class."""
    typical = typical_items(typical_count)
    hostile = hostile_items()
    results: dict[str, Any] = {}
    for name in REWARDS:
        fn = get_reward_fn(name)
        per_class = {"typical": _time_items(fn, typical)}
        for cls, item in hostile.items():
            per_class[cls] = _time_items(fn, [item] * hostile_repeats)
        results[name] = per_class
    return {
        "unit": "microseconds per item",
        "typical_count": typical_count,
        "hostile_repeats": hostile_repeats,
        "rewards": results,
    }


def markdown_table(report: dict[str, Any]) -> str:
    """Render ``run()``'s report as a markdown table."""
    lines = ["| reward | input class | n | median µs | p99 µs | max µs |", "|---|---|---:|---:|---:|---:|"]
    for name, per_class in report["rewards"].items():
        for cls, s in per_class.items():
            lines.append(
                f"| {name} | {cls} | {s['n']} | {s['median_us']:.1f} | {s['p99_us']:.1f} | {s['max_us']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 typical items, 3 repeats per hostile class")
    args = parser.parse_args([] if argv is None else argv)
    report = run(200, 3) if args.quick else run()
    write_results("rewards", report, markdown_table(report))


if __name__ == "__main__":
    main(sys.argv[1:])
