"""Fault injection for the reliability tests: ``DAPO_FAULT=<point>@<step>`` makes the process SIGKILL itself there.

Points (tests/reliability/test_crash_points.py kills a real `dapo train` at each and resumes it): ``rollout`` (samples
generated, not scored), ``update`` (the policy moved, nothing saved or logged), ``logging`` (half of a step's
metrics logged: with checkpoints on, while the metrics held for a just-written checkpoint are flushed),
``checkpoint`` (a checkpoint half-written: weights on disk, no trainer state, no COMPLETE marker), ``between-steps``
(a step done, its metrics held for the next checkpoint or logged, and, when due, saved). Unset (the default),
``fault_point`` costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "DAPO_FAULT"
POINTS: tuple[str, ...] = ("rollout", "update", "logging", "checkpoint", "between-steps")


def armed(point: str) -> bool:
    """Whether ``DAPO_FAULT`` names ``point`` (at any step)."""
    return os.environ.get(FAULT_ENV, "").partition("@")[0] == point


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process when ``DAPO_FAULT`` names ``point`` at ``step`` (e.g. ``DAPO_FAULT=update@3``)."""
    name, _, at = os.environ.get(FAULT_ENV, "").partition("@")
    if name == point and at.strip().isdigit() and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL)
