"""The clipped policy-gradient objective of DAPO (Eq. 8-10) and of the GRPO baseline.

For each response token (i, t), with r = pi_theta / pi_old and advantage A_i:

    L_it = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)          # DAPO Eq. 8 (Clip-Higher, Eq. 10)

and, with dual-clip (Ye et al. 2020, used by verl's DAPO recipe with c = 10), for A < 0 the loss is further
bounded: L_it = min(L_it, -c * A), so a very large ratio on a negative-advantage token cannot blow up the loss.
GRPO is the same function with eps_high = eps_low and ``loss_agg="seq-mean-token-mean"``.

``mode`` swaps the per-token objective for one of DAPO's successors (``dapo_core.algorithm.objectives``): ``gspo``
(sequence-level ratio and clip), ``cispo`` (clipped, stop-gradient importance weight), ``gmpo`` (geometric mean of
token ratios); ``clip_low``/``clip_high`` are then that objective's bounds and ``clip_c`` is not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_core.algorithm.aggregation import agg_loss
from dapo_core.algorithm.masked import masked_mean
from dapo_core.algorithm.objectives import (
    LOG_RATIO_CLAMP,
    cispo_token_losses,
    gmpo_token_losses,
    gspo_token_losses,
)

POLICY_LOSS_MODES: tuple[str, ...] = ("ppo-clip", "gspo", "cispo", "gmpo")


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    mode: str,
    clip_low: float | None,
    clip_high: float,
    clip_c: float | None = None,
    loss_agg: str,
    global_num_tokens: float | Tensor | None = None,
    global_num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss with decoupled clip range, optional dual-clip and a chosen aggregation.

    Args:
        log_probs: (N, T) log pi_theta(o_t | q, o_<t) of the sampled tokens (requires grad).
        old_log_probs: (N, T) the same under pi_old (the policy that generated the batch).
        advantages: (N, T) or (N,) per-token advantages (GRPO/DAPO broadcast one value per response).
        response_mask: (N, T) 1 for tokens that count (response tokens, not padding / filtered responses).
        mode: ``ppo-clip`` (DAPO/GRPO, Eq. 8-10), ``gspo``, ``cispo`` or ``gmpo`` (module doc).
        clip_low: eps_low. clip_high: eps_high (DAPO's Clip-Higher raises it above eps_low). For the other modes,
            that objective's bounds (cispo: clip_low None = no lower bound; gmpo: in log space). The values, the
            paper's among them, are the config's ``algorithm:`` section (``LossConfig.from_config``).
        clip_c: dual-clip constant c > 1 for negative advantages (verl DAPO: 10); None disables it. ppo-clip only.
        loss_agg: aggregation mode, see ``dapo_core.algorithm.aggregation``.
        global_num_tokens / global_num_seqs / norm_length: denominators, see ``agg_loss``; pass the counts of the
            whole mini-batch (across micro-batches and ranks) to make micro-batch losses sum to the mini-batch loss.
        token_weights: (N, T) constant per-token weights multiplying the per-token losses before aggregation, e.g.
            the rollout correction's truncated IS weights (``rollout_correction.truncated_is_weights``); None = 1.

    Returns:
        (loss, metrics): a 0-dim loss tensor; metrics with bare keys (callers prefix ``actor/``):
        pg_loss, pg_clipfrac (any side), pg_clipfrac_high, pg_clipfrac_low, pg_clipfrac_dual, ppo_kl;
        all masked token means over this call's tokens.
    """
    if not (log_probs.shape == old_log_probs.shape == response_mask.shape):
        raise ValueError(
            "log_probs, old_log_probs and response_mask must share one (N, T) shape; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (N, 1) broadcast over T
    if advantages.shape[0] != log_probs.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} rows, log_probs has {log_probs.shape[0]}")
    if token_weights is not None and token_weights.shape != log_probs.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must match log_probs {tuple(log_probs.shape)}")
    if mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unknown policy loss mode {mode!r}; valid: {', '.join(POLICY_LOSS_MODES)}")
    if clip_low is None and mode != "cispo":
        raise ValueError(f"clip_low=None (no lower bound) is a cispo option; mode {mode!r} needs a number")
    if clip_high < 0 or (clip_low is not None and (clip_low < 0 or (mode == "ppo-clip" and clip_high < clip_low))):
        raise ValueError(f"need 0 <= clip_low <= clip_high, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")

    mask = response_mask.to(log_probs.dtype)  # (N, T)
    old_log_probs = old_log_probs.detach()
    advantages = advantages.detach().to(log_probs.dtype)
    if mode != "ppo-clip":
        return _successor_loss(
            mode, log_probs, old_log_probs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
            loss_agg=loss_agg, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
            norm_length=norm_length, token_weights=token_weights,
        )  # fmt: skip
    assert clip_low is not None

    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
    ratio = torch.exp(log_ratio)  # (N, T)  r_it(theta), DAPO Eq. 9

    # DAPO Eq. 8/10: clip-higher, decoupled eps_low / eps_high
    pg_losses_unclipped = -advantages * ratio  # (N, T)
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (N, T)
    pg_losses = torch.maximum(pg_losses_unclipped, pg_losses_clipped)  # (N, T)  = -min(rA, clip(r)A)

    if clip_c is not None:
        # dual-clip: for A < 0 bound the loss by -c*A (the surrogate can no longer grow without limit)
        pg_losses_dual = -advantages * clip_c  # (N, T) or (N, 1)
        bounded = torch.minimum(pg_losses, pg_losses_dual)
        pg_losses = torch.where(advantages < 0, bounded, pg_losses)  # (N, T)

    loss = _weighted_agg(
        pg_losses, mask, token_weights, loss_agg,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )  # fmt: skip

    # Diagnostics next to the loss (CleanRL style), under no_grad, masked token means.
    with torch.no_grad():
        adv = advantages.expand_as(ratio)
        clipped_any = pg_losses_clipped > pg_losses_unclipped  # the clipped term is the active one
        clipped_high = clipped_any & (adv > 0) & (ratio > 1.0 + clip_high)
        clipped_low = clipped_any & (adv < 0) & (ratio < 1.0 - clip_low)
        if clip_c is not None:
            clipped_dual = (adv < 0) & (ratio > clip_c)
        else:
            clipped_dual = torch.zeros_like(clipped_any)
        metrics = {
            "pg_loss": float(loss.detach()),
            "pg_clipfrac": float(masked_mean(clipped_any.to(mask.dtype), mask)),
            "pg_clipfrac_high": float(masked_mean(clipped_high.to(mask.dtype), mask)),
            "pg_clipfrac_low": float(masked_mean(clipped_low.to(mask.dtype), mask)),
            "pg_clipfrac_dual": float(masked_mean(clipped_dual.to(mask.dtype), mask)),
            # k1 estimator of KL(pi_old || pi_theta): mean of (old - new) log-ratio
            "ppo_kl": float(masked_mean(-log_ratio, mask)),
        }
    return loss, metrics


