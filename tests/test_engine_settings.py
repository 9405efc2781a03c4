"""One way from config to engine (issue 44): the engines' settings are built from the config sections, which hold
every default; the engine dataclasses restate none of them."""

from __future__ import annotations

import dataclasses

import pytest

from dapo_core.config import AlgorithmConfig, RolloutConfig, TrainerConfig, load_config
from dapo_core.engines.executor import loss_config_from, sampling_from
from dapo_core.engines.loss import LossConfig
from dapo_core.engines.optim import OptimConfig
from dapo_core.engines.rollout.base import SamplingConfig

# fields no config key sets (chosen per call): the only ones that may keep a default
ENGINE_ONLY = {SamplingConfig: {"seed", "return_log_probs"}, LossConfig: set(), OptimConfig: set()}


@pytest.mark.parametrize("cls", [LossConfig, OptimConfig, SamplingConfig])
def test_engine_settings_restate_no_config_default(cls):
    defaulted = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    assert defaulted == ENGINE_ONLY[cls]
    with pytest.raises(TypeError, match="missing"):
        cls()  # nothing to fall back on: the values come from a section


def test_default_sections_give_the_schema_defaults():
    t, a, r = TrainerConfig(), AlgorithmConfig(), RolloutConfig()
    optim = OptimConfig.from_config(t)
    assert (optim.lr, optim.weight_decay, optim.grad_clip, optim.warmup_steps, optim.scheduler) == (
        t.lr, t.weight_decay, t.grad_clip, t.lr_warmup_steps, t.lr_scheduler,
    )  # fmt: skip
    assert (optim.total_steps, optim.min_lr_ratio, optim.betas) == (t.total_steps, t.min_lr_ratio, tuple(t.betas))
    loss = LossConfig.from_config(a, max_response_length=80)
    fields = AlgorithmConfig.model_fields
    assert (loss.mode, loss.clip_low, loss.clip_high, loss.clip_c) == (
        fields["policy_loss"].default, fields["clip_low"].default, fields["clip_high"].default,
        fields["clip_c"].default,
    )  # fmt: skip
    assert (loss.loss_agg, loss.norm_length, loss.entropy_coef) == (a.loss_agg, None, a.entropy_coef)
    train = SamplingConfig.from_config(r, max_new_tokens=80, seed=3)
    assert (train.n, train.temperature, train.top_p, train.top_k) == (r.n, r.temperature, r.top_p, r.top_k)
    val = SamplingConfig.from_config(r, max_new_tokens=80, seed=3, validation=True, log_probs=True)
    assert (val.n, val.temperature, val.top_p, val.top_k) == (r.val_n, r.val_temperature, r.val_top_p, r.val_top_k)
    assert (val.max_new_tokens, val.seed, val.return_log_probs) == (80, 3, True)


def test_a_changed_knob_reaches_the_engine():
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=["algorithm.clip_high=0.3", "rollout.top_k=5", "rollout.val_n=3", "trainer.lr=2e-4"],
        env={},
    )
    assert loss_config_from(cfg).clip_high == 0.3
    assert OptimConfig.from_config(cfg.trainer).lr == 2e-4
    assert sampling_from(cfg, seed=0).top_k == 5 and sampling_from(cfg, seed=0, validation=True).n == 3
    assert sampling_from(cfg, seed=0).max_new_tokens == cfg.data.max_response_length  # rollout.max_new_tokens: null
    # a successor objective takes its bounds from its own section; Dr. GRPO's constant defaults to L_max
    gspo = load_config(recipe="tiny-dapo", overrides=["algorithm.policy_loss=gspo"], env={})
    assert (loss_config_from(gspo).clip_low, loss_config_from(gspo).clip_high) == (3e-4, 4e-4)
    norm = load_config(recipe="tiny-dapo", overrides=["algorithm.loss_agg=seq-mean-token-sum-norm"], env={})
    assert loss_config_from(norm).norm_length == norm.data.max_response_length
