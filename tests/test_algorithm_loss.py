"""policy_loss and the aggregation modes: naive-loop references, invariants, micro-batch gradient equality."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.algorithm import LOSS_AGG_MODES, agg_loss, policy_loss

PPO_CLIP = {"mode": "ppo-clip", "clip_low": 0.2, "clip_high": 0.28}  # DAPO's objective and bounds (Eq. 10)

MODES = sorted(LOSS_AGG_MODES)


def make_batch(seed: int, n: int = 6, t: int = 7, scale: float = 0.5, pad: bool = True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    new = (old + scale * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.float64)
    if pad:
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return new, old, adv, mask


def naive_loss(new, old, adv, mask, clip_low, clip_high, clip_c, mode, norm_length=None):
    """Element-by-element reference of DAPO Eq. 8-10 (+ dual clip) and each aggregation."""
    n, t = new.shape
    per_seq_sum, per_seq_count, total, count = [], [], 0.0, 0.0
    for i in range(n):
        s, c = 0.0, 0.0
        for j in range(t):
            if mask[i, j] == 0:
                continue
            lr = max(min(float(new[i, j] - old[i, j]), 20.0), -20.0)
            r = math.exp(lr)
            a = float(adv[i])
            l1 = -a * r
            l2 = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            if clip_c is not None and a < 0:
                loss = min(loss, -a * clip_c)
            s += loss
            c += 1
        per_seq_sum.append(s)
        per_seq_count.append(c)
        total += s
        count += c
    if mode == "token-mean":
        return total / max(count, 1)
    if mode == "seq-mean-token-mean":
        return sum(s / max(c, 1) for s, c in zip(per_seq_sum, per_seq_count, strict=True)) / n
    if mode == "seq-mean-token-sum":
        return sum(per_seq_sum) / n
    if mode == "seq-mean-token-sum-norm":
        length = t if norm_length is None else norm_length
        return sum(s / length for s in per_seq_sum) / n
    raise AssertionError(mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop(mode, clip_c, seed):
    new, old, adv, mask = make_batch(seed, scale=1.0)
    loss, _ = policy_loss(
        new, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=clip_c, loss_agg=mode, mode="ppo-clip"
    )
    assert float(loss) == pytest.approx(naive_loss(new, old, adv, mask, 0.2, 0.28, clip_c, mode), rel=1e-9, abs=1e-12)


def test_unknown_mode_lists_valid_ones():
    new, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match=r"valid modes: .*token-mean"):
        policy_loss(new, old, adv, mask, loss_agg="sum-everything", **PPO_CLIP)


def test_bad_clip_values_raise():
    new, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="clip_low <= clip_high"):
        policy_loss(new, old, adv, mask, clip_low=0.3, clip_high=0.2, mode="ppo-clip", loss_agg="token-mean")
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        policy_loss(new, old, adv, mask, clip_c=0.5, **PPO_CLIP, loss_agg="token-mean")


def test_shape_mismatch_raises():
    new, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="share one"):
        policy_loss(new, old[:, :3], adv, mask, **PPO_CLIP, loss_agg="token-mean")


def test_clip_higher_lets_positive_tokens_rise_further():
    """DAPO's point: with eps_high > eps_low a positive-advantage token keeps gradient up to ratio 1.28."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(1.25), dtype=torch.float64, requires_grad=True)  # ratio 1.25
    adv = torch.ones(1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    loss_sym, m_sym = policy_loss(
        new, old, adv, mask, clip_low=0.2, clip_high=0.2, mode="ppo-clip", loss_agg="token-mean"
    )
    (g_sym,) = torch.autograd.grad(loss_sym, new)
    loss_dapo, m_dapo = policy_loss(
        new, old, adv, mask, clip_low=0.2, clip_high=0.28, mode="ppo-clip", loss_agg="token-mean"
    )
    (g_dapo,) = torch.autograd.grad(loss_dapo, new)
    assert float(g_sym) == 0.0 and m_sym["pg_clipfrac_high"] == 1.0
    assert float(g_dapo) == pytest.approx(-1.25) and m_dapo["pg_clipfrac"] == 0.0


def test_clip_fraction_sides():
    old = torch.zeros(4, 1, dtype=torch.float64)
    ratios = torch.tensor([[1.5], [0.5], [1.5], [0.5]], dtype=torch.float64)
    new = ratios.log()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    _, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, mode="ppo-clip", loss_agg="token-mean")
    # row 0: A>0, r>1.28 -> clipped high; row 1: A<0, r<0.8 -> clipped low; rows 2, 3: unclipped side
    assert m["pg_clipfrac_high"] == pytest.approx(0.25)
    assert m["pg_clipfrac_low"] == pytest.approx(0.25)
    assert m["pg_clipfrac"] == pytest.approx(0.5)


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(50.0), dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-2.0], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    loss, m = policy_loss(new, old, adv, mask, clip_c=10.0, **PPO_CLIP, loss_agg="token-mean")
    assert float(loss) == pytest.approx(20.0)  # -c * A
    (g,) = torch.autograd.grad(loss, new)
    assert float(g) == 0.0 and m["pg_clipfrac_dual"] == 1.0
    loss_nodual, _ = policy_loss(new, old, adv, mask, clip_c=None, **PPO_CLIP, loss_agg="token-mean")
    assert float(loss_nodual) == pytest.approx(100.0)


