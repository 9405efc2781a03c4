"""group_advantages, overlong shaping, dynamic sampling, entropy/log-probs: naive references and properties."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.algorithm import (
    DynamicSamplingExhausted,
    GroupAccumulator,
    dynamic_sampling_mask,
    entropy_from_logits,
    group_advantages,
    log_probs_from_logits,
    overlong_filter_mask,
    overlong_penalty,
)
from dapo_core.algorithm import metric_names as mn

# ---------------- group advantages ----------------


def naive_advantages(scores, ids, norm_by_std=True, eps=1e-6):
    out = []
    for s, g in zip(scores, ids, strict=True):
        members = [x for x, h in zip(scores, ids, strict=True) if h == g]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(members), statistics.stdev(members)
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


groups_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", 7, (1, 2)]), st.sampled_from([-1.0, 1.0, 0.5, -0.25, 0.0])),
    min_size=1,
    max_size=24,
)


@given(items=groups_strategy, norm=st.booleans())
def test_group_advantages_match_naive(items, norm):
    ids = [g for g, _ in items]
    scores = torch.tensor([s for _, s in items], dtype=torch.float64)
    got = group_advantages(scores, ids, norm_by_std=norm)
    ref = naive_advantages([s for _, s in items], ids, norm)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@given(items=groups_strategy)
def test_group_advantages_have_mean_zero_per_group(items):
    ids = [g for g, _ in items]
    scores = torch.tensor([s for _, s in items], dtype=torch.float64)
    adv = group_advantages(scores, ids)
    for g in set(ids):
        idx = [i for i, h in enumerate(ids) if h == g]
        if len(idx) > 1:
            assert abs(float(adv[idx].mean())) < 1e-9


@given(items=groups_strategy, seed=st.integers(0, 1000))
def test_order_within_groups_does_not_matter(items, seed):
    ids = [g for g, _ in items]
    scores = torch.tensor([s for _, s in items], dtype=torch.float64)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    adv = group_advantages(scores, ids)
    adv_p = group_advantages(scores[perm], [ids[i] for i in perm.tolist()])
    torch.testing.assert_close(adv_p, adv[perm])


def test_group_of_one_uses_mean_zero_std_one():
    adv = group_advantages(torch.tensor([1.0, -1.0]), ["x", "y"])
    torch.testing.assert_close(adv, torch.tensor([1 / (1 + 1e-6), -1 / (1 + 1e-6)]))


def test_zero_variance_group_gets_zero_advantage_and_tensor_ids_work():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([5, 5, 3, 3]))
    assert adv[:2].abs().max() == 0.0
    assert adv[2] > 0 > adv[3]


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="group_ids has 1 entries"):
        group_advantages(torch.zeros(2), ["a"])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), ["a", "b"])


# ---------------- overlong ----------------


def eq13(length, lmax, lcache, factor):
    if length <= lmax - lcache:
        return 0.0
    if length <= lmax:
        return factor * ((lmax - lcache) - length) / lcache
    return -factor


@given(
    lmax=st.integers(2, 500),
    data=st.data(),
    factor=st.floats(0.0, 5.0, allow_nan=False),
)
def test_overlong_penalty_matches_eq13(lmax, data, factor):
    lcache = data.draw(st.integers(1, lmax - 1))
    lengths = data.draw(st.lists(st.integers(0, lmax + 50), min_size=1, max_size=30))
    got = overlong_penalty(torch.tensor(lengths), max_response_length=lmax, buffer_length=lcache, penalty_factor=factor)
    ref = torch.tensor([eq13(x, lmax, lcache, factor) for x in lengths], dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@given(lmax=st.integers(3, 300), data=st.data())
def test_overlong_penalty_magnitude_never_decreases_with_length(lmax, data):
    lcache = data.draw(st.integers(1, lmax - 1))
    lengths = torch.arange(0, lmax + 10)
    pen = overlong_penalty(lengths, max_response_length=lmax, buffer_length=lcache)
    assert torch.all(pen.abs()[1:] >= pen.abs()[:-1])
    assert float(pen[lmax]) == pytest.approx(-1.0) and float(pen[lmax - lcache]) == 0.0


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="must be < max_response_length"):
        overlong_penalty(torch.tensor([1]), max_response_length=8, buffer_length=8)
    with pytest.raises(ValueError, match="must be > 0"):
        overlong_penalty(torch.tensor([1]), max_response_length=8, buffer_length=0)


def test_overlong_filter_mask_zeroes_truncated_rows():
    mask = torch.ones(3, 4)
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out[1].sum() == 0 and out[0].sum() == 4 and out[2].sum() == 4


# ---------------- dynamic sampling ----------------


def naive_ds_mask(metric, ids):
    out = []
    for g in ids:
        vals = [m for m, h in zip(metric, ids, strict=True) if h == g]
        out.append(len(vals) == 1 or len(set(vals)) > 1)
    return out


@given(
    items=st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 1.0])), min_size=1, max_size=40),
)
def test_dynamic_sampling_mask_matches_naive(items):
    ids = [g for g, _ in items]
    metric = [m for _, m in items]
    got = dynamic_sampling_mask(torch.tensor(metric), ids)
    assert got.tolist() == naive_ds_mask(metric, ids)


@given(g=st.integers(2, 16), value=st.sampled_from([0.0, 1.0]))
def test_zero_variance_groups_are_dropped(g, value):
    mask = dynamic_sampling_mask(torch.full((g,), value), ["same"] * g)
    assert not mask.any()


def test_accumulator_collects_over_batches_and_drops_surplus():
    acc = GroupAccumulator(target_num_groups=5, max_num_gen_batches=10)
    batches = [([1, 2, 3, 4], [False, True, False, False]), ([5, 6, 7, 8], [True, True, False, True])]
    batches.append(([9, 10, 11, 12], [True, True, True, True]))
    it = iter(batches)
    while acc.need_more():
        acc.add(*next(it))
    assert acc.num_gen_batches == 3
    assert acc.take() == [2, 5, 6, 8, 9]
    assert acc.num_groups_seen == 12 and acc.num_groups_kept == 8
    assert acc.kept_groups_frac == pytest.approx(8 / 12)
    assert acc.zero_std_groups_frac == pytest.approx(4 / 12)


def test_accumulator_raises_past_budget_with_a_fix():
    acc = GroupAccumulator(target_num_groups=4, max_num_gen_batches=2)
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches=2"):
        while acc.need_more():
            acc.add([1, 2], [True, False])


def test_accumulator_graceful_mode_returns_what_it_has():
    acc = GroupAccumulator(target_num_groups=4, max_num_gen_batches=2, on_exhausted="continue")
    while acc.need_more():
        acc.add([1, 2], [True, False])
    assert acc.exhausted and acc.take() == [1, 1]


def test_accumulator_unlimited_budget():
    acc = GroupAccumulator(target_num_groups=3, max_num_gen_batches=0)
    n = 0
    while acc.need_more():
        acc.add([n], [n % 7 == 6])
        n += 1
    assert acc.num_gen_batches == 21


# ---------------- entropy / log-probs ----------------


@given(seed=st.integers(0, 1000), chunk=st.integers(1, 9))
def test_log_probs_and_entropy_match_naive(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=g)
    lp = log_probs_from_logits(logits, labels, chunk_size=chunk)
    ent = entropy_from_logits(logits, chunk_size=chunk)
    for i in range(3):
        for j in range(5):
            row = torch.log_softmax(logits[i, j], -1)
            assert float(lp[i, j]) == pytest.approx(float(row[labels[i, j]]), abs=1e-5)
            h = -sum(math.exp(float(x)) * float(x) for x in row)
            assert float(ent[i, j]) == pytest.approx(h, abs=1e-5)


def test_log_probs_gradient_flows_through_chunks():
    logits = torch.randn(2, 4, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 4))
    log_probs_from_logits(logits, labels, chunk_size=3).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    torch.log_softmax(ref, -1).gather(-1, labels.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_uniform_logits_have_log_v_entropy():
    ent = entropy_from_logits(torch.zeros(4, 150))
    torch.testing.assert_close(ent, torch.full((4,), math.log(150)))


# ---------------- metric names ----------------


def test_metric_names_are_valid_mlflow_keys_and_unique():
    names = mn.training_metric_names()
    assert len(names) == len(set(names))
    assert all(mn.is_valid_mlflow_key(n) for n in names)
    assert mn.val_metric("math_dapo", "mean", 32) == "val/math_dapo/acc/mean_at_32"
    with pytest.raises(ValueError, match="valid phases"):
        mn.timing("coffee")
    assert mn.val_metric("aime 2024:v1", "pass", 4) == "val/aime 2024:v1/acc/pass_at_4"  # valid names kept


@given(st.lists(st.text(max_size=300), min_size=2, max_size=4, unique=True))
def test_any_data_source_names_give_valid_distinct_mlflow_keys(names):
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, path_not_unique, validate_param_and_metric_name

    from dapo_core.evaluation.runner import val_key

    acc = [mn.val_metric(n, "maj", 16) for n in names]
    other = [val_key(n, "reflection_rate") for n in names]
    for key in acc + other:  # MLflow's own checks: characters, length, no name that resolves to another path
        assert validate_param_and_metric_name(key) and not path_not_unique(key), key
        assert len(key) <= MAX_ENTITY_KEY_LENGTH and mn.is_valid_mlflow_key(key), key
    assert all(k.count("/") == 3 for k in acc) and all(k.count("/") == 2 for k in other)  # the name is one level
    assert len(set(acc)) == len(acc) and len(set(other)) == len(other)  # distinct sources stay distinct
    assert mn.val_metric("aime@24", "pass", 4).startswith("val/aime_24-")
    assert mn.val_metric("lighteval/MATH", "pass", 4).startswith("val/lighteval_MATH-")
