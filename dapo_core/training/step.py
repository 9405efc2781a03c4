"""One DAPO training step over an executor (Algorithm 1), without orchestration or tracking.

A flow calls these in order — generate_and_score -> (filter, accumulate) until full -> build_train_batch ->
executor.compute_log_probs -> executor.update -> executor.sync_weights — and logs ``step_metrics``.
Shape legend: B prompt groups, G responses per prompt, N = B*G responses, T response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dapo_core.algorithm import (
    dynamic_sampling_mask,
    group_advantages,
    masked_mean,
    overlong_filter_mask,
    overlong_penalty,
)
from dapo_core.algorithm.rollout_correction import mismatch_metrics, truncated_is_weights
from dapo_core.config import DapoConfig
from dapo_core.engines.batch import PolicyBatch, build_policy_batch
from dapo_core.engines.executor import Executor, sampling_from
from dapo_core.engines.rollout import RolloutResult
from dapo_core.training.prompts import PromptItem


@dataclass
class Group:
    """The G responses of one prompt, with their rewards. Plain Python: safe to pass between tasks."""

    item: PromptItem
    responses: list[RolloutResult]
    scores: list[float]  # correctness score from the reward function (+1 / -1 for math_dapo)
    acc: list[bool]
    penalties: list[float]  # overlong penalty (<= 0), 0 when shaping is off
    preds: list[str] = field(default_factory=list)
    version: int = 0  # weight version the responses were sampled with (the behaviour policy)

    @property
    def rewards(self) -> list[float]:
        """Shaped reward used for advantages: correctness + overlong penalty (DAPO Eq. 13 added to R)."""
        return [s + p for s, p in zip(self.scores, self.penalties, strict=True)]


@dataclass
class GenBatch:
    """One generation batch: its groups plus what generating it cost."""

    groups: list[Group]
    num_failed_rewards: int = 0
    gen_tokens: int = 0


def generate_and_score(executor: Executor, items: Sequence[PromptItem], cfg: DapoConfig, *, seed: int) -> GenBatch:
    """Roll out G responses per prompt (paper: T=1.0, top_p=1.0) and score them (rule reward + overlong). The
    sampler's log-probs come back too (the rollout/trainer mismatch is measured against them)."""
    results = executor.generate([list(it.prompt_ids) for it in items], sampling_from(cfg, seed=seed, log_probs=True))
    return score_results(executor, items, results, cfg)


def score_results(
    executor: Executor,
    items: Sequence[PromptItem],
    results: Sequence[RolloutResult],
    cfg: DapoConfig,
    *,
    version: int | None = None,
) -> GenBatch:
    """Rewards of ``results`` grouped by prompt; ``version``: the weights that sampled them (default: current)."""
    version = executor.weight_version if version is None else version
    scored = executor.score([r.text for r in results], [items[r.prompt_index].record.ground_truth for r in results])
    ov = cfg.algorithm.overlong
    lengths = torch.tensor([r.response_length for r in results], dtype=torch.long)  # (N,)
    if ov.shaping:
        penalties = overlong_penalty(
            lengths,
            max_response_length=cfg.data.max_response_length,
            buffer_length=ov.buffer_length,
            penalty_factor=ov.penalty_factor,
        ).tolist()
    else:
        penalties = [0.0] * len(results)
    by_prompt: dict[int, list[int]] = {}
    for k, r in enumerate(results):
        by_prompt.setdefault(r.prompt_index, []).append(k)
    groups = []
    for p, rows in sorted(by_prompt.items()):
        groups.append(
            Group(
                item=items[p],
                responses=[results[k] for k in rows],
                scores=[float(scored.results[k]["score"]) for k in rows],
                acc=[bool(scored.results[k]["acc"]) for k in rows],
                penalties=[float(penalties[k]) for k in rows],
                preds=[str(scored.results[k].get("pred", "")) for k in rows],
                version=version,
            )
        )
    return GenBatch(
        groups=groups, num_failed_rewards=scored.num_failed, gen_tokens=sum(r.response_length for r in results)
    )


