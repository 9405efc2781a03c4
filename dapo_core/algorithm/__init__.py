"""The pure DAPO algorithm core: tensors and explicit scalars in, (result, metrics) out. No I/O, no config."""

from dapo_core.algorithm.advantages import group_advantages, group_index, group_stats
from dapo_core.algorithm.aggregation import LOSS_AGG_MODES, agg_loss, register_loss_agg
from dapo_core.algorithm.dynamic_sampling import (
    DynamicSamplingExhausted,
    GroupAccumulator,
    dynamic_sampling_mask,
)
from dapo_core.algorithm.entropy import entropy_from_logits, log_probs_from_logits, token_probs
from dapo_core.algorithm.masked import masked_mean, masked_sum
from dapo_core.algorithm.objectives import OBJECTIVES, register_objective
from dapo_core.algorithm.overlong import overlong_filter_mask, overlong_penalty
from dapo_core.algorithm.policy_loss import policy_loss

__all__ = [
    "LOSS_AGG_MODES",
    "OBJECTIVES",
    "DynamicSamplingExhausted",
    "GroupAccumulator",
    "agg_loss",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "group_advantages",
    "group_index",
    "group_stats",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
    "register_loss_agg",
    "register_objective",
    "token_probs",
]
