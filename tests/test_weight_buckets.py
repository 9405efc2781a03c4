"""The trainer's side of a streamed weight sync: the bucket plan, and buckets gathered from FSDP2 shards on two
gloo ranks (cast before the all-gather) equal to the full weights in the rollout dtype."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _tiny import tiny_model

from dapo_core.engines.rollout.vllm_worker import layer_group
from dapo_core.engines.weight_buckets import gather_bucket, ship_dtype, sync_plan

LIMIT = 16 << 10  # bytes: the tiny model (~76 kB in fp32) travels in several buckets


def test_the_plan_covers_every_tensor_once_in_order_and_never_splits_a_layer():
    model = tiny_model(seed=0)
    plan = sync_plan(model, limit_bytes=LIMIT, dtype=torch.bfloat16)
    names = list(model.state_dict())
    assert [n for bucket in plan for n in bucket] == names and len(plan) >= 3
    owner = {n: k for k, bucket in enumerate(plan) for n in bucket}
    for n in names:  # every tensor of a decoder layer sits in that layer's one bucket
        group = layer_group(n)
        if group:
            assert {owner[m] for m in names if layer_group(m) == group} == {owner[n]}
    state = model.state_dict()
    for bucket in plan:  # sizes as shipped in bf16: over the limit only for a single layer's group
        size = sum(state[n].numel() * 2 for n in bucket)
        assert size <= LIMIT or len({layer_group(n) for n in bucket}) == 1


def test_a_bucket_is_cast_copied_and_only_rank0_keeps_it():
    model = tiny_model(seed=0)
    names = list(model.state_dict())[:3]
    bucket = gather_bucket(model, names, dtype=torch.bfloat16, rank=0)
    assert bucket is not None and list(bucket) == names
    for n in names:
        assert bucket[n].dtype == torch.bfloat16 and torch.equal(bucket[n], model.state_dict()[n].to(torch.bfloat16))
    bucket[names[0]].zero_()  # the bucket owns its memory: the model is untouched
    assert model.state_dict()[names[0]].abs().sum() > 0
    assert gather_bucket(model, names, dtype=None, rank=1) is None
    with pytest.raises(KeyError, match="re-plan"):
        gather_bucket(model, ["model.layers.99.mlp.up_proj.weight"], dtype=None)
    assert ship_dtype("auto") is None and ship_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        ship_dtype("int8")


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from dapo_core.engines.fsdp import FsdpSettings, apply_fsdp2

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = apply_fsdp2(tiny_model(seed=0), FsdpSettings(param_dtype="float32", reduce_dtype="float32"))
        plan = sync_plan(model, limit_bytes=LIMIT, dtype=torch.bfloat16)
        got: dict[str, torch.Tensor] = {}
        for names in plan:  # every rank joins each bucket's all-gathers, in the same order
            bucket = gather_bucket(model, names, dtype=torch.bfloat16, rank=rank)
            assert (bucket is None) == (rank != 0)
            got.update(bucket or {})
        if rank == 0:
            torch.save({"plan": plan, "weights": got}, out)
    finally:
        dist.destroy_process_group()


def test_buckets_gathered_from_fsdp2_shards_equal_the_full_weights_in_bf16(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.start_processes(_rank, args=(port, str(out)), nprocs=2, join=True, start_method="spawn")
    saved = torch.load(out)
    full = tiny_model(seed=0).state_dict()
    assert saved["plan"] == sync_plan(tiny_model(seed=0), limit_bytes=LIMIT, dtype=torch.bfloat16)
    assert sorted(saved["weights"]) == sorted(full)
    for name, tensor in full.items():
        got = saved["weights"][name]
        assert got.dtype == torch.bfloat16 and got.device.type == "cpu", name
        assert torch.equal(got, tensor.to(torch.bfloat16)), name
