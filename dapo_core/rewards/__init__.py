"""Rule-based verifiers: pure Python, time-bounded without signals, never evaluating text as code.

- ``math_dapo_score``: the DAPO "Answer:" rule, bit-compatible with the reference scorer (verl ``math_dapo``).
- ``boxed_score``: the same normalisation applied to the last ``\\boxed{...}``.
- ``get_reward_fn`` / ``register_reward`` / ``available_rewards``: the reward registry.
- ``score_batch``: score a batch with per-item error guarding; returns ``ScoredBatch(results, num_failed)``.
"""

from dapo_core.rewards.boxed import boxed_score
from dapo_core.rewards.math_dapo import math_dapo_score, normalize_final_answer
from dapo_core.rewards.registry import (
    ScoredBatch,
    available_rewards,
    get_reward_fn,
    register_reward,
    score_batch,
)

__all__ = [
    "ScoredBatch",
    "available_rewards",
    "boxed_score",
    "get_reward_fn",
    "math_dapo_score",
    "normalize_final_answer",
    "register_reward",
    "score_batch",
]