def keep_flags(batch: GenBatch, cfg: DapoConfig) -> list[bool]:
    """Dynamic sampling (Eq. 11): keep groups whose *raw* metric varies; all groups when it is off."""
    if not cfg.algorithm.dynamic_sampling.enable:
        return [True] * len(batch.groups)
    metric_name = cfg.algorithm.dynamic_sampling.metric
    values, gids = [], []
    for g, group in enumerate(batch.groups):
        vals = [float(a) for a in group.acc] if metric_name == "acc" else group.scores
        values.extend(vals)
        gids.extend([g] * len(vals))
    mask = dynamic_sampling_mask(torch.tensor(values, dtype=torch.float64), gids)  # (N,)
    flags = [False] * len(batch.groups)
    for keep, g in zip(mask.tolist(), gids, strict=True):
        flags[g] = flags[g] or keep
    return flags


def zero_variance_flags(batch: GenBatch) -> list[bool]:
    """True for groups whose accuracy is all-equal (no signal), whatever the filter setting."""
    return [len(set(g.acc)) <= 1 for g in batch.groups]


@dataclass
class TrainBatchStats:
    advantages: list[float]
    rewards: list[float]
    scores: list[float]
    penalties: list[float]
    response_lengths: list[int]
    prompt_lengths: list[int]
    truncated: list[bool]
    num_loss_tokens: int


def build_train_batch(
    groups: Sequence[Group], cfg: DapoConfig, *, pad_token_id: int
) -> tuple[PolicyBatch, TrainBatchStats]:
    """Advantages per group (Eq. 9, on the shaped reward) and the padded batch; overlong filtering masks
    truncated responses out of the loss (same mask for numerator and the token-mean denominator)."""
    if not groups:
        raise ValueError("no groups to train on (dynamic sampling kept none and on_exhausted=continue)")
    prompts, responses, gids, rewards, trunc = [], [], [], [], []
    for g, group in enumerate(groups):
        for r, reward in zip(group.responses, group.rewards, strict=True):
            prompts.append(list(group.item.prompt_ids))
            responses.append(r.response_ids)
            gids.append(g)
            rewards.append(reward)
            trunc.append(r.truncated)
    adv = group_advantages(
        torch.tensor(rewards, dtype=torch.float32), gids, norm_by_std=cfg.algorithm.norm_adv_by_std
    )  # (N,)
    batch = build_policy_batch(
        prompts, responses, pad_token_id=pad_token_id, group_ids=gids, truncated=trunc, advantages=adv
    )
    rollout_lp = [r.log_probs for g in groups for r in g.responses]
    if all(lp is not None and len(lp) == len(r) for lp, r in zip(rollout_lp, responses, strict=True)):
        padded = torch.zeros_like(batch.response_mask)  # (N, T)
        for i, lp in enumerate(rollout_lp):
            padded[i, : len(lp)] = torch.as_tensor(lp, dtype=padded.dtype)  # type: ignore[arg-type]
        batch.extras[ROLLOUT_LOG_PROBS] = padded
    if cfg.algorithm.overlong.filtering:
        assert batch.truncated is not None
        batch.response_mask = overlong_filter_mask(batch.response_mask, batch.truncated)  # (N, T)
    stats = TrainBatchStats(
        advantages=adv.tolist(),
        rewards=rewards,
        scores=[s for g in groups for s in g.scores],
        penalties=[p for g in groups for p in g.penalties],
        response_lengths=[r.response_length for g in groups for r in g.responses],
        prompt_lengths=[len(g.item.prompt_ids) for g in groups for _ in g.responses],
        truncated=trunc,
        num_loss_tokens=int(batch.response_mask.sum()),
    )
    return batch, stats


ROLLOUT_LOG_PROBS = "rollout_log_probs"  # PolicyBatch.extras: (N, T) the sampler's log-probs of the sampled tokens
IS_WEIGHTS = "is_weights"  # PolicyBatch.extras: (N, T) truncated IS weights the policy loss multiplies in