def test_extreme_log_ratios_stay_finite():
    old = torch.zeros(2, 3)
    new = torch.tensor([[1e4, -1e4, 0.0], [50.0, -50.0, 3.0]], requires_grad=True)
    loss, m = policy_loss(
        new, old, torch.tensor([1.0, -1.0]), torch.ones(2, 3), clip_c=10.0, **PPO_CLIP, loss_agg="token-mean"
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert all(math.isfinite(v) for v in m.values())


def test_empty_mask_gives_zero_loss_and_zero_grad():
    new, old, adv, _ = make_batch(3)
    for mode in MODES:
        loss, m = policy_loss(new, old, adv, torch.zeros_like(old), loss_agg=mode, **PPO_CLIP)
        (g,) = torch.autograd.grad(loss, new)
        assert float(loss) == 0.0 and torch.count_nonzero(g) == 0
        assert all(math.isfinite(v) for v in m.values())


# ---- properties (docs/design.md, "Tests") ----

seeds = st.integers(min_value=0, max_value=10_000)


@given(seed=seeds, mode=st.sampled_from(MODES), clip_c=st.sampled_from([None, 10.0]))
def test_zero_advantages_give_zero_loss_and_gradient(seed, mode, clip_c):
    new, old, adv, mask = make_batch(seed)
    loss, _ = policy_loss(new, old, torch.zeros_like(adv), mask, loss_agg=mode, clip_c=clip_c, **PPO_CLIP)
    (g,) = torch.autograd.grad(loss, new)
    assert float(loss) == 0.0
    assert torch.count_nonzero(g) == 0


@given(seed=seeds, mode=st.sampled_from(MODES))
def test_ratio_one_clipped_equals_unclipped(seed, mode):
    """At pi_theta = pi_old nothing is clipped: loss and gradient equal the plain policy gradient -A * r."""
    new, _, adv, mask = make_batch(seed)
    old = new.detach().clone()
    loss, m = policy_loss(new, old, adv, mask, loss_agg=mode, clip_c=10.0, **PPO_CLIP)
    ref = agg_loss(-adv.unsqueeze(-1) * torch.exp(new - old), mask, mode)
    (g,) = torch.autograd.grad(loss, new)
    (g_ref,) = torch.autograd.grad(ref, new)
    assert float(loss) == pytest.approx(float(ref), abs=1e-12)
    torch.testing.assert_close(g, g_ref)
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0


@given(seed=seeds, extra=st.integers(min_value=1, max_value=5), mode=st.sampled_from(MODES))
def test_padding_does_not_change_loss(seed, extra, mode):
    """Masked padding columns change nothing (norm_length fixed, since its default is T)."""
    new, old, adv, mask = make_batch(seed)
    n, _t = new.shape
    kw = {"norm_length": 7.0} if mode == "seq-mean-token-sum-norm" else {}
    loss, _ = policy_loss(new, old, adv, mask, loss_agg=mode, **PPO_CLIP, **kw)
    pad_new = torch.cat([new.detach(), torch.randn(n, extra, dtype=new.dtype)], dim=1)
    pad_old = torch.cat([old, torch.randn(n, extra, dtype=old.dtype)], dim=1)
    pad_mask = torch.cat([mask, torch.zeros(n, extra, dtype=mask.dtype)], dim=1)
    loss_pad, _ = policy_loss(pad_new, pad_old, adv, pad_mask, loss_agg=mode, **PPO_CLIP, **kw)
    assert float(loss_pad) == pytest.approx(float(loss), rel=1e-12, abs=1e-12)


@given(seed=seeds, mode=st.sampled_from(MODES))
def test_order_of_responses_does_not_matter(seed, mode):
    new, old, adv, mask = make_batch(seed)
    perm = torch.randperm(new.shape[0], generator=torch.Generator().manual_seed(seed))
    loss, _ = policy_loss(new, old, adv, mask, loss_agg=mode, **PPO_CLIP)
    loss_p, _ = policy_loss(new[perm], old[perm], adv[perm], mask[perm], loss_agg=mode, **PPO_CLIP)
    assert float(loss_p) == pytest.approx(float(loss), rel=1e-12, abs=1e-12)


def _split_points(n: int, data) -> list[int]:
    cuts = sorted(data.draw(st.sets(st.integers(min_value=1, max_value=n - 1), max_size=n - 1)))
    return [0, *cuts, n]


@given(data=st.data(), seed=seeds, mode=st.sampled_from(MODES), clip_c=st.sampled_from([None, 10.0]))
def test_micro_batch_split_sums_to_whole_mini_batch(data, seed, mode, clip_c):
    """With global denominators, summing micro-batch losses/gradients == the whole mini-batch's (verl #5625)."""
    new, old, adv, mask = make_batch(seed, n=8, t=9, scale=0.8)
    whole, _ = policy_loss(new, old, adv, mask, loss_agg=mode, clip_c=clip_c, **PPO_CLIP)
    (g_whole,) = torch.autograd.grad(whole, new)

    bounds = _split_points(new.shape[0], data)
    total = torch.zeros((), dtype=new.dtype)
    g_acc = torch.zeros_like(new)
    for lo, hi in itertools.pairwise(bounds):
        part, _ = policy_loss(
            new[lo:hi],
            old[lo:hi],
            adv[lo:hi],
            mask[lo:hi],
            loss_agg=mode,
            clip_c=clip_c,
            global_num_tokens=mask.sum(),
            global_num_seqs=new.shape[0],
            norm_length=new.shape[1],
            **PPO_CLIP,
        )
        (g,) = torch.autograd.grad(part, new)
        total = total + part.detach()
        g_acc += g
    assert float(total) == pytest.approx(float(whole), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g_acc, g_whole, rtol=1e-10, atol=1e-12)


def test_micro_batch_without_global_count_is_wrong_for_token_mean():
    """The naive per-micro-batch mean (what verl #5625 / TRL #5619 did) differs — the test above can fail."""
    new, old, adv, mask = make_batch(5, n=4, t=6)
    mask[0, 1:] = 0  # very unequal token counts across the two halves
    whole, _ = policy_loss(new, old, adv, mask, **PPO_CLIP, loss_agg="token-mean")
    a, _ = policy_loss(new[:2], old[:2], adv[:2], mask[:2], **PPO_CLIP, loss_agg="token-mean")
    b, _ = policy_loss(new[2:], old[2:], adv[2:], mask[2:], **PPO_CLIP, loss_agg="token-mean")
    assert float((a + b) / 2) != pytest.approx(float(whole), rel=1e-6)


def test_token_mean_weighs_long_responses_more_than_seq_mean():
    """DAPO Sec. 3.3: under seq-mean each response weighs the same; under token-mean, per token."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    new = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    tok, _ = policy_loss(new, old, adv, mask, loss_agg="token-mean", **PPO_CLIP)
    (g_tok,) = torch.autograd.grad(tok, new)
    seq, _ = policy_loss(new, old, adv, mask, loss_agg="seq-mean-token-mean", **PPO_CLIP)
    (g_seq,) = torch.autograd.grad(seq, new)
    assert torch.allclose(g_tok[0, 0], g_tok[1, 0])  # every token the same weight: -1/5
    assert float(g_tok[0, 0]) == pytest.approx(-0.2)
    assert float(g_seq[0, 0]) == pytest.approx(-0.5) and float(g_seq[1, 0]) == pytest.approx(-0.125)
