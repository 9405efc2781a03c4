"""GSPO, CISPO and GMPO (``policy_loss(mode=...)``, issue 17): each against its paper's equation written out
directly, its clipping behaviour, the reduction to the PPO-clip gradient on-policy, and the update direction."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algorithm import policy_loss
from dapo_core.algorithm.objectives import OBJECTIVES, ppo_clip_token_losses
from dapo_core.algorithm.policy_loss import POLICY_LOSS_MODES
from dapo_core.config import ConfigError, load_config
from dapo_core.config.algorithm import objective_bounds
from dapo_core.engines.executor import loss_config_from

N, T = 6, 7


def _batch(seed: int, *, spread: float = 0.3, n: int = N, t: int = T):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3 - 0.05  # (N, T) log-probs < 0
    new = (old + spread * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # (N,)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)  # (N, T) ragged responses
    return new.requires_grad_(True), old, adv, mask


def _grad(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, leaf)
    return g


# ---------------- each objective equals its paper's equation ----------------


def _gspo_reference(new, old, adv, mask, lo, hi):
    """GSPO Eq. 5/7 directly: s_i = exp(mean_t log r_it); 1/G sum_i -min(s A, clip(s) A)."""
    s = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))  # (N,)
    per_seq = -torch.minimum(s * adv, torch.clamp(s, 1 - lo, 1 + hi) * adv)  # (N,)
    return per_seq.mean()


def _gmpo_reference(new, old, adv, mask, lo, hi):
    """GMPO Eq. 4 directly, as a product of token terms: A * prod_t(sgn-aware clipped r_it)^(1/|o_i|)."""
    out = []
    for i in range(new.shape[0]):
        n_tok = int(mask[i].sum())
        r = torch.exp(new[i, :n_tok] - old[i, :n_tok])
        rc = torch.clamp(r, math.exp(-lo), math.exp(hi))
        s = 1.0 if adv[i] >= 0 else -1.0
        terms = s * torch.minimum(s * r, s * rc)  # (n_tok,)
        out.append(-adv[i] * torch.prod(terms) ** (1.0 / n_tok))
    return torch.stack(out).mean()


def _cispo_reference(new, old, adv, mask, lo, hi):
    """CISPO Eq. 4 as MiniMax-M1 writes it: sg(clip(r)) * A * log pi, token-mean; returns the surrogate whose
    gradient CISPO follows (its value differs from the module's, its gradient must not)."""
    r = torch.exp(new - old).detach()
    w = torch.clamp(r, 0.0 if lo is None else 1 - lo, 1 + hi)
    return -(w * adv.unsqueeze(-1) * new * mask).sum() / mask.sum()


REFERENCES = {
    "gspo": (_gspo_reference, "seq-mean-token-mean"),
    "gmpo": (_gmpo_reference, "seq-mean-token-mean"),
    "cispo": (_cispo_reference, "token-mean"),
}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    spread=st.sampled_from([1e-4, 0.05, 0.5]),
    mode=st.sampled_from(["gspo", "gmpo", "cispo"]),
)
def test_each_objective_has_the_gradient_of_its_papers_equation(seed: int, spread: float, mode: str) -> None:
    new, old, adv, mask = _batch(seed, spread=spread)
    lo, hi = {"gspo": (3e-4, 4e-4), "gmpo": (0.4, 0.4), "cispo": (None, 0.5)}[mode]
    reference, agg = REFERENCES[mode]
    loss, _ = policy_loss(new, old, adv, mask, mode=mode, clip_low=lo, clip_high=hi, loss_agg=agg)
    want = reference(new, old, adv, mask, lo, hi)
    torch.testing.assert_close(_grad(loss, new), _grad(want, new), rtol=1e-9, atol=1e-12)
    if mode != "cispo":  # CISPO's surrogate value is a choice; GSPO's and GMPO's is the objective itself
        torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)


def test_cispo_loss_value_is_the_clipped_weighted_advantage() -> None:
    new, old, adv, mask = _batch(3, spread=0.5)
    loss, _ = policy_loss(new, old, adv, mask, mode="cispo", clip_low=0.2, clip_high=0.3, loss_agg="token-mean")
    w = torch.clamp(torch.exp(new - old), 0.8, 1.3).detach()
    torch.testing.assert_close(loss, -(w * adv.unsqueeze(-1) * mask).sum() / mask.sum())


