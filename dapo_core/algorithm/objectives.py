"""DAPO's successors as per-token loss matrices: GSPO, CISPO and GMPO (``policy_loss(mode=...)``).

Each function maps log-probabilities under pi_theta and pi_old, advantages and the response mask to a (N, T) matrix
of per-token losses that ``agg_loss`` reduces, plus the clip indicators for the diagnostics. Notation: for response
i of a group and its token t, r_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t), A_i its advantage,
|o_i| its length, sg() stop-gradient.

GSPO (Zheng et al. 2025, arXiv 2507.18071, Eq. 5-7): one length-normalised importance ratio per sequence,

    s_i = exp( 1/|o_i| * sum_t log r_it )                                     # Eq. 7
    J_i = min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )            # Eq. 5, clipped per sequence

implemented in the paper's GSPO-token form (Eq. 13-14): s_it = sg(s_i) * pi_theta(o_it) / sg(pi_theta(o_it)) has
the value s_i at every token and grad s_it = s_i * grad log pi_theta(o_it), so the mean over a sequence's tokens
(``loss_agg="seq-mean-token-mean"``, the paper's 1/G sum_i) has exactly the gradient of Eq. 5. Paper: eps_low 3e-4,
eps_high 4e-4 (sequence ratios stay far closer to 1 than token ratios).

CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5): clip the importance weight, not the update,

    J_it = sg( clip(r_it, 1 - eps_low, 1 + eps_high) ) * A_i * log pi_theta(o_it)

so every token keeps its gradient (no token is dropped by the clip) and its weight is bounded. Written here as
sg(w_it) * A_i * exp(log pi - sg(log pi)): the same gradient, and the loss value -w_it A_i (the clipped weighted
advantage) instead of a log-probability product. MiniMax-M1 sets no lower bound (eps_low = None here) and tunes
only eps_high; 5.0 is TRL's recommended CISPO value (after ScaleRL, arXiv 2510.13786). Aggregated per token.

GMPO (Zhao et al. 2025, arXiv 2507.20673, Eq. 4): maximise the geometric mean of the token-level terms,

    J_i = A_i * prod_t ( s * min(s * r_it, s * clip(r_it, e^-eps_low, e^eps_high)) )^(1/|o_i|),   s = sgn(A_i)

computed in log space, l_it = log r_it:

    J_i = A_i * exp( 1/|o_i| * sum_t s * min(s * l_it, s * clip(l_it, -eps_low, eps_high)) )

i.e. each token's log-ratio is clipped pessimistically for the advantage's sign (as PPO's min does), in log space,
and the sequence's ratio is the geometric mean of the clipped token ratios. Paper: the clip range (e^-0.4, e^0.4),
so eps_low = eps_high = 0.4 in log space. The per-sequence value is broadcast over its tokens, so
``seq-mean-token-mean`` gives the paper's 1/G sum_i J_i.

On-policy (pi_theta = pi_old, every r_it = 1) each objective's gradient equals the PPO-clip one, -A_i grad log pi per
token, up to how the tokens are weighted (GSPO and GMPO: 1/|o_i| within a sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_core.algorithm.masked import masked_sum

# log-ratio clamp before exp (every objective and the rollout correction): keeps ratios finite when the policies
# disagree wildly (exp(20) ~ 4.9e8); a clipped objective makes the exact value irrelevant past this point.
LOG_RATIO_CLAMP = 20.0


def _seq_mean_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """1/|o_i| * sum_t log r_it over the response tokens of each row. (N, 1); 0 for a fully masked row."""
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # (N, 1)
    return masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1) / lengths  # (N, 1)


def gspo_token_losses(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO-token per-token losses (N, T) and the (N, T) clipped-high / clipped-low indicators (see module doc).

    ``advantages`` is (N, 1) or (N, T); GSPO's advantage is one value per sequence, so a (N, T) input must be
    constant along each row's response tokens for the gradient to be the sequence-level one.
    """
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
    seq_log_ratio = _seq_mean_log_ratio(log_ratio, mask)  # (N, 1)  log s_i, Eq. 7
    # Eq. 13: s_it = sg(s_i) * pi_theta / sg(pi_theta): value s_i, gradient s_i * grad log pi_theta(o_it)
    s_it = torch.exp(seq_log_ratio.detach() + log_probs - log_probs.detach())  # (N, T)
    unclipped = -advantages * s_it  # (N, T)
    clipped = -advantages * torch.clamp(s_it, 1.0 - clip_low, 1.0 + clip_high)  # (N, T)
    losses = torch.maximum(unclipped, clipped)  # (N, T)  -min(s A, clip(s) A), Eq. 5
    with torch.no_grad():
        adv = advantages.expand_as(s_it)
        s = s_it.detach()
        high = (clipped > unclipped) & (adv > 0) & (s > 1.0 + clip_high)
        low = (clipped > unclipped) & (adv < 0) & (s < 1.0 - clip_low)
    return losses, high, low


def cispo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO per-token losses (N, T) and the clipped-high / clipped-low weight indicators (see module doc).

    ``clip_low`` None = no lower bound on the weight (MiniMax-M1). The indicators mark tokens whose *weight* was
    clipped (their gradient is kept, only scaled).
    """
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
    ratio = torch.exp(log_ratio).detach()  # (N, T)  r_it, no gradient through the weight
    lower = 0.0 if clip_low is None else 1.0 - clip_low
    weight = torch.clamp(ratio, lower, 1.0 + clip_high)  # (N, T)  sg(clip(r_it)), Eq. 4
    # sg(w) * A * log pi_theta has gradient w * A * grad log pi; exp(lp - sg(lp)) = 1 in value, same gradient
    unit = torch.exp(log_probs - log_probs.detach())  # (N, T)  value 1, grad = grad log pi_theta
    losses = -advantages * weight * unit  # (N, T)
    with torch.no_grad():
        high = ratio > 1.0 + clip_high
        low = ratio < lower if clip_low is not None else torch.zeros_like(high)
    return losses, high, low


def gmpo_token_losses(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GMPO per-token losses (N, T): -A_i * geometric mean of the sign-aware clipped token ratios of row i,
    broadcast over the row; plus the (N, T) clipped-high / clipped-low indicators (see module doc).

    ``clip_low`` / ``clip_high`` are log-space bounds: the token ratio is clipped to (e^-clip_low, e^clip_high).
    """
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)  l_it
    adv = advantages.expand_as(log_ratio)  # (N, T)
    sign = torch.where(adv >= 0, torch.ones_like(adv), -torch.ones_like(adv))  # (N, T)  s = sgn(A_i)
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)  # (N, T)
    # pessimistic per token: A > 0 takes min(l, clip(l)), A < 0 takes max(l, clip(l)) (Eq. 4 in log space)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)  # (N, T)
    seq_ratio = torch.exp(_seq_mean_log_ratio(chosen, mask))  # (N, 1)  prod_t(.)^(1/|o_i|)
    seq_adv = advantages if advantages.shape[-1] == 1 else _row_value(advantages, mask)  # (N, 1)
    losses = (-seq_adv * seq_ratio).expand_as(log_ratio)  # (N, T)  the sequence's loss on each of its tokens
    with torch.no_grad():
        lr = log_ratio.detach()
        high = (adv > 0) & (lr > clip_high)
        low = (adv < 0) & (lr < -clip_low)
    return losses, high, low


def _row_value(values: Tensor, mask: Tensor) -> Tensor:
    """The per-row mean of ``values`` over the mask, (N, 1): a sequence-level advantage from a (N, T) one."""
    return masked_sum(values, mask, dim=-1).unsqueeze(-1) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
