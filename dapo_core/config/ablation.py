"""The ablation ladder of DAPO's Table 1, as `--set` overrides computed from a resolved DAPO recipe.

Pure data and helpers (no Prefect, no MLflow); ``dapo ablation`` (flows/ablation.py) runs the ladder:

    cfg = load_config(recipe="tiny-dapo")
    for rung in build_ladder(cfg):
        rung.name, rung.overrides()   # "grpo", ["algorithm.overlong.filtering=false", "algorithm.clip_high=0.2", ...]

Every rung sets every key of ``LADDER_KEYS``, so a rung means the same thing whatever the recipe was, and the
last rung (``dapo``) sets each key to the recipe's own value: it *is* the recipe. The rungs are cumulative, as in
Table 1 (AIME 2024 avg@32, Qwen2.5-32B): GRPO 30 -> +overlong filtering 36 -> +clip-higher 38 -> +soft overlong
punishment 41 -> +token-level loss 42 -> +dynamic sampling 50. A supervised control (``sft-control``) closes the
table: the same base model given the dapo rung's training time of continued supervised training, on the warm
start's own demonstrations (``sft-control``) and on clean ones (``sft-control-clean``).

DAPO's successors can stand beside the ladder (``build_ladder(cfg, rungs=[..., "gspo"])``, ``dapo ablation --rungs``):
``gspo``, ``cispo`` and ``gmpo`` are the dapo rung with that objective instead of PPO-clip (their bounds from the
config's ``algorithm.gspo`` / ``cispo`` / ``gmpo`` sections, the papers' defaults); ``dr-grpo`` is the grpo rung
without GRPO's std normalisation and length normalisation (Dr. GRPO).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dapo_core.config.schema import DapoConfig

# The keys the ladder turns, in the order Table 1 adds the techniques.
LADDER_KEYS: tuple[str, ...] = (
    "algorithm.overlong.filtering",
    "algorithm.clip_high",
    "algorithm.overlong.shaping",
    "algorithm.loss_agg",
    "algorithm.dynamic_sampling.enable",
    "data.gen_batch_size",
    "algorithm.policy_loss",
    "algorithm.norm_adv_by_std",
)

SFT_CONTROL = "sft-control"  # continued SFT on the warm start's own demonstrations (habits included)
SFT_CONTROL_CLEAN = "sft-control-clean"  # continued SFT on clean demonstrations (they stop at the answer line)
CONTROL_RUNGS: tuple[str, ...] = (SFT_CONTROL, SFT_CONTROL_CLEAN)
RUNG_NAMES: tuple[str, ...] = (
    "grpo",
    "overlong-filtering",
    "clip-higher",
    "soft-overlong",
    "token-level-loss",
    "dapo",
)
ALL_RUNGS: tuple[str, ...] = (*RUNG_NAMES, *CONTROL_RUNGS)  # the default plan: Table 1 and the controls
SUCCESSOR_RUNGS: tuple[str, ...] = ("gspo", "cispo", "gmpo", "dr-grpo")  # beside the ladder (issue 17)
KNOWN_RUNGS: tuple[str, ...] = (*RUNG_NAMES, *SUCCESSOR_RUNGS, *CONTROL_RUNGS)

# DAPO paper, Table 1: AIME 2024 avg@32 of Qwen2.5-32B after each cumulative technique.
PAPER_AIME: dict[str, float] = {
    "grpo": 30.0,
    "overlong-filtering": 36.0,
    "clip-higher": 38.0,
    "soft-overlong": 41.0,
    "token-level-loss": 42.0,
    "dapo": 50.0,
}

# Evidence collected per rung: the mean over the run of each logged metric (docs/design.md, "Metric names").
EVIDENCE_KEYS: tuple[str, ...] = (
    "actor/pg_clipfrac_high",
    "actor/pg_clipfrac_low",
    "response_length/clip_ratio",
    "train/kept_groups_frac",
    "actor/entropy",
    "response_length/mean",
)
# The stop split of each final model's evaluation (``metrics.stop_metrics``), every rung and control: the share of
# responses that stop at their answer line and the accuracy of those (the arithmetic), apart from stopping.
STOP_KEYS: tuple[str, ...] = ("stop/stopped_rate", "stop/acc_when_stopped")

REGIMES: tuple[str, ...] = ("tuned", "aggressive")
# The aggressive regime's default lr: this many times the recipe's trainer.lr, the lowest multiple at which GRPO
# collapsed on both probe seeds while DAPO held. Chosen on the 200-problem probe set (never the held-out problems):
# tiny-dapo, 16 steps, probe avg@8 at step 16, GRPO / DAPO, seeds 1 and 2: 3x 15.9, 9.0 / 20.1, 18.1 (GRPO collapses
# on one seed of two); 4x 4.4, 4.4 / 15.6, 15.7; 5x 0.3, 0.8 / 14.6, 7.8 (DAPO too, on seed 2). The earlier 3x ran
# 5 seeds on held-out problems: GRPO collapsed on 3 of 5 (benchmarks/results/ablation-5seeds-lr3e-4.md).
AGGRESSIVE_LR_FACTOR = 4.0
# validation points per training curve that trainer.test_freq aims for (the last at the final step); step 0 is the
# base model's evaluation, shared by every run (two points keep a run's evaluations to 3 of 1,600 samples each)
CURVE_POINTS = 2


@dataclass(frozen=True)
class Rung:
    """One row of the ladder: its name, what it adds, the paper's number and every ladder key's value."""

    name: str
    adds: str
    keys: tuple[str, ...]  # the ladder keys this rung's technique turns (vs the previous rung)
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def paper_aime(self) -> float | None:
        return PAPER_AIME.get(self.name)  # None beside the ladder (the successors are not in Table 1)

    def overrides(self) -> list[str]:
        """``dotted.key=value`` strings (YAML values, as ``--set`` takes them), one per ladder key."""
        return [f"{key}={_yaml_scalar(self.settings[key])}" for key in LADDER_KEYS]


@dataclass(frozen=True)
class Regime:
    """An optimisation regime: the same ladder at another learning rate."""

    name: str
    lr: float


def _yaml_scalar(value: Any) -> str:
    # JSON scalars are YAML scalars: true/false, 0.28, 1e-05; strings stay bare (`token-mean`)
    return value if isinstance(value, str) else json.dumps(value)


def recipe_settings(cfg: DapoConfig) -> dict[str, Any]:
    """The recipe's value of every ladder key."""
    a = cfg.algorithm
    return {
        "algorithm.overlong.filtering": a.overlong.filtering,
        "algorithm.clip_high": a.clip_high,
        "algorithm.overlong.shaping": a.overlong.shaping,
        "algorithm.loss_agg": a.loss_agg,
        "algorithm.dynamic_sampling.enable": a.dynamic_sampling.enable,
        "data.gen_batch_size": cfg.data.gen_batch_size,
        "algorithm.policy_loss": a.policy_loss,
        "algorithm.norm_adv_by_std": a.norm_adv_by_std,
    }