def rollout_correction(batch: PolicyBatch, cfg: DapoConfig) -> dict[str, float]:
    """After ``old_log_probs``: the rollout/trainer mismatch (``mismatch/*``) and, with
    ``algorithm.rollout_correction.enable``, the truncated IS weights the update applies (``extras["is_weights"]``).
    No metrics when the sampler returned no log-probs (a backend that cannot)."""
    if batch.old_log_probs is None:
        raise ValueError("rollout_correction needs batch.old_log_probs: call executor.compute_log_probs first")
    rollout_lp = batch.extras.get(ROLLOUT_LOG_PROBS)
    rc = cfg.algorithm.rollout_correction
    if rollout_lp is None:
        if rc.enable:
            raise ValueError(
                "algorithm.rollout_correction.enable is true but the rollout backend returned no log-probs for "
                "this batch: use a backend that returns them (hf, vllm) or set algorithm.rollout_correction.enable=false"
            )
        return {}
    mask = batch.response_mask
    metrics = {f"mismatch/{k}": v for k, v in mismatch_metrics(rollout_lp, batch.old_log_probs, mask).items()}
    if rc.enable:
        weights, m = truncated_is_weights(batch.old_log_probs, rollout_lp, mask, cap=rc.cap)
        batch.extras[IS_WEIGHTS] = weights
        metrics.update({f"mismatch/{k}": v for k, v in m.items()})
    return metrics


def use_behaviour_log_probs(batch: PolicyBatch, cfg: DapoConfig) -> bool:
    """``rollout.mode=one_step_off`` without rollout correction: pi_old in the ratio is the behaviour policy, i.e.
    the sampler's log-probs (some rows come from weights a version behind the trainer's). With correction on,
    pi_old stays the trainer's recomputation and the truncated IS weights carry the lag. Call after
    ``rollout_correction`` (its mismatch metrics compare the sampler with the trainer). Returns whether it did."""
    if cfg.rollout.mode != "one_step_off" or cfg.algorithm.rollout_correction.enable:
        return False
    rollout_lp = batch.extras.get(ROLLOUT_LOG_PROBS)
    if rollout_lp is None:
        raise ValueError(
            "rollout.mode=one_step_off takes pi_old from the sampler's log-probs, but the rollout backend returned "
            "none for this batch: use a backend that returns them (hf, vllm), enable "
            "algorithm.rollout_correction (pi_old recomputed by the trainer), or set rollout.mode=sync"
        )
    batch.old_log_probs = rollout_lp
    return True


def sampler_log_probs(batch: PolicyBatch) -> torch.Tensor:
    """``algorithm.old_log_probs=rollout``: the sampler's log-probs of the sampled tokens ``(N, T)`` (0 on padding),
    to stand as pi_old instead of a trainer forward over the batch. Raises ``ValueError`` when the backend returned
    none for this batch."""
    rollout_lp = batch.extras.get(ROLLOUT_LOG_PROBS)
    if rollout_lp is None:
        raise ValueError(
            "algorithm.old_log_probs=rollout takes pi_old from the sampler's log-probs, but the rollout backend "
            "returned none for this batch: use a backend that returns them (hf, vllm) or set "
            "algorithm.old_log_probs=recompute"
        )
    return rollout_lp


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    return {f"{prefix}/mean": float(t.mean()), f"{prefix}/max": float(t.max()), f"{prefix}/min": float(t.min())}


def batch_metrics(stats: TrainBatchStats, batch: PolicyBatch) -> dict[str, float]:
    """The training batch's critic/*, response_length/*, prompt_length/mean and overlong/* metrics.

    Names: docs/design.md, "Metric names"."""
    m: dict[str, float] = {}
    m.update(_stats("critic/score", stats.scores))
    m.update(_stats("critic/rewards", stats.rewards))
    # advantages over the responses that count in the loss (overlong filtering excluded)
    counted = batch.response_mask.sum(dim=1) > 0  # (N,)
    adv = torch.tensor(stats.advantages, dtype=torch.float64)
    m.update(_stats("critic/advantages", adv[counted].tolist() if counted.any() else [0.0]))
    m.update(_stats("response_length", [float(x) for x in stats.response_lengths]))
    m["response_length/clip_ratio"] = sum(stats.truncated) / len(stats.truncated)
    m["prompt_length/mean"] = float(sum(stats.prompt_lengths)) / len(stats.prompt_lengths)
    m["overlong/penalty_mean"] = float(sum(stats.penalties)) / len(stats.penalties)
    m["overlong/frac"] = sum(p < 0 for p in stats.penalties) / len(stats.penalties)
    return m


def entropy_and_prob(log_probs: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """Rollout-policy entropy and mean token probability of the kept batch (the paper's Fig. 2/3 curves)."""
    out = {"actor/mean_prob": float(masked_mean(torch.exp(log_probs), mask))}
    if entropy is not None:
        out["actor/entropy"] = float(masked_mean(entropy, mask))
    return out
