"""The ``algorithm`` section of the config: the objective, advantages, reward, dynamic sampling, overlong shaping.

Split out of ``dapo_core.config.schema`` (which re-exports every name here). Field descriptions name the paper's
symbol and the value of the paper / verl's DAPO script; the successors' knobs (GSPO, CISPO, GMPO) carry their own
papers' defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from dapo_core.config.section import _Section

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
PolicyLossMode = Literal["ppo-clip", "gspo", "cispo", "gmpo"]


class DynamicSamplingConfig(_Section):
    enable: bool = Field(
        default=True,
        description="Dynamic sampling (Sec. 3.2, Eq. 11): keep only groups with 0 < #correct < G. Paper: on.",
    )
    metric: Literal["acc", "score"] = Field(
        default="acc", description="Per-response value whose group variance decides. verl DAPO: acc."
    )
    max_num_gen_batches: int = Field(
        default=10, description="Generation batches per step before giving up; <= 0 = unlimited. verl: 10."
    )
    on_exhausted: Literal["error", "continue"] = Field(
        default="error",
        description="When max_num_gen_batches is hit: error, or continue with the groups kept so far.",
    )


class OverlongConfig(_Section):
    shaping: bool = Field(
        default=True, description="Soft overlong punishment (Sec. 3.4, Eq. 13) added to the reward. Paper: on."
    )
    buffer_length: int = Field(
        default=4096, gt=0, description="L_cache, the penalty ramp before L_max (Eq. 13). Paper: 4096."
    )
    penalty_factor: float = Field(
        default=1.0, ge=0, description="Penalty at L_max (the ramp ends at -penalty_factor). verl: 1.0."
    )
    filtering: bool = Field(
        default=False,
        description="Overlong filtering (Sec. 3.4; the first step of Table 1): mask truncated responses out of the loss. "
        "verl DAPO script: off.",
    )


class GspoConfig(_Section):
    clip_low: float = Field(
        default=3e-4, ge=0, lt=1, description="GSPO eps_low on the sequence ratio s_i (arXiv 2507.18071). Paper: 3e-4."
    )
    clip_high: float = Field(default=4e-4, ge=0, description="GSPO eps_high on s_i. Paper: 4e-4.")


class CispoConfig(_Section):
    clip_low: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="CISPO eps_low on the importance weight; null = no lower bound (MiniMax-M1, arXiv 2506.13585).",
    )
    clip_high: float = Field(
        default=5.0, ge=0, description="CISPO eps_high: weights capped at 1 + eps_high. TRL/ScaleRL: 5.0."
    )


class GmpoConfig(_Section):
    clip_low: float = Field(
        default=0.4, gt=0, description="GMPO log-space bound: token ratio >= e^-clip_low (arXiv 2507.20673). 0.4."
    )
    clip_high: float = Field(default=0.4, gt=0, description="GMPO log-space bound: token ratio <= e^clip_high. 0.4.")


class RolloutCorrectionConfig(_Section):
    enable: bool = Field(
        default=False,
        description="Truncated importance sampling: weight each token's loss by min(p_trainer / p_rollout, cap) "
        "(verl, OpenRLHF, NeMo-RL). The mismatch is logged either way (mismatch/*).",
    )
    cap: float = Field(default=2.0, gt=0, description="C, the TIS weight cap. verl: tis_imp_ratio_cap 2.0.")


class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo"] = Field(
        default="grpo", description="Advantage estimator: group-normalised outcome reward (Eq. 9). DAPO: grpo."
    )
    norm_adv_by_std: bool = Field(
        default=True, description="Divide (r - mean) by the group std (Eq. 9). Paper: true (Dr. GRPO: false)."
    )
    policy_loss: PolicyLossMode = Field(
        default="ppo-clip",
        description="Per-token objective: ppo-clip (DAPO/GRPO, Eq. 8-10), gspo (sequence ratio and clip), cispo "
        "(clipped stop-gradient IS weight), gmpo (geometric mean of token ratios). DAPO: ppo-clip.",
    )
    clip_low: float = Field(default=0.2, description="eps_low, lower clip: ratio >= 1 - eps_low (Eq. 10). 0.2.")
    clip_high: float = Field(
        default=0.28, description="eps_high, Clip-Higher upper clip: ratio <= 1 + eps_high (Eq. 10). DAPO: 0.28."
    )
    clip_c: float | None = Field(
        default=10.0, description="Dual-clip c for negative advantages (> 1); null = off. verl DAPO: 10.0."
    )
    loss_agg: LossAgg = Field(
        default="token-mean",
        description="Loss aggregation: token-mean (DAPO token-level loss, Eq. 12) or a sample-level mode "
        "(GRPO: seq-mean-token-mean).",
    )
    norm_length: int | None = Field(
        default=None,
        gt=0,
        description="Dr. GRPO constant for seq-mean-token-sum-norm only; null -> data.max_response_length.",
    )
    gspo: GspoConfig = Field(default_factory=GspoConfig, description="GSPO bounds (policy_loss=gspo).")
    cispo: CispoConfig = Field(default_factory=CispoConfig, description="CISPO bounds (policy_loss=cispo).")
    gmpo: GmpoConfig = Field(default_factory=GmpoConfig, description="GMPO bounds (policy_loss=gmpo).")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Rollout/trainer mismatch correction (the sampler's log-probs vs the trainer's).",
    )
    old_log_probs: Literal["recompute", "rollout"] = Field(
        default="recompute",
        description="pi_old in the ratio: recompute (a trainer forward over the batch before the updates, verl's "
        "default) or rollout (the sampler's log-probs of the sampled tokens: no forward; exact on the hf backend, "
        "which samples with the trainer's own module at the rollout temperature; with vllm the engine's numerics "
        "become pi_old, and mismatch/* is not logged). actor/entropy then comes from the updates' forwards.",
    )
    kl_coef: float = Field(default=0.0, ge=0, description="KL penalty coefficient (removed in DAPO Sec. 2.3). 0.")
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus (entropy is still logged). 0.")
    reward_fn: str = Field(
        default="math_dapo", description='Rule reward: +1 correct / -1 otherwise (Eq. 7). DAPO: "math_dapo".'
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="Dynamic sampling (Sec. 3.2)."
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig, description="Overlong reward shaping and filtering (Sec. 3.4)."
    )


def algorithm_problems(alg: AlgorithmConfig) -> list[str]:
    """The algorithm section's consistency problems, one "location (value) rule: fix" line each."""
    out = []
    if not 0 <= alg.clip_low < 1:
        out.append(
            f"algorithm.clip_low ({alg.clip_low}) must be in [0, 1): the lower bound 1 - eps_low must stay "
            f"positive (Eq. 10); use 0.2"
        )
    elif alg.clip_high < alg.clip_low:
        out.append(
            f"algorithm.clip_low ({alg.clip_low}) must be <= algorithm.clip_high ({alg.clip_high}): "
            f"Clip-Higher only raises the upper bound (Eq. 10); set clip_high >= clip_low (DAPO: 0.2 / 0.28)"
        )
    if alg.clip_c is not None and alg.clip_c <= 1:
        out.append(
            f"algorithm.clip_c ({alg.clip_c}) must be > 1 when set: dual-clip caps the ratio at c for negative "
            f"advantages; use 10.0 (verl DAPO) or null to turn it off"
        )
    if alg.norm_length is not None and alg.loss_agg != "seq-mean-token-sum-norm":
        out.append(
            f"algorithm.norm_length ({alg.norm_length}) only applies to loss_agg 'seq-mean-token-sum-norm' "
            f"(got '{alg.loss_agg}'): remove it, or set algorithm.loss_agg=seq-mean-token-sum-norm"
        )
    return out


def objective_bounds(alg: AlgorithmConfig) -> tuple[float | None, float]:
    """(clip_low, clip_high) of the configured objective: ppo-clip's eps pair or the successor's own section."""
    if alg.policy_loss == "ppo-clip":
        return alg.clip_low, alg.clip_high
    section: Any = {"gspo": alg.gspo, "cispo": alg.cispo, "gmpo": alg.gmpo}[alg.policy_loss]
    return section.clip_low, section.clip_high


def norm_length_of(alg: AlgorithmConfig, max_response_length: int) -> int | None:
    """Dr. GRPO's constant for ``seq-mean-token-sum-norm``: ``norm_length``, else L_max; None for every other mode."""
    if alg.loss_agg != "seq-mean-token-sum-norm":
        return None
    return alg.norm_length or max_response_length
