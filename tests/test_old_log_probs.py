"""``algorithm.old_log_probs: rollout``: the sampler's log-probs stand as pi_old, and the trainer's forward over
the batch before the updates is skipped. On the hf backend the sampler is the trainer's own module at the rollout
temperature, so the step is the recomputing one up to float summation order."""

from __future__ import annotations

import pytest
import torch
from train_fixtures import make_train_cfg
from train_fixtures import metric_history as history
from train_fixtures import run_train as run

from dapo_core.config import ConfigError, load_config
from dapo_core.engines.batch import PolicyBatch, build_policy_batch
from dapo_core.engines.executor import LocalExecutor
from dapo_core.training.step import ROLLOUT_LOG_PROBS, sampler_log_probs

ROLLOUT = "algorithm.old_log_probs=rollout"
# one step of one generation batch and one mini-batch: the update's forward is the policy before it moves
ONE = (
    "algorithm.dynamic_sampling.enable=false",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "trainer.total_steps=1",
    "trainer.ppo_mini_batch_size=4",
)


@pytest.fixture(scope="module")
def harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


def test_the_knob_and_its_checks() -> None:
    assert load_config(recipe="tiny-dapo", env={}).algorithm.old_log_probs == "recompute"  # verl's default
    assert load_config(recipe="tiny-dapo", overrides=[ROLLOUT], env={}).algorithm.old_log_probs == "rollout"
    with pytest.raises(ConfigError, match=r"old_log_probs \(rollout\) skips the trainer's recomputation"):
        load_config(recipe="tiny-dapo", overrides=[ROLLOUT, "algorithm.rollout_correction.enable=true"], env={})
    with pytest.raises(ConfigError, match="vLLM returns raw log-probs"):
        load_config(recipe="tiny-dapo", overrides=[ROLLOUT, "rollout.backend=vllm", "rollout.temperature=0.8"], env={})
    load_config(recipe="tiny-dapo", overrides=[ROLLOUT, "rollout.backend=vllm", "rollout.temperature=1.0"], env={})
    with pytest.raises(ConfigError, match="old_log_probs"):
        load_config(recipe="tiny-dapo", overrides=["algorithm.old_log_probs=cached"], env={})


def test_a_batch_without_sampler_log_probs_is_refused() -> None:
    batch = build_policy_batch([[5, 6]], [[7, 8]], pad_token_id=0, group_ids=[0])
    with pytest.raises(ValueError, match=r"returned none for this batch.*old_log_probs=recompute"):
        sampler_log_probs(batch)
    batch.extras[ROLLOUT_LOG_PROBS] = torch.full((1, 2), -0.5)
    assert torch.equal(sampler_log_probs(batch), torch.full((1, 2), -0.5))


def test_the_step_skips_the_forward_and_matches_the_recomputing_one(tmp_path, monkeypatch, harness) -> None:
    forwards: list[int] = []
    updates: dict[str, PolicyBatch] = {}
    real_forward, real_update = LocalExecutor.compute_log_probs, LocalExecutor.update

    def compute_log_probs(self, batch, *, with_entropy=False):
        forwards.append(batch.num_responses)
        return real_forward(self, batch, with_entropy=with_entropy)

    def update(self, batch):
        updates[mode] = batch
        return real_update(self, batch)

    monkeypatch.setattr(LocalExecutor, "compute_log_probs", compute_log_probs)
    monkeypatch.setattr(LocalExecutor, "update", update)
    runs = {}
    for mode in ("recompute", "rollout"):
        forwards.clear()
        cfg = make_train_cfg(tmp_path / mode, *ONE, f"algorithm.old_log_probs={mode}")
        runs[mode] = run(cfg, tmp_path / mode)
        assert len(forwards) == (1 if mode == "recompute" else 0), mode

    got, ref = updates["rollout"], updates["recompute"]
    assert torch.equal(got.responses, ref.responses)  # the same samples: same seed, same weights
    assert torch.equal(got.old_log_probs, got.extras[ROLLOUT_LOG_PROBS])  # pi_old is the sampler's, as it is
    mask = ref.response_mask.bool()
    torch.testing.assert_close(got.old_log_probs[mask], ref.old_log_probs[mask], rtol=0, atol=2e-5)
    assert float(got.old_log_probs[mask].std()) > 0.1  # real log-probs of a random model, not a constant fill

    def last(mode: str, key: str) -> float:
        points = history(runs[mode]["run_id"], key)
        assert [s for s, _ in points] == [1], (mode, key)
        return points[0][1]

    # one mini-batch: the update's forward is the policy before it moves, so its entropy is pi_old's
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/mean_prob", "train/acc/mean"):
        assert last("rollout", key) == pytest.approx(last("recompute", key), rel=1e-4, abs=1e-6), key
    assert history(runs["recompute"]["run_id"], "mismatch/logp_abs_diff_mean") != []
    assert history(runs["rollout"]["run_id"], "mismatch/logp_abs_diff_mean") == []  # nothing to compare with
