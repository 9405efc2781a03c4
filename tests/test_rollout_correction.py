"""The rollout/trainer mismatch metrics and the truncated importance-sampling correction (issue 14): the pure
functions, the loss's token weights, and the training step on the tiny model (hf backend: mismatch ~0)."""

from __future__ import annotations

import math

import pytest
import torch
from train_fixtures import make_train_cfg

from dapo_core.algorithm import policy_loss
from dapo_core.algorithm.rollout_correction import mismatch_metrics, truncated_is_weights
from dapo_core.data.schema import read_rl_files
from dapo_core.engines.executor import LocalExecutor
from dapo_core.training.prompts import encode_prompts
from dapo_core.training.step import (
    IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    build_train_batch,
    generate_and_score,
    rollout_correction,
)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_mismatch_metrics_measure_only_the_loss_tokens() -> None:
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.4]]))
    rollout = old.clone()
    rollout[0, 0] = math.log(0.4)  # |dlogp| = log(1.25), |dp| = 0.1
    rollout[0, 2] = math.log(0.01)  # masked out: must not count
    rollout[1, 2] = math.log(0.5)  # |dlogp| = log(1.25), |dp| = 0.1
    m = mismatch_metrics(rollout, old, MASK)
    assert m["logp_abs_diff_max"] == pytest.approx(math.log(1.25))
    assert m["logp_abs_diff_mean"] == pytest.approx(2 * math.log(1.25) / 5)
    assert m["prob_abs_diff_max"] == pytest.approx(0.1)
    assert m["prob_abs_diff_mean"] == pytest.approx(0.2 / 5)
    assert mismatch_metrics(old, old, MASK) == dict.fromkeys(m, 0.0)
    assert mismatch_metrics(rollout, old, torch.zeros_like(MASK))["logp_abs_diff_max"] == 0.0
    with pytest.raises(ValueError, match="share one"):
        mismatch_metrics(rollout[:, :2], old, MASK)


def test_tis_weights_are_the_capped_ratio_on_the_mask() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.5], [1.0, 0.2, 0.5]]))  # ratios 1, 5, 1 / 0.5, 2.5, 1
    w, m = truncated_is_weights(old, rollout, MASK, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0], [0.5, 2.0, 1.0]]))
    assert m["tis_capped_frac"] == pytest.approx(2 / 5) and m["tis_weight_mean"] == pytest.approx(6.5 / 5)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, rollout, MASK, cap=0.0)


@pytest.mark.parametrize("mode", ["ppo-clip", "cispo"])
def test_token_weights_scale_each_tokens_gradient(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64) - 0.1
    new = (old + 0.01 * torch.randn(4, 5, generator=g, dtype=torch.float64)).requires_grad_(True)  # inside the clip
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.float64)
    w = torch.rand(4, 5, generator=g, dtype=torch.float64) * 2
    lo = 0.2 if mode == "ppo-clip" else None
    kw = {"mode": mode, "clip_low": lo, "clip_high": 0.28, "loss_agg": "token-mean"}
    (plain,) = torch.autograd.grad(policy_loss(new, old, adv, mask, **kw)[0], new)
    (weighted,) = torch.autograd.grad(policy_loss(new, old, adv, mask, token_weights=w, **kw)[0], new)
    torch.testing.assert_close(weighted, w * plain)
    ones, _ = policy_loss(new, old, adv, mask, token_weights=torch.ones_like(w), **kw)
    torch.testing.assert_close(ones, policy_loss(new, old, adv, mask, **kw)[0])
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(new, old, adv, mask, token_weights=w[:, :2], **kw)


def _batch(tmp_path, *extra: str):
    cfg = make_train_cfg(tmp_path, *extra)
    executor = LocalExecutor(cfg)
    records = read_rl_files(cfg.data.train_files)[:4]
    items = encode_prompts(records, executor.tokenizer, max_prompt_length=cfg.data.max_prompt_length)
    gen = generate_and_score(executor, items, cfg, seed=3)
    batch, _ = build_train_batch(gen.groups, cfg, pad_token_id=executor.tokenizer.pad_token_id)
    batch.old_log_probs, _ = executor.compute_log_probs(batch)
    return cfg, executor, batch


def test_the_hf_sampler_and_the_trainer_agree_and_tis_is_applied(tmp_path) -> None:
    cfg, executor, batch = _batch(tmp_path / "a")
    assert batch.extras[ROLLOUT_LOG_PROBS].shape == batch.response_mask.shape
    m = rollout_correction(batch, cfg)
    assert m["mismatch/logp_abs_diff_max"] < 1e-5 and m["mismatch/prob_abs_diff_max"] < 1e-5
    assert IS_WEIGHTS not in batch.extras  # off by default: measured, not applied

    on = ["algorithm.rollout_correction.enable=true", "algorithm.rollout_correction.cap=1.5"]
    cfg, executor, batch = _batch(tmp_path / "b", *on)
    # a sampler that was 3x less likely on the first token of every response: weight min(3, 1.5) there
    batch.extras[ROLLOUT_LOG_PROBS][:, 0] -= math.log(3.0)
    m = rollout_correction(batch, cfg)
    w = batch.extras[IS_WEIGHTS]
    torch.testing.assert_close(w[:, 0], torch.full_like(w[:, 0], 1.5), atol=1e-4, rtol=0)
    torch.testing.assert_close(w[:, 1:], batch.response_mask[:, 1:], atol=1e-4, rtol=0)
    n_tokens = float(batch.response_mask.sum())
    assert m["mismatch/tis_capped_frac"] == pytest.approx(batch.num_responses / n_tokens)
    weighted = executor.update(batch)  # the weights travel through mini- and micro-batches into the loss
    # the same batch and model without the correction: a different loss (the weights reached it)
    _, executor2, batch2 = _batch(tmp_path / "c")
    assert torch.equal(batch2.input_ids, batch.input_ids)
    plain = executor2.update(batch2)
    assert math.isfinite(weighted["pg_loss"]) and weighted["pg_loss"] != pytest.approx(plain["pg_loss"], abs=1e-6)


def test_tis_without_sampler_log_probs_is_a_clear_error(tmp_path) -> None:
    cfg, _, batch = _batch(tmp_path, "algorithm.rollout_correction.enable=true")
    del batch.extras[ROLLOUT_LOG_PROBS]
    with pytest.raises(ValueError, match="returned no log-probs"):
        rollout_correction(batch, cfg)
