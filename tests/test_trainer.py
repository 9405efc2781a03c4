"""PolicyTrainer: log-probs vs a naive forward, micro-batch/rank invariance of the gradient, SFT, schedules."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _tiny import PAD, random_batch, tiny_model

from dapo_core.engines.batch import build_policy_batch, split_by_groups
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer, lr_lambda

NO_CLIP = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1e9)


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


def _grads_after_update(batch, micro: int, loss_agg: str, entropy_coef: float = 0.0) -> dict[str, torch.Tensor]:
    model = tiny_model(seed=1)
    trainer = PolicyTrainer(model, NO_CLIP, micro_batch_size=micro)
    batch = copy.copy(batch)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0] + 0.05 * torch.randn(
        batch.response_mask.shape, generator=torch.Generator().manual_seed(3)
    )
    all_groups = int(batch.group_index.max()) + 1
    loss_cfg = LossConfig(clip_c=10.0, loss_agg=loss_agg, entropy_coef=entropy_coef)
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
    trainer = PolicyTrainer(model, OptimConfig(lr=5e-2, weight_decay=0.0), micro_batch_size=4)
    batch = random_batch(11, groups=4, g=3)
    batch.old_log_probs = trainer.compute_log_probs(batch)[0]
    metrics = trainer.update(batch, LossConfig(clip_low=0.2, clip_high=0.28), ppo_epochs=2, mini_batch_groups=1)
    assert metrics["num_updates"] == 8.0  # 2 epochs x 4 mini-batches of one group
    assert trainer.global_step == 1
    # with a large lr, later mini-batches are off-policy: something must clip
    assert metrics["pg_clipfrac"] > 0
    assert metrics["ppo_kl_last"] != 0.0
    for key in ("pg_loss", "entropy", "mean_prob", "grad_norm", "lr", "pg_clipfrac_high", "pg_clipfrac_low"):
        assert key in metrics


def test_split_by_groups_keeps_groups_together():
    batch = random_batch(1, groups=5, g=3)
    minis = split_by_groups(batch, 2)
    assert [m.num_responses for m in minis] == [6, 6, 3]
    for m in minis:
        counts = torch.bincount(m.group_index)
        assert set(counts[counts > 0].tolist()) == {3}


def test_sft_step_lowers_loss():
    model = tiny_model(seed=3, dtype=torch.float32)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2, weight_decay=0.0), micro_batch_size=8)
    batch = build_policy_batch([[3, 4]] * 8, [[5, 6, 7, 2]] * 8, pad_token_id=PAD)
    first = trainer.sft_step(batch)["loss"]
    for _ in range(20):
        last = trainer.sft_step(batch)
    assert last["loss"] < first * 0.5 and last["token_acc"] > 0.5


def test_lr_schedules():
    warm = lr_lambda(OptimConfig(warmup_steps=4, scheduler="constant"))
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = lr_lambda(OptimConfig(warmup_steps=0, scheduler="cosine", total_steps=10, min_lr_ratio=0.1))
    assert cos(0) == pytest.approx(1.0) and cos(10) == pytest.approx(0.1) and cos(5) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="valid: constant, cosine"):
        lr_lambda(OptimConfig(scheduler="linear"))


def test_update_requires_advantages_and_old_log_probs():
    trainer = PolicyTrainer(tiny_model(), NO_CLIP)
    batch = random_batch(0)
    with pytest.raises(ValueError, match="old_log_probs"):
        trainer.update(batch, LossConfig(), ppo_epochs=1, mini_batch_groups=1)


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
        trainer.update(shard, LossConfig(clip_c=10.0), ppo_epochs=1, mini_batch_groups=100)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(grads, Path(out_dir) / f"rank{rank}.pt")
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