def _ppo_clip_reference(new, old, adv, mask, lo, hi, c):
    """DAPO Eq. 8-10 (+ dual clip) written out, token-mean, and the metrics from their definitions: the per-token
    losses (N, T), the loss and the metrics dict ``policy_loss`` returns."""
    a = adv.unsqueeze(-1)  # (N, 1)
    r = torch.exp(torch.clamp(new - old, -20.0, 20.0))  # (N, T)  r_it, Eq. 9
    per_token = -torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)  # (N, T)  Eq. 8/10
    if c is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -c * a), per_token)  # dual clip: <= -c A for A < 0
    loss = (per_token * mask).sum() / mask.sum()  # Eq. 12, token-mean
    a = a.expand_as(r)
    high = (a > 0) & (r > 1 + hi)  # the upper bound is the active term of the min
    low = (a < 0) & (r < 1 - lo)  # the lower bound is
    dual = (a < 0) & (r > c) if c is not None else torch.zeros_like(high)

    def share(flags):
        return float((flags.to(mask.dtype) * mask).sum() / mask.sum())

    metrics = {
        "pg_loss": float(loss),
        "pg_clipfrac": share(high | low),
        "pg_clipfrac_high": share(high),
        "pg_clipfrac_low": share(low),
        "pg_clipfrac_dual": share(dual),
        "ppo_kl": float((-torch.clamp(new - old, -20.0, 20.0) * mask).sum() / mask.sum()),
    }
    return per_token, loss, metrics


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_registered_ppo_clip_is_bit_identical_to_the_clipped_surrogate(seed: int, clip_c, dtype) -> None:
    """ppo-clip is a registered objective like the successors, and ``policy_loss(mode="ppo-clip")`` through it gives
    exactly (bit for bit) the loss and metrics of Eq. 8-10 written out, with both bounds (and the dual clip) active."""
    assert OBJECTIVES["ppo-clip"] is ppo_clip_token_losses and POLICY_LOSS_MODES[0] == "ppo-clip"
    new, old, adv, mask = (x.detach().to(dtype) for x in _batch(seed, spread=0.8, n=16, t=12))
    new.requires_grad_(True)
    lo, hi = 0.2, 0.28
    per_token, want_loss, want = _ppo_clip_reference(new, old, adv, mask, lo, hi, clip_c)
    assert want["pg_clipfrac_high"] > 0 and want["pg_clipfrac_low"] > 0  # clipping active on both sides
    assert clip_c is None or want["pg_clipfrac_dual"] > 0
    loss, metrics = policy_loss(
        new, old, adv, mask, mode="ppo-clip", clip_low=lo, clip_high=hi, clip_c=clip_c, loss_agg="token-mean"
    )
    assert torch.equal(loss, want_loss)
    assert metrics == want
    terms = OBJECTIVES["ppo-clip"](new, old, adv.unsqueeze(-1), mask, clip_low=lo, clip_high=hi, clip_c=clip_c)
    assert torch.equal(terms.losses * mask, per_token * mask)
    torch.testing.assert_close(_grad(loss, new), _grad(want_loss, new), rtol=0, atol=0)


# ---------------- on-policy: the PPO-clip gradient ----------------


@pytest.mark.parametrize(
    ("mode", "agg"), [("gspo", "seq-mean-token-mean"), ("gmpo", "seq-mean-token-mean"), ("cispo", "token-mean")]
)
def test_on_policy_each_objective_reduces_to_the_ppo_clip_gradient(mode: str, agg: str) -> None:
    new, _, adv, mask = _batch(5)
    old = new.detach().clone()  # pi_theta = pi_old: every ratio is 1
    lo, hi = objective_bounds(load_config(recipe="tiny-dapo", overrides=[f"algorithm.policy_loss={mode}"]).algorithm)
    ours, _ = policy_loss(new, old, adv, mask, mode=mode, clip_low=lo, clip_high=hi, loss_agg=agg)
    ppo, _ = policy_loss(new, old, adv, mask, mode="ppo-clip", clip_low=0.2, clip_high=0.28, loss_agg=agg)
    g = _grad(ours, new)
    torch.testing.assert_close(g, _grad(ppo, new), rtol=1e-9, atol=1e-12)
    assert g.abs().sum() > 0


# ---------------- clipping ----------------


def test_gspo_clips_whole_sequences_by_their_sequence_ratio() -> None:
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    new = old.clone()
    new[0, :] += 0.01  # s_0 = e^0.01 > 1 + 4e-4: clipped (A > 0) -> no gradient on any of its tokens
    new[1, 0] += 0.01  # one token moved a lot ...
    new[1, 1] -= 0.01  # ... and one back: s_1 = 1, inside the range -> every token keeps its gradient
    new.requires_grad_(True)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    loss, m = policy_loss(
        new, old, adv, mask, mode="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"
    )
    g = _grad(loss, new)
    assert torch.all(g[0] == 0)
    assert torch.all(g[1] != 0)
    # a token-level PPO clip at the same bounds would have zeroed tokens of row 1 too
    assert m["pg_clipfrac_high"] == pytest.approx(0.5)  # 4 of 8 tokens sit in a clipped sequence


