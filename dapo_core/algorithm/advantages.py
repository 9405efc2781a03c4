"""Group-relative outcome advantages (GRPO Eq. 3, used unchanged by DAPO Eq. 9).

    A_i = (R_i - mean({R_j}_{j in group})) / (std({R_j}) + eps)

with the unbiased (Bessel-corrected) std, as verl's ``compute_grpo_outcome_advantage``. A group of one has no
baseline: verl uses mean 0 and std 1 there, so its advantage is R / (1 + eps); we do the same.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def group_index(group_ids: Sequence[Hashable] | Tensor, device: torch.device | None = None) -> Tensor:
    """Map arbitrary hashable group ids to dense int64 indices 0..K-1 in order of first appearance. (N,)"""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        _, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.to(device=device if device is not None else group_ids.device, dtype=torch.long)
    lookup: dict[Hashable, int] = {}
    idx = [lookup.setdefault(g, len(lookup)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long, device=device)


def group_stats(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std) for scores (N,) and dense group index (N,). Each result is (K,).

    std is 0 for groups of size 1 (no spread can be measured); callers decide what that means.
    """
    num_groups = int(index.max()) + 1 if index.numel() else 0
    dtype = torch.float64  # accumulate in double: group sums of many rewards must not drift
    counts = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(
        0, index, torch.ones_like(scores, dtype=dtype)
    )  # (K,)
    sums = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, index, scores.to(dtype))
    means = sums / counts  # (K,)
    dev = scores.to(dtype) - means[index]  # (N,)
    sq = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, index, dev * dev)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1.0))  # (K,) Bessel-corrected
    std = torch.where(counts > 1, std, torch.zeros_like(std))
    return counts, means, std


def group_advantages(
    scores: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantage per response.

    Args:
        scores: (N,) float rewards, one per response.
        group_ids: N hashables (or an int tensor): responses with the same id were sampled from the same prompt.
        norm_by_std: divide by (std + eps) (GRPO/DAPO); False gives Dr. GRPO's mean-centred advantage.
        eps: added to the std.

    Returns:
        (N,) advantages in the dtype of ``scores``. Broadcast over response tokens by the caller (Eq. 9).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (N,), got shape {tuple(scores.shape)}")
    n_ids = len(group_ids)
    if n_ids != scores.shape[0]:
        raise ValueError(f"group_ids has {n_ids} entries but scores has {scores.shape[0]}")
    if scores.numel() == 0:
        return scores.clone()
    index = group_index(group_ids, device=scores.device)  # (N,)
    counts, means, std = group_stats(scores, index)  # (K,) each
    singleton = counts == 1
    # a group of one: mean 0, std 1 (verl's convention), so A = R / (1 + eps)
    means = torch.where(singleton, torch.zeros_like(means), means)
    std = torch.where(singleton, torch.ones_like(std), std)
    adv = scores.to(torch.float64) - means[index]  # (N,)
    if norm_by_std:
        adv = adv / (std[index] + eps)
    return adv.to(scores.dtype)
