"""Overlong reward shaping (DAPO Sec. 3.4).

Soft overlong punishment, DAPO Eq. 13, with L_max = max_response_length and L_cache = buffer_length:

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                   if |y| > L_max
(times ``penalty_factor``), added to the rule-based correctness reward.

Overlong filtering (Sec. 3.4, first paragraph) instead masks truncated samples out of the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    lengths: Tensor,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """Soft length penalty per response (DAPO Eq. 13). lengths (N,) ints -> (N,) float, all <= 0.

    ``lengths`` count response tokens as generated (EOS included when one was produced, as verl's
    ``valid_response_length``).
    """
    if buffer_length <= 0:
        raise ValueError(f"buffer_length (L_cache) must be > 0, got {buffer_length}")
    if buffer_length >= max_response_length:
        raise ValueError(
            f"buffer_length ({buffer_length}) must be < max_response_length ({max_response_length}): "
            "the penalty would start before any token"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths_f = lengths.to(torch.float32)  # (N,)
    expected = float(max_response_length - buffer_length)  # L_max - L_cache
    ramp = (expected - lengths_f) / float(buffer_length)  # (N,) linear part, in (-1, 0] inside the buffer
    penalty = torch.clamp(ramp, min=-1.0, max=0.0)  # 0 before the buffer, -1 at and past L_max
    return penalty * penalty_factor


def overlong_filter_mask(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the loss mask of truncated responses (overlong filtering). (N, T), (N,) bool -> (N, T)."""
    if truncated.shape[0] != response_mask.shape[0]:
        raise ValueError(f"truncated has {truncated.shape[0]} rows, response_mask has {response_mask.shape[0]}")
    keep = (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)  # (N, 1)
    return response_mask * keep