def test_cispo_keeps_the_gradient_of_tokens_ppo_clip_drops() -> None:
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    new = (old + torch.tensor([[0.0, 1.0, -1.0]], dtype=torch.float64)).requires_grad_(True)  # r = 1, e, 1/e
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    cispo, m = policy_loss(new, old, adv, mask, mode="cispo", clip_low=None, clip_high=0.28, loss_agg="token-mean")
    ppo, _ = policy_loss(new, old, adv, mask, mode="ppo-clip", clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    g_cispo, g_ppo = _grad(cispo, new), _grad(ppo, new)
    assert g_ppo[0, 1] == 0  # PPO: r = e > 1.28 with A > 0 is clipped away
    # CISPO: that token still learns, with its weight capped at 1 + eps_high; r = 1/e has no lower bound
    torch.testing.assert_close(g_cispo[0], -torch.tensor([1.0, 1.28, math.exp(-1)], dtype=torch.float64) / 3)
    assert m["pg_clipfrac_high"] == pytest.approx(1 / 3) and m["pg_clipfrac_low"] == 0.0


def test_gmpo_clips_token_log_ratios_pessimistically_for_the_advantage_sign() -> None:
    old = torch.full((2, 2), -1.0, dtype=torch.float64)
    delta = torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)  # log r = +1, -1 in both rows
    new = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, _ = policy_loss(new, old, adv, mask, mode="gmpo", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean")
    g = _grad(loss, new)
    # A > 0: log r = +1 is clipped to 0.4 (no gradient), log r = -1 stays (min keeps the lower value)
    assert g[0, 0] == 0 and g[0, 1] != 0
    # A < 0: log r = -1 is clipped to -0.4 (no gradient), log r = +1 stays (max keeps the higher value)
    assert g[1, 1] == 0 and g[1, 0] != 0
    # row 0's ratio: exp(mean(0.4, -1)); row 1's: exp(mean(1, -0.4)); loss = mean(-A_i * ratio_i)
    want = (-math.exp((0.4 - 1) / 2) + math.exp((1 - 0.4) / 2)) / 2
    assert float(loss) == pytest.approx(want)


def test_gmpo_ratio_is_the_geometric_mean_below_the_arithmetic_one() -> None:
    new, old, _, mask = _batch(11, spread=0.2)
    adv = torch.ones(N, dtype=torch.float64)
    loss, _ = policy_loss(
        new, old, adv, mask, mode="gmpo", clip_low=50.0, clip_high=50.0, loss_agg="seq-mean-token-mean"
    )
    arith, _ = policy_loss(
        new, old, adv, mask, mode="ppo-clip", clip_low=0.99, clip_high=1e6, loss_agg="seq-mean-token-mean"
    )
    # -mean_i GM_i >= -mean_i AM_i (AM-GM, strict unless all ratios of a row are equal)
    assert float(loss) > float(arith)


@pytest.mark.parametrize("mode", ["gspo", "gmpo"])
def test_sequence_objectives_ignore_the_token_order_within_a_response(mode: str) -> None:
    new, old, adv, _ = _batch(13, spread=0.3)
    mask = torch.ones(N, T, dtype=torch.float64)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    lo, hi = (3e-4, 4e-4) if mode == "gspo" else (0.4, 0.4)
    a, _ = policy_loss(new, old, adv, mask, mode=mode, clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean")
    b, _ = policy_loss(
        new[:, perm], old[:, perm], adv, mask, mode=mode, clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean"
    )
    torch.testing.assert_close(a, b)


# ---------------- direction, validation, config ----------------


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_a_gradient_step_raises_positive_and_lowers_negative_advantage_log_probs(mode: str) -> None:
    new, _, _, mask = _batch(17, spread=0.0)
    old = new.detach().clone()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    lo, hi = {"ppo-clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (None, 5.0), "gmpo": (0.4, 0.4)}[mode]
    loss, _ = policy_loss(new, old, adv, mask, mode=mode, clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean")
    step = -_grad(loss, new) * mask  # gradient descent on the log-probs themselves
    assert torch.all(step[adv > 0].sum(-1) > 0)
    assert torch.all(step[adv < 0].sum(-1) < 0)
    assert torch.all(step[adv == 0] == 0)


def test_bad_modes_and_bounds_are_refused() -> None:
    new, old, adv, mask = _batch(1)
    with pytest.raises(ValueError, match="unknown policy loss mode 'ppo'"):
        policy_loss(new, old, adv, mask, mode="ppo", clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    with pytest.raises(ValueError, match="cispo option"):
        policy_loss(new, old, adv, mask, mode="gspo", clip_low=None, clip_high=4e-4, loss_agg="seq-mean-token-mean")


@pytest.mark.parametrize(
    ("recipe", "mode", "bounds", "agg", "norm_adv"),
    [
        ("tiny-gspo", "gspo", (3e-4, 4e-4), "seq-mean-token-mean", True),
        ("tiny-cispo", "cispo", (None, 5.0), "token-mean", True),
        ("tiny-gmpo", "gmpo", (0.4, 0.4), "seq-mean-token-mean", True),
        ("tiny-drgrpo", "ppo-clip", (0.2, 0.2), "seq-mean-token-sum-norm", False),
    ],
)
def test_successor_recipes_resolve_to_their_papers_settings(recipe, mode, bounds, agg, norm_adv) -> None:
    cfg = load_config(recipe=recipe, env={})
    loss = loss_config_from(cfg)
    assert (loss.mode, (loss.clip_low, loss.clip_high), loss.loss_agg) == (mode, bounds, agg)
    assert cfg.algorithm.norm_adv_by_std is norm_adv
    if recipe == "tiny-drgrpo":
        assert loss.norm_length == cfg.data.max_response_length  # one constant for every response


def test_the_config_offers_exactly_the_registered_objectives() -> None:
    from typing import get_args

    from dapo_core.config.algorithm import PolicyLossMode

    assert get_args(PolicyLossMode) == POLICY_LOSS_MODES == tuple(OBJECTIVES)


def test_a_bad_objective_setting_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss"):
        load_config(recipe="tiny-dapo", overrides=["algorithm.policy_loss=gpso"], env={})
    with pytest.raises(ConfigError, match=r"algorithm\.gspo\.clip_low"):
        load_config(recipe="tiny-gspo", overrides=["algorithm.gspo.clip_low=-1"], env={})


# ---------------- where CISPO's clip binds: later, off-policy updates of one rollout step ----------------


def _cispo_updates(clip_high: float) -> tuple[list[float], torch.Tensor]:
    """Two epochs of four one-group mini-batches (8 optimizer steps on one rollout batch) of the tiny model under
    CISPO: each update's pg_clipfrac_high, and the final weights."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny import optim_config, random_batch, tiny_model

    from dapo_core.engines.trainer import LossConfig, PolicyTrainer

    trainer = PolicyTrainer(tiny_model(seed=0), optim_config(lr=0.02), micro_batch_size=16)
    batch = random_batch(0, groups=4, g=4)
    batch.old_log_probs, _ = trainer.compute_log_probs(batch)  # pi_old: the weights that sampled the batch
    fractions: list[float] = []
    real = trainer._update_mini_batch

    def recording(mini, loss_cfg, *, lr_scale):
        metrics = real(mini, loss_cfg, lr_scale=lr_scale)
        fractions.append(metrics["pg_clipfrac_high"])
        return metrics

    trainer._update_mini_batch = recording
    trainer.update(
        batch, LossConfig(
            mode="cispo", clip_low=None, clip_high=clip_high, clip_c=None, loss_agg="token-mean", norm_length=None,
            entropy_coef=0.0,
        ),
        ppo_epochs=2, mini_batch_groups=1,
    )  # fmt: skip
    return fractions, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_cispo_clip_binds_in_later_off_policy_updates():
    """The regime where CISPO's weight clip acts (in benchmarks/results/successors.md it never bound: one on-policy
    pass at lr 1e-4 keeps every ratio far below 1 + 5.0): several updates per rollout step, so later mini-batches
    are off-policy. The first update is on-policy (ratio 1: nothing clipped); later ones clip some tokens' weight,
    and the clip changes the update (without the bound: no clipping and other weights). eps_high 0.28 and lr 0.02
    make it bind within 8 updates of the tiny model (measured: 6 of the 7 later updates clip 6-42% of tokens)."""
    fractions, weights = _cispo_updates(0.28)
    assert len(fractions) == 8 and fractions[0] == 0.0
    assert sum(f > 0 for f in fractions[1:]) >= 4 and max(fractions[1:]) > 0.1
    unbounded, unbounded_weights = _cispo_updates(math.inf)
    assert unbounded == [0.0] * 8  # nothing to clip without a bound
    assert not torch.allclose(weights, unbounded_weights)  # the clipped weights changed the update
