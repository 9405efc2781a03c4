"""Pure parts of the training step: group filtering, advantages, overlong handling, sampler, health alerts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.config import load_config
from dapo_core.data.schema import ProblemRecord
from dapo_core.engines.rollout import RolloutResult
from dapo_core.training.health import HealthMonitor
from dapo_core.training.prompts import PromptItem, PromptSampler
from dapo_core.training.step import GenBatch, Group, batch_metrics, build_train_batch, keep_flags, zero_variance_flags


def cfg(*sets):
    return load_config(recipe="tiny-dapo", overrides=list(sets), env={})


def make_group(uid: int, accs: list[bool], lengths: list[int], truncated: list[bool] | None = None) -> Group:
    rec = ProblemRecord(data_source="s", prompt=[{"role": "user", "content": "Q"}], ground_truth="1", index=uid)
    item = PromptItem(record=rec, prompt_ids=(5, 6, 7))
    truncated = truncated or [False] * len(accs)
    responses = [
        RolloutResult(uid, j, [5, 6, 7], [9] * n, n, t, "length" if t else "stop", None, "x" * n)
        for j, (n, t) in enumerate(zip(lengths, truncated, strict=True))
    ]
    scores = [1.0 if a else -1.0 for a in accs]
    return Group(item=item, responses=responses, scores=scores, acc=accs, penalties=[0.0] * len(accs))


acc_lists = st.lists(st.lists(st.booleans(), min_size=2, max_size=6), min_size=1, max_size=8)


@given(groups=acc_lists)
def test_keep_flags_follow_raw_accuracy_variance(groups):
    batch = GenBatch(groups=[make_group(i, a, [3] * len(a)) for i, a in enumerate(groups)])
    flags = keep_flags(batch, cfg())
    assert flags == [len(set(a)) > 1 for a in groups]
    assert zero_variance_flags(batch) == [not f for f in flags]
    # with dynamic sampling off every group is kept
    assert keep_flags(batch, cfg("algorithm.dynamic_sampling.enable=false", "rollout.n=8")) == [True] * len(groups)


def test_filter_uses_accuracy_not_the_shaped_reward():
    g = make_group(0, [False, False, False, False], [3, 3, 3, 3])
    g.penalties = [0.0, -0.5, -1.0, 0.0]  # shaped rewards differ, but accuracy does not: no signal
    assert keep_flags(GenBatch(groups=[g]), cfg()) == [False]


@given(groups=acc_lists)
def test_advantages_average_zero_per_group(groups):
    gs = [make_group(i, a, [2 + j for j in range(len(a))]) for i, a in enumerate(groups)]
    batch, stats = build_train_batch(gs, cfg(), pad_token_id=0)
    adv = torch.tensor(stats.advantages)
    for g in range(len(gs)):
        member = batch.group_index == g
        assert abs(float(adv[member].mean())) < 1e-5


def test_overlong_filtering_masks_truncated_responses():
    g = make_group(0, [True, False], [4, 16], truncated=[False, True])
    on, stats_on = build_train_batch([g], cfg("algorithm.overlong.filtering=true"), pad_token_id=0)
    off, stats_off = build_train_batch([g], cfg(), pad_token_id=0)
    assert on.response_mask[1].sum() == 0 and off.response_mask[1].sum() == 16
    assert stats_on.num_loss_tokens == 4 and stats_off.num_loss_tokens == 20
    m = batch_metrics(stats_on, on)
    assert m["response_length/clip_ratio"] == 0.5 and m["response_length/max"] == 16


def test_sampler_is_resumable_and_covers_epochs():
    a = PromptSampler(5, seed=3)
    first = a.next_indices(7)
    state = a.state_dict()
    rest = a.next_indices(6)
    b = PromptSampler(5, seed=3)
    b.load_state_dict(state)
    assert b.next_indices(6) == rest
    assert sorted(first[:5]) == list(range(5))
    with pytest.raises(ValueError, match="same data version"):
        PromptSampler(6, seed=3).load_state_dict(state)


def test_health_alerts_fire_once_when_they_start():
    h = HealthMonitor(warmup_steps=2)
    base = {"actor/entropy": 1.0, "response_length/mean": 10.0, "actor/pg_clipfrac": 0.01}
    assert h.update(1, base) == [] and h.update(2, base) == []
    alerts = h.update(3, {**base, "actor/entropy": 0.1})
    assert [a.name for a in alerts] == ["entropy_collapse"] and alerts[0].step == 3
    assert h.update(4, {**base, "actor/entropy": 0.1}) == []  # still on: not again
    assert [a.name for a in h.update(5, {**base, "response_length/mean": 25.0})] == ["length_explosion"]
    assert [a.name for a in h.update(6, {**base, "actor/pg_clipfrac": 0.5})] == ["clipfrac_blowup"]
    for s in (7, 8):
        assert h.update(s, {**base, "train/zero_std_groups_frac": 1.0}) == []
    assert [a.name for a in h.update(9, {**base, "train/zero_std_groups_frac": 1.0})] == ["zero_variance_run"]
