"""The trainer group's process-group setup: backend string (mixed gloo/NCCL on GPU), the collectives' own timeout,
and the barrier where the other ranks wait while rank 0 alone writes an export or a checkpoint."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dapo_core.engines.dist_setup import (
    MIXED_CUDA_BACKEND,
    backend_handles_cpu,
    barrier_device,
    init_process_group_kwargs,
    process_group_backend,
)

WORLD = 2
START_TIMEOUT_S = 1.0  # what ready() used to pass as the collectives' timeout
COLLECTIVE_TIMEOUT_S = 60.0
WRITE_S = 3.0  # rank 0's slow write: longer than the start timeout, shorter than the collective timeout


# ---------------------------------------------------------------------------------------- pure functions
def test_backend_is_gloo_for_cpu_tensors_and_nccl_for_cuda_tensors_on_gpu():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl" == MIXED_CUDA_BACKEND
    assert process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match=r"no trainer process-group backend for device type 'mps'.*trainer\.device"):
        process_group_backend("mps")


def test_the_barrier_runs_on_the_cpu_whenever_the_group_has_a_gloo_side():
    for backend in ("gloo", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "CPU:GLOO, cuda:nccl"):
        assert backend_handles_cpu(backend), backend
        assert barrier_device(backend) == torch.device("cpu")
    for backend in ("nccl", "cuda:nccl", "cuda:gloo,cpu:nccl"):
        assert not backend_handles_cpu(backend), backend
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"backend 'nccl' has no CPU side and CUDA is not available"):
            barrier_device("nccl")


def test_init_kwargs_carry_the_collective_timeout_and_the_backend():
    kwargs = init_process_group_kwargs(
        "cuda", address="10.0.0.1", port=29500, rank=3, world_size=8, collective_timeout_s=3600.0
    )
    assert kwargs == {
        "backend": "cpu:gloo,cuda:nccl",
        "init_method": "tcp://10.0.0.1:29500",
        "rank": 3,
        "world_size": 8,
        "timeout": timedelta(hours=1),
    }
    with pytest.raises(ValueError, match=r"collective_timeout_s \(0\) must be > 0.*resources\.collective_timeout_s"):
        init_process_group_kwargs("cpu", address="a", port=1, rank=0, world_size=1, collective_timeout_s=0)


# ---------------------------------------------------------------------------------------- TrainerGroup.ready
class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _FakeRank:
    """Stands in for a Ray actor handle: records what ``ready`` sends each rank."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.rendezvous = _Remote(lambda: ("10.0.0.1", 29500))
        self.init_process_group = _Remote(lambda *args: calls.append(args) or "gloo")


def test_ready_gives_the_ranks_the_collective_timeout_not_the_start_timeout(monkeypatch):
    from dapo_core.distributed import trainer_group
    from dapo_core.distributed.trainer_group import TrainerGroup

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(trainer_group, "wait_ready", lambda actors, timeout_s: None)
    group = TrainerGroup.__new__(TrainerGroup)  # no Ray: two recorded ranks
    group.cfg = SimpleNamespace(resources=SimpleNamespace(collective_timeout_s=5400.0))
    group.actors = [SimpleNamespace(handle=_FakeRank(calls)) for _ in range(WORLD)]
    group.start_timeout_s, group.backend, group.fsdp = 300.0, "none", True
    group._get = lambda refs, actors: list(refs)  # type: ignore[method-assign]
    group.ready()
    assert calls == [("10.0.0.1", 29500, 5400.0)] * WORLD
    assert group.backend == "gloo"


def test_a_rank_passes_its_timeout_to_init_process_group(monkeypatch):
    import torch.distributed as dist

    from dapo_core.distributed.trainer_group import TrainerRank

    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    rank = TrainerRank.__new__(TrainerRank)
    rank.rank, rank.world_size, rank.device, rank.fsdp = 1, 2, torch.device("cpu"), False
    assert rank.init_process_group("10.0.0.1", 29500, 5400.0) == "gloo"
    assert seen["timeout"] == timedelta(seconds=5400.0) and seen["backend"] == "gloo"
    assert seen["init_method"] == "tcp://10.0.0.1:29500" and (seen["rank"], seen["world_size"]) == (1, 2)


# ---------------------------------------------------------------------------------------- 2 real gloo ranks
def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from _tiny import optim_config, tiny_model

    import dapo_core.engines.checkpoint as checkpoint
    import dapo_core.engines.models as models
    from dapo_core.distributed.trainer_group import TrainerRank
    from dapo_core.engines.fsdp import FsdpSettings, apply_fsdp2, export_hf_dir, save_fsdp_checkpoint
    from dapo_core.engines.trainer import PolicyTrainer

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    real_save, real_commit = models.save_hf_dir, checkpoint._write_and_commit

    def slow_save(*args: Any, **kwargs: Any) -> Any:  # rank 0's export: a 65-130 GB write at 32B
        time.sleep(WRITE_S)
        return real_save(*args, **kwargs)

    def slow_commit(*args: Any, **kwargs: Any) -> Any:  # rank 0's HF files of a checkpoint
        time.sleep(WRITE_S)
        return real_commit(*args, **kwargs)

    models.save_hf_dir, checkpoint._write_and_commit = slow_save, slow_commit
    trainer_rank = TrainerRank.__new__(TrainerRank)  # just the group-forming part of the actor
    trainer_rank.rank, trainer_rank.world_size, trainer_rank.fsdp = rank, WORLD, False
    trainer_rank.device = torch.device("cpu")
    try:
        out["backend"] = trainer_rank.init_process_group("127.0.0.1", port, COLLECTIVE_TIMEOUT_S)
        model = apply_fsdp2(tiny_model(seed=1), FsdpSettings("float32", "float32"))
        trainer = PolicyTrainer(model, optim_config(lr=1e-3), micro_batch_size=2)
        t0 = time.perf_counter()
        export_hf_dir(model, None, Path(out_dir) / "export")
        out["export_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        path = save_fsdp_checkpoint(
            Path(out_dir) / "ckpt", 1, model=model, optimizer=trainer.optimizer, trainer_state=trainer.state_dict()
        )
        out["checkpoint_s"] = time.perf_counter() - t0
        out["checkpoint"] = str(path)
        out["ok"] = True
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_other_ranks_wait_for_rank0s_slow_write_past_the_start_timeout(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for r, out in enumerate(outs):
        assert out.get("ok"), f"rank {r}: {out.get('error')}"
        assert out["backend"] == "gloo"
        # every rank returned only after rank 0's write: they waited longer than the start timeout, at the barrier
        assert out["export_s"] >= WRITE_S > START_TIMEOUT_S
        assert out["checkpoint_s"] >= WRITE_S
    assert (tmp_path / "export" / "config.json").is_file()
    assert (Path(outs[1]["checkpoint"]) / "COMPLETE").is_file()