def _weighted_agg(
    losses: Tensor,
    mask: Tensor,
    token_weights: Tensor | None,
    loss_agg: str,
    *,
    global_num_tokens: float | Tensor | None,
    global_num_seqs: float | Tensor | None,
    norm_length: float | None,
) -> Tensor:
    """w_it * L_it (TIS weights, constant; none = 1) reduced by ``agg_loss``: the last step of every mode."""
    if token_weights is not None:
        losses = losses * token_weights.detach().to(losses.dtype)  # (N, T)
    return agg_loss(
        losses,
        mask,
        loss_agg,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_length=norm_length,
    )


_SUCCESSORS = {"gspo": gspo_token_losses, "cispo": cispo_token_losses, "gmpo": gmpo_token_losses}


def _successor_loss(
    mode: str,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    loss_agg: str,
    global_num_tokens: float | Tensor | None,
    global_num_seqs: float | Tensor | None,
    norm_length: float | None,
    token_weights: Tensor | None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO / CISPO / GMPO: their (N, T) loss matrix through the same aggregation, and the same metric keys."""
    fn = _SUCCESSORS[mode]
    losses, high, low = fn(log_probs, old_log_probs, advantages, mask, clip_low=clip_low, clip_high=clip_high)  # type: ignore[operator,arg-type]
    loss = _weighted_agg(
        losses, mask, token_weights, loss_agg,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )  # fmt: skip
    with torch.no_grad():
        log_ratio = torch.clamp(log_probs.detach() - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        either = (high | low).to(mask.dtype)
        metrics = {
            "pg_loss": float(loss.detach()),
            "pg_clipfrac": float(masked_mean(either, mask)),
            "pg_clipfrac_high": float(masked_mean(high.to(mask.dtype), mask)),
            "pg_clipfrac_low": float(masked_mean(low.to(mask.dtype), mask)),
            "pg_clipfrac_dual": 0.0,
            "ppo_kl": float(masked_mean(-log_ratio, mask)),
        }
    return loss, metrics
