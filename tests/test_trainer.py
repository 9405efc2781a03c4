"""PolicyTrainer: log-probs vs a naive forward (also at a sampling temperature), micro-batch/rank invariance of
the gradient, the short last mini-batch's lr scale, SFT, schedules."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _tiny import PAD, loss_config, optim_config, random_batch, tiny_model

from dapo_core.engines.batch import build_policy_batch, split_by_groups
from dapo_core.engines.trainer import PolicyTrainer, lr_lambda, short_mini_batch_scales

NO_CLIP = optim_config(lr=1e-3, weight_decay=0.0, grad_clip=1e9)


def test_log_probs_equal_naive_log_softmax_gather():
    model = tiny_model()
    batch = random_batch(0)
    trainer = PolicyTrainer(model, NO_CLIP, micro_batch_size=5)
    lp, ent = trainer.compute_log_probs(batch, with_entropy=True)
    p = batch.prompt_width
    for i in range(batch.num_responses):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]  # unpadded prompt + response
        n_resp = int(batch.response_mask[i].sum())
        with torch.no_grad():
            logits = model(input_ids=ids.unsqueeze(0)).logits[0]  # (L, V)
        logp = torch.log_softmax(logits.double(), -1)
        plen = len(ids) - n_resp
        for t in range(n_resp):
            ref = logp[plen - 1 + t, ids[plen + t]]
            assert float(lp[i, t]) == pytest.approx(float(ref), abs=1e-5)
            probs = logp[plen - 1 + t].exp()
            assert float(ent[i, t]) == pytest.approx(float(-(probs * logp[plen - 1 + t]).sum()), abs=1e-5)
        assert torch.all(lp[i, n_resp:] == 0)
    assert batch.responses.shape[1] == batch.response_width and p > 0


def test_log_probs_and_entropy_are_at_the_sampling_temperature():
    model = tiny_model()
    batch = random_batch(0)
    trainer = PolicyTrainer(model, NO_CLIP, micro_batch_size=5, temperature=2.0)
    lp, ent = trainer.compute_log_probs(batch, with_entropy=True)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    p, t = batch.prompt_width, batch.response_width
    logp = torch.log_softmax(out.logits[:, p - 1 : p + t - 1].double() / 2.0, dim=-1)  # (N, T, V)
    want = logp.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1) * batch.response_mask  # (N, T)
    want_ent = -(logp.exp() * logp).sum(-1) * batch.response_mask  # (N, T)
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-5)
    raw, _ = PolicyTrainer(model, NO_CLIP, micro_batch_size=5).compute_log_probs(batch)
    assert not torch.allclose(raw, lp, atol=1e-3)  # the temperature really changed them


def test_update_recomputes_pi_theta_at_the_temperature_of_pi_old():
    # pi_old at T=2 and one mini-batch: the first (only) step is on-policy only if pi_theta is at T=2 too
    batch = random_batch(5)
    for temperature, on_policy in ((2.0, True), (1.0, False)):
        trainer = PolicyTrainer(tiny_model(seed=1), NO_CLIP, micro_batch_size=4, temperature=temperature)
        batch.old_log_probs = PolicyTrainer(tiny_model(seed=1), NO_CLIP, temperature=2.0).compute_log_probs(batch)[0]
        m = trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=100)
        assert (abs(m["ppo_kl"]) < 1e-6) == on_policy, (temperature, m["ppo_kl"])
        if on_policy:
            assert m["pg_clipfrac"] == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_temperature_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"temperature \(.*\) must be a finite number > 0.*rollout\.temperature"):
        PolicyTrainer(tiny_model(), NO_CLIP, temperature=bad)


def test_sft_step_ignores_the_sampling_temperature():
    batch = build_policy_batch([[3, 4]] * 4, [[5, 6, 7, 2]] * 4, pad_token_id=PAD)
    plain = PolicyTrainer(tiny_model(seed=3), NO_CLIP).sft_step(batch)
    hot = PolicyTrainer(tiny_model(seed=3), NO_CLIP, temperature=2.0).sft_step(batch)
    assert hot == pytest.approx(plain)


def test_policy_trainer_from_config_takes_the_rollout_temperature():
    from dapo_core.config import load_config
    from dapo_core.engines.executor import policy_trainer_from

    cfg = load_config(recipe="tiny-dapo", overrides=["rollout.temperature=0.7"], env={})
    trainer = policy_trainer_from(cfg, tiny_model(), torch.device("cpu"))
    assert trainer.temperature == 0.7


def _grads_after_update(batch, micro: int, loss_agg: str, entropy_coef: float = 0.0) -> dict[str, torch.Tensor]:
    model = tiny_model(seed=1)
    trainer = PolicyTrainer(model, NO_CLIP, micro_batch_size=micro)
    batch = copy.copy(batch)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0] + 0.05 * torch.randn(
        batch.response_mask.shape, generator=torch.Generator().manual_seed(3)
    )
    all_groups = int(batch.group_index.max()) + 1
    loss_cfg = loss_config(clip_c=10.0, loss_agg=loss_agg, entropy_coef=entropy_coef)
    metrics = trainer.update(batch, loss_cfg, ppo_epochs=1, mini_batch_groups=all_groups)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters()))
    return grads


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_mini_batch_gradient_is_independent_of_micro_batch_split(loss_agg, entropy_coef):
    batch = random_batch(7)
    whole = _grads_after_update(batch, micro=batch.num_responses, loss_agg=loss_agg, entropy_coef=entropy_coef)
    for micro in (1, 5):
        split = _grads_after_update(batch, micro=micro, loss_agg=loss_agg, entropy_coef=entropy_coef)
        for name, g in whole.items():
            torch.testing.assert_close(split[name], g, rtol=1e-5, atol=1e-6, msg=f"{name} micro={micro}")


def test_update_counts_mini_batches_and_reports_clipping():
    model = tiny_model(seed=2)
    trainer = PolicyTrainer(model, optim_config(lr=5e-2, weight_decay=0.0), micro_batch_size=4)
    batch = random_batch(11, groups=4, g=3)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0]
    metrics = trainer.update(batch, loss_config(clip_low=0.2, clip_high=0.28), ppo_epochs=2, mini_batch_groups=1)
    assert metrics["num_updates"] == 8.0  # 2 epochs x 4 mini-batches of one group
    assert trainer.global_step == 1
    # with a large lr, later mini-batches are off-policy: something must clip
    assert metrics["pg_clipfrac"] > 0
    assert metrics["ppo_kl_last"] != 0.0
    for key in ("pg_loss", "entropy", "mean_prob", "grad_norm", "lr", "pg_clipfrac_high", "pg_clipfrac_low"):
        assert key in metrics


def _record_step_lrs(trainer: PolicyTrainer) -> list[float]:
    """The lr of the param groups (all equal) at each optimizer step, from a step pre-hook."""
    seen: list[float] = []

    def hook(optimizer, args, kwargs):
        lrs = {g["lr"] for g in optimizer.param_groups}
        assert len(lrs) == 1
        seen.append(lrs.pop())

    trainer.optimizer.register_step_pre_hook(hook)
    return seen


def test_short_last_mini_batch_steps_at_a_scaled_lr_that_is_then_restored():
    # 3 groups in mini-batches of 2 = 1.5 mini-batches: the second step holds half the groups -> lr x 0.5
    optim = optim_config(lr=1e-2, weight_decay=0.0, grad_clip=1e9, warmup_steps=4)  # scheduler lr 0.25x, 0.5x, ..
    trainer = PolicyTrainer(tiny_model(seed=2), optim, micro_batch_size=4)
    batch = random_batch(11, groups=3, g=2)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0]
    seen = _record_step_lrs(trainer)
    metrics = trainer.update(batch, loss_config(), ppo_epochs=2, mini_batch_groups=2)
    base = 1e-2 * 0.25
    assert seen == pytest.approx([base, base * 0.5, base, base * 0.5])  # per epoch: full, then the short one
    assert metrics["short_minibatch_scale"] == 0.5 and metrics["lr"] == pytest.approx(base)
    # restored, and the schedule went on exactly as without the scaling (warm-up step 2 of 4)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5)
    assert trainer.scheduler.get_last_lr() == pytest.approx([1e-2 * 0.5])


def test_full_mini_batches_step_at_the_scheduled_lr():
    trainer = PolicyTrainer(tiny_model(seed=2), NO_CLIP, micro_batch_size=4)
    batch = random_batch(11, groups=4, g=2)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0]
    seen = _record_step_lrs(trainer)
    metrics = trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=2)
    assert seen == [NO_CLIP.lr, NO_CLIP.lr] and metrics["short_minibatch_scale"] == 1.0


def test_given_mini_batch_scales_are_used_and_checked():
    # the Ray trainer ranks' path: relabelled shards (one "group" per mini-batch) with the whole batch's scales
    batch = random_batch(3, groups=5, g=2)
    assert short_mini_batch_scales(batch, 2) == [1.0, 1.0, 0.5]
    assert short_mini_batch_scales(batch, 5) == [1.0] and short_mini_batch_scales(batch, 8) == [0.625]
    trainer = PolicyTrainer(tiny_model(seed=2), NO_CLIP, micro_batch_size=4)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0]
    seen = _record_step_lrs(trainer)
    metrics = trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=2, mini_batch_scales=[1, 1, 0.25])
    assert seen == pytest.approx([NO_CLIP.lr, NO_CLIP.lr, NO_CLIP.lr * 0.25])
    assert metrics["short_minibatch_scale"] == 0.25
    for bad in ([1.0, 0.5], [1.0, 1.0, 0.0], [1.0, 1.0, 1.5]):
        with pytest.raises(ValueError, match=r"one lr multiplier in \(0, 1\] per mini-batch \(3 here\)"):
            trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=2, mini_batch_scales=bad)


def test_split_by_groups_keeps_groups_together():
    batch = random_batch(1, groups=5, g=3)
    minis = split_by_groups(batch, 2)
    assert [m.num_responses for m in minis] == [6, 6, 3]
    for m in minis:
        counts = torch.bincount(m.group_index)
        assert set(counts[counts > 0].tolist()) == {3}


def test_sft_step_lowers_loss():
    model = tiny_model(seed=3, dtype=torch.float32)
    trainer = PolicyTrainer(model, optim_config(lr=1e-2, weight_decay=0.0), micro_batch_size=8)
    batch = build_policy_batch([[3, 4]] * 8, [[5, 6, 7, 2]] * 8, pad_token_id=PAD)
    first = trainer.sft_step(batch)["loss"]
    for _ in range(20):
        last = trainer.sft_step(batch)
    assert last["loss"] < first * 0.5 and last["token_acc"] > 0.5


def test_lr_schedules():
    warm = lr_lambda(optim_config(lr=1e-3, warmup_steps=4, scheduler="constant"))
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = lr_lambda(optim_config(lr=1e-3, warmup_steps=0, scheduler="cosine", total_steps=10, min_lr_ratio=0.1))
    assert cos(0) == pytest.approx(1.0) and cos(10) == pytest.approx(0.1) and cos(5) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="valid: constant, cosine"):
        lr_lambda(optim_config(lr=1e-3, scheduler="linear"))


def test_update_requires_advantages_and_old_log_probs():
    trainer = PolicyTrainer(tiny_model(), NO_CLIP)
    batch = random_batch(0)
    with pytest.raises(ValueError, match="old_log_probs"):
        trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=1)


# ---------------- two gloo ranks in two processes ----------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = random_batch(7)
        model = tiny_model(seed=1)
        trainer = PolicyTrainer(model, NO_CLIP, micro_batch_size=2)
        old = trainer.compute_log_probs(batch)[0] + 0.05 * torch.randn(
            batch.response_mask.shape, generator=torch.Generator().manual_seed(3)
        )
        batch.old_log_probs = old
        # this rank's shard: alternate groups (unequal token counts across ranks on purpose)
        rows = torch.nonzero(batch.group_index % world == rank).squeeze(-1)
        shard = batch.select(rows)
        metrics = trainer.update(shard, loss_config(clip_c=10.0), ppo_epochs=1, mini_batch_groups=100)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(grads, Path(out_dir) / f"rank{rank}.pt")
        torch.save(metrics["short_minibatch_scale"], Path(out_dir) / f"scale{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks_give_the_single_process_gradient(tmp_path):
    port = _free_port()
    mp.start_processes(_rank_main, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    batch = random_batch(7)
    single = _grads_after_update(batch, micro=batch.num_responses, loss_agg="token-mean")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, g in single.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert len(got) == len(single)
        # the lr scale counts the groups of every rank (4 of 100), so the ranks' weights stay identical
        assert torch.load(tmp_path / f"scale{rank}.pt") == pytest.approx(4 / 100)