def check_dapo_recipe(cfg: DapoConfig) -> None:
    """The ladder climbs to the recipe, so the recipe must use all of DAPO's techniques; ValueError otherwise."""
    a = cfg.algorithm
    problems = []
    if a.clip_high <= a.clip_low:
        problems.append(
            f"algorithm.clip_high ({a.clip_high}) must be > algorithm.clip_low ({a.clip_low}) for the clip-higher "
            "rung: set e.g. --set algorithm.clip_high=0.28"
        )
    if a.loss_agg != "token-mean":
        problems.append(
            f"algorithm.loss_agg ({a.loss_agg}) must be token-mean for the token-level-loss rung: "
            "set --set algorithm.loss_agg=token-mean"
        )
    if not a.dynamic_sampling.enable:
        problems.append(
            "algorithm.dynamic_sampling.enable is false, the dapo rung needs it: "
            "set --set algorithm.dynamic_sampling.enable=true"
        )
    if a.policy_loss != "ppo-clip":
        problems.append(
            f"algorithm.policy_loss ({a.policy_loss}) must be ppo-clip, the objective of Table 1: use --recipe "
            f"tiny-dapo and put {a.policy_loss} beside the ladder with --rungs grpo,...,dapo,{a.policy_loss}"
        )
    if not a.norm_adv_by_std:
        problems.append(
            "algorithm.norm_adv_by_std is false, GRPO and DAPO divide by the group std (Eq. 9): "
            "set --set algorithm.norm_adv_by_std=true"
        )
    if not a.overlong.shaping:
        problems.append(
            "algorithm.overlong.shaping is false, the soft-overlong rung needs it: "
            "set --set algorithm.overlong.shaping=true"
        )
    if problems:
        raise ValueError(
            f"the ablation ladder climbs to the recipe ({cfg.recipe}), which must be a DAPO recipe (e.g. --recipe "
            "tiny-dapo):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def build_ladder(cfg: DapoConfig, rungs: Sequence[str] | None = None) -> list[Rung]:
    """The six cumulative rungs of Table 1, from GRPO up to the recipe itself (see the module doc); with ``rungs``
    (names from ``parse_rungs``), those rungs in that order, successors included (the controls are not
    training rungs and are skipped here)."""
    check_dapo_recipe(cfg)
    recipe = recipe_settings(cfg)
    grpo = {
        "algorithm.overlong.filtering": False,
        "algorithm.clip_high": cfg.algorithm.clip_low,  # symmetric clipping: eps_high = eps_low
        "algorithm.overlong.shaping": False,
        "algorithm.loss_agg": "seq-mean-token-mean",  # the sample-level loss of GRPO
        "algorithm.dynamic_sampling.enable": False,
        "data.gen_batch_size": cfg.data.train_batch_size,  # no over-sampling without dynamic sampling
        "algorithm.policy_loss": "ppo-clip",
        "algorithm.norm_adv_by_std": True,
    }
    steps: list[tuple[str, str, dict[str, Any]]] = [
        ("grpo", "GRPO baseline", {}),
        ("overlong-filtering", "+ overlong filtering (mask truncated samples)", {"algorithm.overlong.filtering": True}),
        ("clip-higher", "+ clip-higher (decoupled eps_high, Eq. 10)", {"algorithm.clip_high": recipe["algorithm.clip_high"]}),
        (
            "soft-overlong",
            "+ soft overlong punishment (Eq. 13)",
            # The paper's final DAPO recipe punishes overlong samples softly instead of filtering them, so this
            # rung switches filtering back to the recipe's value (off in the paper's recipe and in tiny-dapo).
            {
                "algorithm.overlong.shaping": True,
                "algorithm.overlong.filtering": recipe["algorithm.overlong.filtering"],
            },
        ),
        ("token-level-loss", "+ token-level policy-gradient loss", {"algorithm.loss_agg": recipe["algorithm.loss_agg"]}),
        (
            "dapo",
            "+ dynamic sampling (= the recipe)",
            {
                "algorithm.dynamic_sampling.enable": True,
                "data.gen_batch_size": recipe["data.gen_batch_size"],
            },
        ),
    ]  # fmt: skip
    ladder: list[Rung] = []
    current = dict(grpo)
    for name, adds, change in steps:
        current = {**current, **change}
        ladder.append(Rung(name=name, adds=adds, keys=tuple(change), settings=dict(current)))
    if rungs is None:
        return ladder
    beside = _successor_rungs(ladder[0], ladder[-1])
    by_name = {r.name: r for r in [*ladder, *beside]}
    return [by_name[n] for n in parse_rungs(rungs) if n not in CONTROL_RUNGS]


def _successor_rungs(grpo: Rung, dapo: Rung) -> list[Rung]:
    """GSPO, CISPO, GMPO on the dapo rung; Dr. GRPO on the grpo rung (module doc)."""
    changes: list[tuple[str, str, Rung, dict[str, Any]]] = [
        ("gspo", "dapo with GSPO's sequence-level ratio and clip", dapo,
         {"algorithm.policy_loss": "gspo", "algorithm.loss_agg": "seq-mean-token-mean"}),
        ("cispo", "dapo with CISPO's clipped stop-gradient IS weight", dapo,
         {"algorithm.policy_loss": "cispo", "algorithm.loss_agg": "token-mean"}),
        ("gmpo", "dapo with GMPO's geometric mean of token ratios", dapo,
         {"algorithm.policy_loss": "gmpo", "algorithm.loss_agg": "seq-mean-token-mean"}),
        ("dr-grpo", "grpo without std and length normalisation (Dr. GRPO)", grpo,
         {"algorithm.norm_adv_by_std": False, "algorithm.loss_agg": "seq-mean-token-sum-norm"}),
    ]  # fmt: skip
    return [
        Rung(name=name, adds=adds, keys=tuple(change), settings={**base.settings, **change})
        for name, adds, base, change in changes
    ]


def parse_rungs(text: str | Sequence[str]) -> list[str]:
    """``"grpo,dapo,gspo,sft-control"`` (or a list) -> validated rung names in the given order, without repeats.
    Each control (``sft-control``, ``sft-control-clean``) needs ``dapo`` (its budget is the dapo rung's training time)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = list(dict.fromkeys(n.strip() for n in items if n.strip()))
    unknown = [n for n in names if n not in KNOWN_RUNGS]
    if unknown or not names:
        raise ValueError(
            f"--rungs {text!r}: unknown rung(s) {unknown or '(none given)'}; valid: {', '.join(KNOWN_RUNGS)} "
            "(comma-separated, e.g. --rungs grpo,dapo,gspo,sft-control)"
        )
    controls = [n for n in names if n in CONTROL_RUNGS]
    if controls and "dapo" not in names:
        raise ValueError(
            f"--rungs {text!r}: {', '.join(controls)} spend(s) the dapo rung's training time, so it needs dapo "
            f"among the rungs: add dapo, or leave {', '.join(controls)} out"
        )
    return names


def parse_regimes(text: str | Sequence[str]) -> list[str]:
    """``"tuned,aggressive"`` (or a list) -> validated regime names, in the given order, without repeats."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in items if n.strip()]
    unknown = [n for n in names if n not in REGIMES]
    if unknown or not names:
        raise ValueError(
            f"--regimes {text!r}: unknown regime(s) {unknown or '(none given)'}; valid: {', '.join(REGIMES)} "
            "(comma-separated, e.g. --regimes tuned,aggressive)"
        )
    return list(dict.fromkeys(names))


def build_regimes(
    cfg: DapoConfig, names: str | Sequence[str], *, tuned_lr: float | None = None, aggressive_lr: float | None = None
) -> list[Regime]:
    """``tuned``: the recipe's trainer.lr (or ``tuned_lr``); ``aggressive``: ``aggressive_lr``, default ``AGGRESSIVE_LR_FACTOR`` (4) x that."""
    for flag, lr in (("--tuned-lr", tuned_lr), ("--aggressive-lr", aggressive_lr)):
        if lr is not None and not lr > 0:
            raise ValueError(f"{flag} ({lr}) must be a learning rate > 0, e.g. {flag} 1e-4")
    lrs = {
        "tuned": tuned_lr if tuned_lr is not None else cfg.trainer.lr,
        "aggressive": aggressive_lr if aggressive_lr is not None else cfg.trainer.lr * AGGRESSIVE_LR_FACTOR,
    }
    return [Regime(name, float(lrs[name])) for name in parse_regimes(names)]


def curve_test_freq(total_steps: int, points: int = CURVE_POINTS) -> int:
    """The smallest divisor of ``total_steps`` giving at most ``points`` validations (plus step 0): the curve has
    points and the last step is always one of them."""
    if total_steps < 1:
        raise ValueError(f"the number of gradient steps ({total_steps}) must be >= 1, e.g. --steps 24")
    return next(d for d in range(1, total_steps + 1) if total_steps % d == 0 and total_steps // d <= points)


def run_name(regime: str, rung: str, seed: int) -> str:
    """``ablation-<regime>-<rung>-s<seed>``: the training run's name (and output directory)."""
    return f"ablation-{regime}-{rung}-s{seed}"


def run_overrides(
    user: Sequence[str], rung: Rung, regime: Regime, seed: int, steps: int, *, model_path: str | None = None
) -> list[str]:
    """The `--set` list of one training run: the user's, then the rung, the regime's lr, seed, steps, curve points
    (the ablation's own keys come last, so they win)."""
    return [
        *user,
        *rung.overrides(),
        *([f"model.path={model_path}"] if model_path else []),
        f"trainer.lr={_yaml_scalar(regime.lr)}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={steps}",
        f"tracking.run_name={run_name(regime.name, rung.name, seed)}",
        f"trainer.test_freq={curve_test_freq(steps)}",
        "trainer.val_before_train=false",  # step 0 is the base model, evaluated once for every run
    ]
