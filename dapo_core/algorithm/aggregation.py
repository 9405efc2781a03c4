"""Loss aggregation modes: how a (N, T) matrix of per-token losses becomes one scalar.

DAPO Sec. 3.3 (Eq. 12) replaces GRPO's sample-level mean (Eq. 2, ``seq-mean-token-mean``) by a token-level mean
over the whole batch (``token-mean``), so long responses weigh in proportion to their tokens. Dr. GRPO
(arXiv 2503.20783) divides each sequence's token sum by a constant length instead (``seq-mean-token-sum-norm``).

Every mode accepts *global* denominators so that a mini-batch split into micro-batches (and data-parallel ranks)
gives exactly the gradient of the whole mini-batch when the micro-batch losses are summed:

- token-mean:               sum_{i,t} L_it m_it / global_num_tokens       (default: this call's mask sum)
- seq-mean-token-mean:      sum_i [sum_t L_it m_it / sum_t m_it] / global_num_seqs   (default: N)
- seq-mean-token-sum:       sum_i [sum_t L_it m_it] / global_num_seqs
- seq-mean-token-sum-norm:  sum_i [sum_t L_it m_it / norm_length] / global_num_seqs  (norm_length default: T)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from dapo_core.algorithm.masked import masked_mean, masked_sum


class AggFn(Protocol):
    def __call__(
        self,
        loss_mat: Tensor,
        mask: Tensor,
        *,
        global_num_tokens: float | Tensor | None,
        global_num_seqs: float | Tensor | None,
        norm_length: float | None,
    ) -> Tensor: ...


LOSS_AGG_MODES: dict[str, AggFn] = {}


def register_loss_agg(name: str) -> Callable[[AggFn], AggFn]:
    """Register an aggregation mode under ``name`` (used by ``policy_loss(loss_agg=name)``)."""

    def deco(fn: AggFn) -> AggFn:
        if name in LOSS_AGG_MODES:
            raise ValueError(f"loss aggregation mode {name!r} is already registered")
        LOSS_AGG_MODES[name] = fn
        return fn

    return deco


def _denominator(value: float | Tensor | None, default: Tensor) -> Tensor:
    # A zero denominator only happens when every token is masked out; the numerator is then 0 as well, so
    # clamping to 1 yields a zero loss (and zero gradient) instead of NaN.
    if value is None:
        return default.clamp(min=1.0)
    if isinstance(value, Tensor):
        return value.to(default.dtype).clamp(min=1.0)
    if value < 0:
        raise ValueError(f"a global denominator must be >= 0, got {value}")
    return torch.as_tensor(float(value), dtype=default.dtype, device=default.device).clamp(min=1.0)


@register_loss_agg("token-mean")
def _token_mean(loss_mat, mask, *, global_num_tokens, global_num_seqs, norm_length):  # type: ignore[no-untyped-def]
    # DAPO Eq. 12: 1 / sum_i |o_i| * sum_i sum_t L_it
    mask_f = mask.to(loss_mat.dtype)
    return masked_sum(loss_mat, mask_f) / _denominator(global_num_tokens, mask_f.sum())


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, *, global_num_tokens, global_num_seqs, norm_length):  # type: ignore[no-untyped-def]
    # GRPO Eq. 2: 1/G sum_i 1/|o_i| sum_t L_it
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # (N,)
    n = torch.tensor(float(loss_mat.shape[0]), dtype=loss_mat.dtype, device=loss_mat.device)
    return seq_losses.sum() / _denominator(global_num_seqs, n)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, *, global_num_tokens, global_num_seqs, norm_length):  # type: ignore[no-untyped-def]
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (N,)
    n = torch.tensor(float(loss_mat.shape[0]), dtype=loss_mat.dtype, device=loss_mat.device)
    return seq_losses.sum() / _denominator(global_num_seqs, n)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, *, global_num_tokens, global_num_seqs, norm_length):  # type: ignore[no-untyped-def]
    # Dr. GRPO: each sequence's token sum divided by one constant length, so no length bias.
    length = float(loss_mat.shape[-1]) if norm_length is None else float(norm_length)
    if length <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / length  # (N,)
    n = torch.tensor(float(loss_mat.shape[0]), dtype=loss_mat.dtype, device=loss_mat.device)
    return seq_losses.sum() / _denominator(global_num_seqs, n)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_num_tokens: float | Tensor | None = None,
    global_num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Aggregate a (N, T) per-token loss matrix into a 0-dim loss with the named mode."""
    try:
        fn = LOSS_AGG_MODES[mode]
    except KeyError:
        valid = ", ".join(sorted(LOSS_AGG_MODES))
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {valid}") from None
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must have the same shape")
    return fn(
        loss_mat,
        mask,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_length=norm_length,
    )
