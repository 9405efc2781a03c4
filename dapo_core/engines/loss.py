"""The policy loss's settings (``LossConfig``), resolved from the config's ``algorithm:`` section.

Kept apart from ``dapo_core.engines.trainer`` (which re-exports it) and free of pydantic at import: the engines run
where the config package is absent (scripts/gpu_check.py), and build a ``LossConfig`` by hand there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo_core.config import AlgorithmConfig


@dataclass(frozen=True)
class LossConfig:
    """The knobs of the policy loss, resolved from the ``algorithm:`` section (``from_config``), which holds their
    defaults (the paper's values for DAPO); no field has one here."""

    mode: str  # ppo-clip / gspo / cispo / gmpo (dapo_core.algorithm.objectives)
    clip_low: float | None  # the mode's bounds; None only for cispo (no lower bound)
    clip_high: float
    clip_c: float | None
    loss_agg: str
    norm_length: int | None  # seq-mean-token-sum-norm's constant; None = the batch's response width
    entropy_coef: float

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, *, max_response_length: int) -> LossConfig:
        """The loss of ``algorithm`` (``cfg.algorithm``): the bounds of its objective (``policy_loss``'s own
        section for the successors) and Dr. GRPO's constant (default ``max_response_length``, L_max)."""
        from dapo_core.config.algorithm import norm_length_of, objective_bounds  # pydantic: only when configured

        clip_low, clip_high = objective_bounds(algorithm)
        return cls(
            mode=algorithm.policy_loss,
            clip_low=clip_low,
            clip_high=clip_high,
            clip_c=algorithm.clip_c,
            loss_agg=algorithm.loss_agg,
            norm_length=norm_length_of(algorithm, max_response_length),
            entropy_coef=algorithm.entropy_coef,
        )
