"""Masked reductions: every masked reduction in the project goes through these two functions.

Shape legend: N responses (= B*G), T response tokens.
"""

from __future__ import annotations

from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (mask may be bool or float 0/1)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum()
    return (values * mask).sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set; 0 where nothing is masked in.

    Returning 0 for an empty mask (instead of NaN) keeps metrics finite when, e.g., overlong filtering removed
    every token of a micro-batch.
    """
    mask = mask.to(values.dtype)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1.0)
