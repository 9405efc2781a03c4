"""The rollout/trainer mismatch and its truncated importance-sampling correction.

The sampler (vLLM's kernels, bf16 on GPUs) and the trainer (its own forward pass) compute slightly different
probabilities for the same tokens, so a batch sampled from pi_rollout is trained as if it came from pi_old (the
trainer's recomputed log-probs). Per response token (i, t), with l_rollout = log pi_rollout(o_it) as the sampler
returned it and l_old = log pi_old(o_it) as the trainer recomputes it:

    mismatch:   |l_rollout - l_old|  and  |pi_rollout - pi_old|  (mean and max over the loss tokens)
    TIS weight: w_it = min( exp(l_old - l_rollout), C )          (truncated importance sampling)

and the corrected per-token loss is w_it * L_it (w a constant: no gradient flows through it). This is the token-level
TIS of verl (``tis_imp_ratio_cap``), OpenRLHF and NeMo-RL; C bounds the variance a rare token with a tiny rollout
probability could add (verl's default cap: 2).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_core.algorithm.masked import masked_mean
from dapo_core.algorithm.objectives import LOG_RATIO_CLAMP


def mismatch_metrics(rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max of |l_rollout - l_old| and |p_rollout - p_old| over the mask's tokens; bare keys (callers
    prefix ``mismatch/``). All 0 when the mask is empty.

    Args:
        rollout_log_probs: (N, T) the sampler's log-probs of the sampled tokens.
        old_log_probs: (N, T) the trainer's recomputed log-probs of the same tokens.
        mask: (N, T) 1 for the tokens that count.
    """
    if not (rollout_log_probs.shape == old_log_probs.shape == mask.shape):
        raise ValueError(
            "rollout_log_probs, old_log_probs and mask must share one (N, T) shape; got "
            f"{tuple(rollout_log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        m = mask.to(torch.float64)
        lr, lo = rollout_log_probs.detach().to(torch.float64), old_log_probs.detach().to(torch.float64)
        logp_diff = (lr - lo).abs()  # (N, T)
        prob_diff = (torch.exp(lr) - torch.exp(lo)).abs()  # (N, T)
        on = m > 0
        return {
            "logp_abs_diff_mean": float(masked_mean(logp_diff, m)),
            "logp_abs_diff_max": float(logp_diff[on].max()) if on.any() else 0.0,
            "prob_abs_diff_mean": float(masked_mean(prob_diff, m)),
            "prob_abs_diff_max": float(prob_diff[on].max()) if on.any() else 0.0,
        }


def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """TIS weights w_it = min(pi_old / pi_rollout, cap), (N, T), detached; 0 off the mask. Metrics (bare keys):
    ``tis_weight_mean`` and ``tis_capped_frac`` (share of loss tokens whose weight hit the cap)."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}: e.g. 2.0 (verl's tis_imp_ratio_cap)")
    if not (rollout_log_probs.shape == old_log_probs.shape == mask.shape):
        raise ValueError(
            "old_log_probs, rollout_log_probs and mask must share one (N, T) shape; got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        log_ratio = torch.clamp(old_log_probs - rollout_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
        ratio = torch.exp(log_ratio)  # (N, T)  pi_old / pi_rollout
        weights = torch.clamp(ratio, max=cap) * mask.to(ratio.dtype)  # (N, T)
        metrics = {
            "tis_weight_mean": float(masked_mean(weights, mask)),
            "tis_capped_frac": float(masked_mean((ratio > cap).to(ratio.dtype), mask)),
        }
    return weights, metrics
