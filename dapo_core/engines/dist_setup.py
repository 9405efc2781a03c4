"""How the trainer ranks form their ``torch.distributed`` group: backend string, timeout, barrier device.

    kwargs = init_process_group_kwargs("cuda", address=ip, port=port, rank=r, world_size=n, collective_timeout_s=3600)
    dist.init_process_group(**kwargs)          # backend "cpu:gloo,cuda:nccl" on GPU, "gloo" on CPU

Backend. On GPU the default group is *mixed*: NCCL for CUDA tensors, gloo for CPU tensors (as verl does). FSDP2
with CPU offload keeps the sharded gradients on the host, so ``clip_grad_norm_`` all-reduces CPU DTensor partial
norms, and rank-0 loading broadcasts CPU shards: a pure NCCL group cannot (pytorch issue 148532). The mixed group
also gives the ranks a CPU side for the barrier below.

Timeout. Collectives get ``resources.collective_timeout_s`` (default an hour), not the actor start timeout: while
rank 0 alone writes an HF export or a checkpoint (65-130 GB at 32B) the other ranks wait for it in a collective,
and the process group's timeout (the NCCL watchdog on GPU) decides how long they may.

Barrier. That wait (``dapo_core.engines.fsdp.all_ranks_ok``) runs over the group's CPU side (gloo) whenever the
backend has one (``barrier_device``): a CPU all-reduce waits in a host thread, with the group's timeout, and puts
nothing on the NCCL stream; an NCCL all-reduce would sit as a kernel spinning on the GPU for the whole write and
block every later kernel queued on that stream. Pure torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

# The backend of a trainer group on GPU: CPU tensors over gloo, CUDA tensors over NCCL (one default group).
MIXED_CUDA_BACKEND = "cpu:gloo,cuda:nccl"
CPU_BACKEND = "gloo"


def process_group_backend(device_type: str) -> str:
    """The ``init_process_group`` backend for ranks computing on ``device_type`` ("cuda" or "cpu")."""
    if device_type == "cuda":
        return MIXED_CUDA_BACKEND
    if device_type == "cpu":
        return CPU_BACKEND
    raise ValueError(
        f"process_group_backend: no trainer process-group backend for device type {device_type!r}; the trainer "
        "ranks run on 'cuda' or 'cpu' (set trainer.device accordingly)"
    )


def backend_handles_cpu(backend: str) -> bool:
    """True when a group with this backend string runs collectives on CPU tensors (gloo alone, or a mixed string
    with a ``cpu:`` entry such as ``cpu:gloo,cuda:nccl``); False for pure ``nccl``."""
    entries = [part.strip() for part in str(backend).lower().split(",") if part.strip()]
    for entry in entries:
        device, _, name = entry.rpartition(":")
        if name == "gloo" and device in ("", "cpu"):
            return True
    return False


def barrier_device(backend: str) -> torch.device:
    """Where a small flag tensor for a barrier-like all-reduce must live on a group with ``backend``: the CPU when
    the group has a CPU side (see the module docstring), else the current CUDA device (pure NCCL)."""
    if backend_handles_cpu(backend):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(
        f"barrier_device: the process group's backend {backend!r} has no CPU side and CUDA is not available; "
        f"initialise the group with process_group_backend(<device type>) ({CPU_BACKEND!r} on CPU)"
    )


def init_process_group_kwargs(
    device_type: str, *, address: str, port: int, rank: int, world_size: int, collective_timeout_s: float
) -> dict[str, Any]:
    """Keyword arguments of ``dist.init_process_group`` for one trainer rank (TCP rendezvous at address:port)."""
    if not collective_timeout_s > 0:
        raise ValueError(
            f"init_process_group_kwargs: collective_timeout_s ({collective_timeout_s}) must be > 0 seconds; set "
            "resources.collective_timeout_s"
        )
    return {
        "backend": process_group_backend(device_type),
        "init_method": f"tcp://{address}:{port}",
        "rank": rank,
        "world_size": world_size,
        "timeout": timedelta(seconds=collective_timeout_s),
    }
