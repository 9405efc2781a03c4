"""The policy-gradient loss of DAPO (Eq. 8-12) and of the GRPO baseline and DAPO's successors.

One loss, in four steps, for each response token (i, t) of a (N, T) batch:

    L_it = objective(log pi_theta, log pi_old, A, mask)        # registered by name (``objectives.OBJECTIVES``)
    L_it <- w_it * L_it                                         # rollout correction's TIS weights (constant; none = 1)
    loss = agg(L, mask)                                         # DAPO Eq. 12 token-mean, GRPO Eq. 2, Dr. GRPO, ...
    metrics: pg_loss, the pg_clipfrac* shares of clipped tokens, ppo_kl

``mode`` names the objective: ``ppo-clip`` is DAPO's clipped surrogate with Clip-Higher (eps_low / eps_high,
Eq. 8-10) and the optional dual clip (``clip_c``); GRPO is the same with eps_high = eps_low and
``loss_agg="seq-mean-token-mean"``. ``gspo`` (sequence-level ratio and clip), ``cispo`` (clipped, stop-gradient
importance weight) and ``gmpo`` (geometric mean of token ratios) are DAPO's successors; ``clip_low``/``clip_high`` are
then that objective's bounds and ``clip_c`` is not used. Each objective and its equations: ``dapo_core.algorithm.
objectives``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_core.algorithm.aggregation import agg_loss
from dapo_core.algorithm.masked import masked_mean
from dapo_core.algorithm.objectives import LOG_RATIO_CLAMP, OBJECTIVES, TokenLosses

# The built-in objectives, in registration order ("ppo-clip", "gspo", "cispo", "gmpo"); ``OBJECTIVES`` is the
# registry ``policy_loss`` dispatches on.
POLICY_LOSS_MODES: tuple[str, ...] = tuple(OBJECTIVES)


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
    """The named objective's per-token losses, weighted and aggregated, and their diagnostics.

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
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, token_weights)
    _check_bounds(mode, clip_low, clip_high, clip_c)
    mask = response_mask.to(log_probs.dtype)  # (N, T)
    old_log_probs = old_log_probs.detach()  # (N, T)  pi_old is a constant
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (N, 1) broadcast over T
    advantages = advantages.detach().to(log_probs.dtype)  # (N, 1) or (N, T)  A_i, a constant
    objective = OBJECTIVES[mode]
    terms = objective(log_probs, old_log_probs, advantages, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
    loss = _weighted_agg(
        terms.losses, mask, token_weights, loss_agg,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )  # fmt: skip
    return loss, _diagnostics(loss, terms, log_probs, old_log_probs, mask)


def _check_inputs(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, token_weights: Tensor | None
) -> None:
    """The shapes ``policy_loss`` needs: one (N, T) for the log-probs and the mask (and the token weights), and
    advantages with N rows."""
    if not (log_probs.shape == old_log_probs.shape == response_mask.shape):
        raise ValueError(
            "log_probs, old_log_probs and response_mask must share one (N, T) shape; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.shape[0] != log_probs.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} rows, log_probs has {log_probs.shape[0]}")
    if token_weights is not None and token_weights.shape != log_probs.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must match log_probs {tuple(log_probs.shape)}")


def _check_bounds(mode: str, clip_low: float | None, clip_high: float, clip_c: float | None) -> None:
    """A registered ``mode``, 0 <= clip_low (<= clip_high for ppo-clip), None only for cispo, and c > 1."""
    if mode not in OBJECTIVES:
        raise ValueError(f"unknown policy loss mode {mode!r}; valid: {', '.join(OBJECTIVES)}")
    if clip_low is None and mode != "cispo":
        raise ValueError(f"clip_low=None (no lower bound) is a cispo option; mode {mode!r} needs a number")
    if clip_high < 0 or (clip_low is not None and (clip_low < 0 or (mode == "ppo-clip" and clip_high < clip_low))):
        raise ValueError(f"need 0 <= clip_low <= clip_high, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")


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


def _diagnostics(
    loss: Tensor, terms: TokenLosses, log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> dict[str, float]:
    """The loss and, as masked token means (CleanRL style, no gradient), the shares of clipped tokens and the k1
    estimate of KL(pi_old || pi_theta)."""
    with torch.no_grad():
        log_ratio = torch.clamp(log_probs.detach() - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
        return {
            "pg_loss": float(loss.detach()),
            "pg_clipfrac": float(masked_mean(terms.clipped.to(mask.dtype), mask)),
            "pg_clipfrac_high": float(masked_mean(terms.high.to(mask.dtype), mask)),
            "pg_clipfrac_low": float(masked_mean(terms.low.to(mask.dtype), mask)),
            "pg_clipfrac_dual": float(masked_mean(terms.dual.to(mask.dtype), mask)),
            "ppo_kl": float(masked_mean(-log_ratio, mask)),  # k1: mean of log pi_old - log pi_theta
        }
