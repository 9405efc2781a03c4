"""Contiguous, near-equal ranges: how a batch of prompts or reward items is cut across workers (no torch here,
so the reward workers stay light)."""

from __future__ import annotations


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(n)``; sizes differ by at most one, larger
    first (so a shard's ``start`` is the global index of its first item)."""
    if parts < 1:
        raise ValueError(f"parts ({parts}) must be >= 1")
    if n < 0:
        raise ValueError(f"n ({n}) must be >= 0")
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
