"""MLflow metric names, in one place (docs/design.md, "Metric names"; mirror verl's where verl has one).

MLflow keys allow only letters, digits, ``_ - . / :`` and space, hence ``mean_at_32`` rather than ``mean@32``.
"""

from __future__ import annotations

import hashlib
import re

# actor/*: the policy update
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high"
ACTOR_PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_MEAN_PROB = "actor/mean_prob"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"

# critic/*: rewards and advantages ({mean,max,min} each)
CRITIC_SCORE = "critic/score"
CRITIC_REWARDS = "critic/rewards"
CRITIC_ADVANTAGES = "critic/advantages"
STATS = ("mean", "max", "min")

# train/*: dynamic sampling and accuracy
TRAIN_STEP = "train/step"
TRAIN_GEN_BATCHES_TOTAL = "train/gen_batches_total"
TRAIN_ACC_MEAN = "train/acc/mean"
TRAIN_NUM_GEN_BATCHES = "train/num_gen_batches"
TRAIN_KEPT_GROUPS_FRAC = "train/kept_groups_frac"
TRAIN_ZERO_STD_GROUPS_FRAC = "train/zero_std_groups_frac"

RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
RESPONSE_LENGTH_MIN = "response_length/min"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
PROMPT_LENGTH_MEAN = "prompt_length/mean"

OVERLONG_PENALTY_MEAN = "overlong/penalty_mean"
OVERLONG_FRAC = "overlong/frac"

ROLLOUT_REFLECTION_RATE = "rollout/reflection_rate"

# mismatch/*: the sampler's log-probs vs the trainer's (algorithm.rollout_correction; TIS keys only when enabled)
MISMATCH_LOGP_ABS_DIFF_MEAN = "mismatch/logp_abs_diff_mean"
MISMATCH_LOGP_ABS_DIFF_MAX = "mismatch/logp_abs_diff_max"
MISMATCH_PROB_ABS_DIFF_MEAN = "mismatch/prob_abs_diff_mean"
MISMATCH_PROB_ABS_DIFF_MAX = "mismatch/prob_abs_diff_max"
MISMATCH_TIS_WEIGHT_MEAN = "mismatch/tis_weight_mean"
MISMATCH_TIS_CAPPED_FRAC = "mismatch/tis_capped_frac"

# rollout/*staleness*: weight versions the trained samples lag the trainer (rollout.mode=one_step_off; 0 in sync)
ROLLOUT_STALENESS_MEAN = "rollout/staleness_mean"
ROLLOUT_STALENESS_MAX = "rollout/staleness_max"
ROLLOUT_OFF_POLICY_GROUPS_FRAC = "rollout/off_policy_groups_frac"

TIMING_PHASES = (
    "gen",
    "reward",
    "filter",
    "old_log_prob",
    "adv",
    "update_actor",
    "sync_weights",
    "save_checkpoint",
    "testing",
    "step",
)

PERF_THROUGHPUT = "perf/throughput"
PERF_TIME_PER_STEP = "perf/time_per_step"
PERF_CPU_TIME_PER_STEP = "perf/cpu_time_per_step"  # the training process's CPU seconds (all threads)
PERF_TOTAL_NUM_TOKENS = "perf/total_num_tokens"
PERF_CPU_MEMORY_USED_GB = "perf/cpu_memory_used_gb"
# the weight sync after each update: payload bytes each rollout engine received (0 when the rollout shares the
# trainer's module) and the seconds the executor measured for it (gather + transfer + load; timing_s/sync_weights
# is the whole task's wall time)
PERF_SYNC_BYTES = "perf/sync_bytes"
TIMING_WEIGHT_SYNC = "timing_s/weight_sync"

_MLFLOW_KEY = re.compile(r"^[A-Za-z0-9_\-./: ]+$")


def timing(phase: str) -> str:
    """``timing_s/<phase>`` for one of TIMING_PHASES."""
    if phase not in TIMING_PHASES:
        raise ValueError(f"unknown timing phase {phase!r}; valid phases: {', '.join(TIMING_PHASES)}")
    return f"timing_s/{phase}"


