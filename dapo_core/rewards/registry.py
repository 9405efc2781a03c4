"""Registry of reward functions ``(completion, ground_truth) -> {"score", "acc", "pred"}`` and a guarded batch
scorer.

Registered: ``"math_dapo"`` (the DAPO "Answer:" rule), ``"boxed"`` (last ``\\boxed{}``), and ``"math_verify"``
only when the optional ``math_verify`` package is importable (checked lazily, on lookup; never required).

Usage::

    fn = get_reward_fn("math_dapo")
    batch = score_batch("math_dapo", completions, ground_truths)
    results, num_failed = batch  # a NamedTuple: also batch.results / batch.num_failed
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dapo_core.rewards.boxed import boxed_score
from dapo_core.rewards.math_dapo import INVALID_PRED, TAIL_CHARS, check_str, math_dapo_score

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], dict[str, Any]]

REWARD_FNS: dict[str, RewardFn] = {}

ERROR_PRED = "[ERROR]"
"""``pred`` of an item whose reward function raised (see ``score_batch``)."""

MATH_VERIFY = "math_verify"


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``.

    Re-registering the same function under the same name is a no-op (module reloads); another function under a
    taken name raises ValueError.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be a non-empty str, got {name!r}")

    def deco(fn: RewardFn) -> RewardFn:
        existing = REWARD_FNS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"reward {name!r} is already registered to {existing.__qualname__}; pick another name")
        REWARD_FNS[name] = fn
        return fn

    return deco


def _math_verify_score(completion: str, ground_truth: str) -> dict[str, Any]:
    """``math_verify`` (HF Math-Verify) symbolic equivalence on the last ``TAIL_CHARS`` chars; +1.0 / -1.0.

    Its signal-based timeouts are disabled (``None``): SIGALRM does nothing off the main thread and breaks Ray
    workers. The tail cut bounds the input, not sympy's time; use it for evaluation, not hostile text.
    """
    import math_verify  # optional dependency, present when this function is registered

    check_str("completion", completion)
    check_str("ground_truth", ground_truth)
    gold = math_verify.parse(ground_truth, parsing_timeout=None)
    answer = math_verify.parse(completion[-TAIL_CHARS:], parsing_timeout=None)
    acc = bool(gold and answer and math_verify.verify(gold, answer, timeout_seconds=None))
    # parse() returns [sympy expression, extracted string] on success, [] when nothing is found.
    pred = str(answer[-1]) if answer else INVALID_PRED
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _math_verify_importable() -> bool:
    try:
        return importlib.util.find_spec(MATH_VERIFY) is not None
    except (ImportError, ValueError):  # ValueError: a sys.modules entry without __spec__
        return False


def _register_optional() -> None:
    """Register ``math_verify`` the first time it is looked up while the package is importable."""
    if MATH_VERIFY not in REWARD_FNS and _math_verify_importable():
        register_reward(MATH_VERIFY)(_math_verify_score)


def available_rewards() -> list[str]:
    """Sorted names of the registered reward functions (``math_verify`` included when importable)."""
    _register_optional()
    return sorted(REWARD_FNS)


def get_reward_fn(name: str) -> RewardFn:
    """Return the reward function registered as ``name``; unknown names raise ValueError listing valid ones."""
    _register_optional()
    try:
        return REWARD_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FNS))} "
            f"(math_verify needs `pip install math-verify`)"
        ) from None


class ScoredBatch(NamedTuple):
    """Per-item results of ``score_batch`` and how many items failed (their reward function raised)."""

    results: list[dict[str, Any]]
    num_failed: int


def score_batch(name: str, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch:
    """Score ``completions[i]`` against ``ground_truths[i]`` with the reward function ``name``.

    Each item is guarded: an exception from the reward function (a bad item, e.g. a non-str ground truth)
    becomes ``{"score": -1.0, "acc": False, "pred": "[ERROR]"}`` with a logged warning, and is counted in
    ``num_failed`` so callers can log it; one bad item never fails the batch.

    Returns:
        ``ScoredBatch(results, num_failed)`` (a NamedTuple, so ``results, num_failed = score_batch(...)``).

    Raises:
        ValueError: unknown ``name``, or the two sequences differ in length.
    """
    fn = get_reward_fn(name)
    if len(completions) != len(ground_truths):
        raise ValueError(
            f"completions ({len(completions)}) and ground_truths ({len(ground_truths)}) must have the same "
            f"length: pass one ground truth per completion (repeat a prompt's answer for each of its G samples)"
        )
    results: list[dict[str, Any]] = []
    num_failed = 0
    for i, (completion, ground_truth) in enumerate(zip(completions, ground_truths, strict=True)):
        try:
            results.append(fn(completion, ground_truth))
        except Exception as exc:  # guard: one bad item must not fail a training step
            num_failed += 1
            logger.warning("reward %r failed on item %d: %s: %s", name, i, type(exc).__name__, exc)
            results.append({"score": -1.0, "acc": False, "pred": ERROR_PRED})
    return ScoredBatch(results, num_failed)


register_reward("math_dapo")(math_dapo_score)
register_reward("boxed")(boxed_score)
