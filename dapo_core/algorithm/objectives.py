"""The per-token objectives of ``policy_loss(mode=...)``: DAPO's PPO-clip and its successors GSPO, CISPO and GMPO.

Each objective is registered by name (``register_objective``) and maps log-probabilities under pi_theta and pi_old,
advantages and the response mask to a ``TokenLosses``: the (N, T) matrix of per-token losses that ``agg_loss``
reduces, plus the clip indicators for the diagnostics. Notation: for response i of a group and its token t,
r_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t), A_i its advantage, |o_i| its length, sg()
stop-gradient.

PPO-clip (DAPO, Yu et al. 2025, arXiv 2503.14476, Eq. 8-10; GRPO is eps_high = eps_low):

    r_it = pi_theta(o_it) / pi_old(o_it)                                       # Eq. 9
    L_it = -min( r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i )         # Eq. 8, Clip-Higher (Eq. 10)

and, with dual-clip (Ye et al. 2020, arXiv 1912.09729; verl's DAPO recipe uses c = 10), for A_i < 0 the loss
is further bounded, L_it = min(L_it, -c A_i), so a very large ratio on a negative-advantage token cannot blow up
the loss.

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

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from dapo_core.algorithm.masked import masked_sum

# log-ratio clamp before exp (every objective and the rollout correction): keeps ratios finite when the policies
# disagree wildly (exp(20) ~ 4.9e8); a clipped objective makes the exact value irrelevant past this point.
LOG_RATIO_CLAMP = 20.0


class TokenLosses(NamedTuple):
    """What an objective returns: its per-token losses and the clip indicators of the ``pg_clipfrac*`` metrics."""

    losses: Tensor  # (N, T) L_it, before the token weights and the aggregation
    clipped: Tensor  # (N, T) bool: a clip is the active term (pg_clipfrac)
    high: Tensor  # (N, T) bool: clipped at the upper bound (pg_clipfrac_high)
    low: Tensor  # (N, T) bool: clipped at the lower bound (pg_clipfrac_low)
    dual: Tensor  # (N, T) bool: the dual clip bounds the loss (pg_clipfrac_dual); all False without one


class Objective(Protocol):
    """A per-token objective: (N, T) log-probs under pi_theta and pi_old (detached), (N, 1) or (N, T) advantages
    (detached), the (N, T) float mask, and its bounds; ``clip_c`` is the dual-clip constant (None: none), which an
    objective without a dual clip ignores."""

    def __call__(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip_low: float | None,
        clip_high: float,
        clip_c: float | None,
    ) -> TokenLosses: ...


OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str) -> Callable[[Objective], Objective]:
    """Register a per-token objective under ``name`` (used by ``policy_loss(mode=name)``)."""

    def deco(fn: Objective) -> Objective:
        if name in OBJECTIVES:
            raise ValueError(f"policy loss objective {name!r} is already registered")
        OBJECTIVES[name] = fn
        return fn

    return deco


def _clamped_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """log r_it = log pi_theta - log pi_old, clamped to +-LOG_RATIO_CLAMP. (N, T)"""
    return torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_mean_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """1/|o_i| * sum_t log r_it over the response tokens of each row. (N, 1); 0 for a fully masked row."""
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # (N, 1)
    return masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1) / lengths  # (N, 1)


@register_objective("ppo-clip")
def ppo_clip_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    clip_c: float | None = None,
) -> TokenLosses:
    """DAPO/GRPO's clipped surrogate per token (Eq. 8-10, Clip-Higher), with the dual clip when ``clip_c`` is set
    (see module doc). ``clip_low`` / ``clip_high`` are eps_low / eps_high (DAPO 0.2 / 0.28; GRPO 0.2 / 0.2)."""
    if clip_low is None:
        raise ValueError("ppo-clip needs a lower bound clip_low (eps_low), got None")
    ratio = torch.exp(_clamped_log_ratio(log_probs, old_log_probs))  # (N, T)  r_it, Eq. 9
    unclipped = -advantages * ratio  # (N, T)  -r_it A_i
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (N, T)  -clip(r_it) A_i, Eq. 10
    losses = torch.maximum(unclipped, clipped)  # (N, T)  -min(r A, clip(r) A), Eq. 8
    if clip_c is not None:
        losses = _dual_clip(losses, advantages, clip_c)  # (N, T)
    with torch.no_grad():
        adv = advantages.expand_as(ratio)  # (N, T)
        active = clipped > unclipped  # (N, T)  the clipped term is the one the max took
        high = active & (adv > 0) & (ratio > 1.0 + clip_high)
        low = active & (adv < 0) & (ratio < 1.0 - clip_low)
        dual = (adv < 0) & (ratio > clip_c) if clip_c is not None else torch.zeros_like(active)
    return TokenLosses(losses, active, high, low, dual)


def _dual_clip(losses: Tensor, advantages: Tensor, clip_c: float) -> Tensor:
    """Dual-clip (Ye et al. 2020): L_it = min(L_it, -c A_i) where A_i < 0, unchanged elsewhere. (N, T)"""
    bound = -advantages * clip_c  # (N, T) or (N, 1)  -c A_i
    bounded = torch.minimum(losses, bound)  # (N, T)
    return torch.where(advantages < 0, bounded, losses)  # (N, T)


@register_objective("gspo")
def gspo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    clip_c: float | None = None,
) -> TokenLosses:
    """GSPO-token per-token losses (N, T) and the clipped-high / clipped-low indicators (see module doc).

    ``advantages`` is (N, 1) or (N, T); GSPO's advantage is one value per sequence, so a (N, T) input must be
    constant along each row's response tokens for the gradient to be the sequence-level one. No dual clip:
    ``clip_c`` is ignored.
    """
    if clip_low is None:
        raise ValueError("gspo needs a lower bound clip_low, got None")
    log_ratio = _clamped_log_ratio(log_probs, old_log_probs)  # (N, T)  log r_it
    seq_log_ratio = _seq_mean_log_ratio(log_ratio, mask)  # (N, 1)  log s_i, Eq. 7
    # Eq. 13: s_it = sg(s_i) * pi_theta / sg(pi_theta): value s_i, gradient s_i * grad log pi_theta(o_it)
    s_it = torch.exp(seq_log_ratio.detach() + log_probs - log_probs.detach())  # (N, T)
    unclipped = -advantages * s_it  # (N, T)  -s_i A_i
    clipped = -advantages * torch.clamp(s_it, 1.0 - clip_low, 1.0 + clip_high)  # (N, T)  -clip(s_i) A_i
    losses = torch.maximum(unclipped, clipped)  # (N, T)  -min(s A, clip(s) A), Eq. 5
    with torch.no_grad():
        adv = advantages.expand_as(s_it)  # (N, T)
        s = s_it.detach()  # (N, T)
        high = (clipped > unclipped) & (adv > 0) & (s > 1.0 + clip_high)
        low = (clipped > unclipped) & (adv < 0) & (s < 1.0 - clip_low)
    return _one_sided(losses, high, low)


@register_objective("cispo")
def cispo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    clip_c: float | None = None,
) -> TokenLosses:
    """CISPO per-token losses (N, T) and the clipped-high / clipped-low weight indicators (see module doc).

    ``clip_low`` None = no lower bound on the weight (MiniMax-M1). The indicators mark tokens whose *weight* was
    clipped (their gradient is kept, only scaled). No dual clip: ``clip_c`` is ignored.
    """
    log_ratio = _clamped_log_ratio(log_probs, old_log_probs)  # (N, T)  log r_it
    ratio = torch.exp(log_ratio).detach()  # (N, T)  r_it, no gradient through the weight
    lower = 0.0 if clip_low is None else 1.0 - clip_low
    weight = torch.clamp(ratio, lower, 1.0 + clip_high)  # (N, T)  w_it = sg(clip(r_it)), Eq. 4
    # sg(w) * A * log pi_theta has gradient w * A * grad log pi; exp(lp - sg(lp)) = 1 in value, same gradient
    unit = torch.exp(log_probs - log_probs.detach())  # (N, T)  value 1, grad = grad log pi_theta
    losses = -advantages * weight * unit  # (N, T)  -sg(w_it) A_i pi/sg(pi), the gradient of Eq. 4
    with torch.no_grad():
        high = ratio > 1.0 + clip_high
        low = ratio < lower if clip_low is not None else torch.zeros_like(high)
    return _one_sided(losses, high, low)


@register_objective("gmpo")
def gmpo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    clip_c: float | None = None,
) -> TokenLosses:
    """GMPO per-token losses (N, T): -A_i * geometric mean of the sign-aware clipped token ratios of row i,
    broadcast over the row; plus the clipped-high / clipped-low indicators (see module doc).

    ``clip_low`` / ``clip_high`` are log-space bounds: the token ratio is clipped to (e^-clip_low, e^clip_high).
    No dual clip: ``clip_c`` is ignored.
    """
    if clip_low is None:
        raise ValueError("gmpo needs a lower bound clip_low, got None")
    log_ratio = _clamped_log_ratio(log_probs, old_log_probs)  # (N, T)  l_it
    adv = advantages.expand_as(log_ratio)  # (N, T)
    sign = torch.where(adv >= 0, torch.ones_like(adv), -torch.ones_like(adv))  # (N, T)  s = sgn(A_i)
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)  # (N, T)  clip(l_it, -eps_low, eps_high)
    # pessimistic per token: A > 0 takes min(l, clip(l)), A < 0 takes max(l, clip(l)) (Eq. 4 in log space)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)  # (N, T)
    seq_ratio = torch.exp(_seq_mean_log_ratio(chosen, mask))  # (N, 1)  prod_t(.)^(1/|o_i|)
    seq_adv = advantages if advantages.shape[-1] == 1 else _row_value(advantages, mask)  # (N, 1)  A_i
    losses = (-seq_adv * seq_ratio).expand_as(log_ratio)  # (N, T)  -J_i on each of its tokens
    with torch.no_grad():
        lr = log_ratio.detach()  # (N, T)
        high = (adv > 0) & (lr > clip_high)
        low = (adv < 0) & (lr < -clip_low)
    return _one_sided(losses, high, low)


def _one_sided(losses: Tensor, high: Tensor, low: Tensor) -> TokenLosses:
    """A ``TokenLosses`` for an objective without a dual clip: clipped = high | low, dual all False."""
    return TokenLosses(losses, high | low, high, low, torch.zeros_like(high))


def _row_value(values: Tensor, mask: Tensor) -> Tensor:
    """The per-row mean of ``values`` over the mask, (N, 1): a sequence-level advantage from a (N, T) one."""
    return masked_sum(values, mask, dim=-1).unsqueeze(-1) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