def stat(prefix: str, which: str) -> str:
    """``<prefix>/<mean|max|min>``, e.g. ``stat(CRITIC_SCORE, "mean") == "critic/score/mean"``."""
    if which not in STATS:
        raise ValueError(f"unknown statistic {which!r}; valid: {', '.join(STATS)}")
    return f"{prefix}/{which}"


def val_metric(data_source: str, kind: str, k: int) -> str:
    """``val/<data_source>/acc/<kind>_at_<k>`` with kind in {mean, pass, maj}."""
    if kind not in ("mean", "pass", "maj"):
        raise ValueError(f"unknown validation metric kind {kind!r}; valid: mean, pass, maj")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return f"val/{key_segment(data_source)}/acc/{kind}_at_{k}"


def is_valid_mlflow_key(key: str) -> bool:
    return bool(_MLFLOW_KEY.match(key))


_SEGMENT_BAD = re.compile(r"[^A-Za-z0-9_\-. :]")
_SEGMENT_MAX = 100


def key_segment(name: str) -> str:
    """``name`` (a data source, any text) as one level of an MLflow key.

    A name of ASCII letters, digits and ``_ - . :`` or spaces (not ``.``/``..``, at most 100 characters) is kept
    as it is; any other name has each other character replaced by ``_`` and gets ``-`` plus 8 hex digits of its
    hash, so distinct names stay distinct keys: ``aime@24`` -> ``aime_24-<hash>``, ``lighteval/MATH`` ->
    ``lighteval_MATH-<hash>`` (a slash would add a level)."""
    if not _SEGMENT_BAD.search(name) and name == name.strip() and name not in ("", ".", "..") and len(name) <= _SEGMENT_MAX:  # fmt: skip
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{_SEGMENT_BAD.sub('_', name.strip())[: _SEGMENT_MAX - 9].strip('.')}-{digest}"


def training_metric_names() -> list[str]:
    """Every training metric (not val/* or rollout/reflection_rate, which come from evaluation)."""
    names = [
        ACTOR_PG_LOSS,
        ACTOR_PG_CLIPFRAC,
        ACTOR_PG_CLIPFRAC_HIGH,
        ACTOR_PG_CLIPFRAC_LOW,
        ACTOR_PPO_KL,
        ACTOR_ENTROPY,
        ACTOR_MEAN_PROB,
        ACTOR_GRAD_NORM,
        ACTOR_LR,
    ]
    names += [stat(p, s) for p in (CRITIC_SCORE, CRITIC_REWARDS, CRITIC_ADVANTAGES) for s in STATS]
    names += [
        TRAIN_ACC_MEAN,
        TRAIN_NUM_GEN_BATCHES,
        TRAIN_KEPT_GROUPS_FRAC,
        TRAIN_ZERO_STD_GROUPS_FRAC,
        TRAIN_GEN_BATCHES_TOTAL,
        RESPONSE_LENGTH_MEAN,
        RESPONSE_LENGTH_MAX,
        RESPONSE_LENGTH_MIN,
        RESPONSE_LENGTH_CLIP_RATIO,
        PROMPT_LENGTH_MEAN,
        OVERLONG_PENALTY_MEAN,
        OVERLONG_FRAC,
        MISMATCH_LOGP_ABS_DIFF_MEAN,
        MISMATCH_LOGP_ABS_DIFF_MAX,
        MISMATCH_PROB_ABS_DIFF_MEAN,
        MISMATCH_PROB_ABS_DIFF_MAX,
        ROLLOUT_STALENESS_MEAN,
        ROLLOUT_STALENESS_MAX,
        ROLLOUT_OFF_POLICY_GROUPS_FRAC,
    ]
    names += [timing(p) for p in TIMING_PHASES]
    names += [
        PERF_THROUGHPUT,
        PERF_TIME_PER_STEP,
        PERF_CPU_TIME_PER_STEP,
        PERF_TOTAL_NUM_TOKENS,
        PERF_CPU_MEMORY_USED_GB,
        PERF_SYNC_BYTES,
        TIMING_WEIGHT_SYNC,
    ]
    return names
