"""The trainer's side of a streamed weight sync: which tensors travel together, and each bucket gathered in turn.

A sync used to gather the whole model onto rank 0 in the fp32 master dtype and put it in Ray's object store in
one piece (Qwen2.5-32B: ~131 GB, then copied once more per rollout engine). Now the controller asks for one bucket
at a time, in the rollout dtype:

    plan = sync_plan(model, limit_bytes=512 << 20, dtype=torch.bfloat16)   # the same on every rank
    for names in plan:
        bucket = gather_bucket(model, names, dtype=torch.bfloat16, rank=rank)   # collective under FSDP2
        ...                                # rank 0: {name: CPU tensor}; the engines load it; the next follows

Under FSDP2 each sharded tensor is cast *before* its all-gather (``DTensor.to(dtype).full_tensor()``), so the
trainer ranks move half the bytes of an fp32 gather, and only one bucket of full tensors exists at a time. The
bucket boundaries come from ``vllm_worker.plan_buckets`` with ``layer_group``: a decoder layer is never split,
because vLLM finalises a layer's weights once they have all arrived. Pure torch; no Ray, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dapo_core.engines.rollout.vllm_worker import layer_group, plan_buckets

DTYPE_NAMES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ship_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a dtype name (None or "auto": ship the tensors as they are)."""
    if name in (None, "auto"):
        return None
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"weight sync dtype {name!r} is not one of {sorted(DTYPE_NAMES)} or 'auto'") from None


def _shipped_nbytes(tensor: Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of the full tensor once cast (a DTensor's shape is the global one)."""
    itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize


def sync_plan(model: nn.Module, *, limit_bytes: int, dtype: torch.dtype | None) -> list[list[str]]:
    """The state dict's names cut into buckets of at most ``limit_bytes`` as shipped (a layer never split).

    Every rank computes the same plan: it depends only on the names and global shapes."""
    sizes = [(name, _shipped_nbytes(t, dtype)) for name, t in model.state_dict().items()]
    return plan_buckets(sizes, limit_bytes, group=layer_group)


def _full_cpu(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The whole tensor on CPU, cast before any gather: a sharded DTensor is all-gathered (a collective)."""
    t = tensor.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)  # on the shard: the all-gather below moves the cast bytes
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu", copy=True)  # the bucket owns its memory (not a view of a live parameter)


def gather_bucket(
    model: nn.Module, names: Sequence[str], *, dtype: torch.dtype | None, rank: int = 0
) -> dict[str, Tensor] | None:
    """One bucket of full tensors: ``{name: CPU tensor}`` on rank 0, None on the others.

    Under FSDP2 every rank must call it with the same names in the same order (each sharded tensor is one
    all-gather); without sharding only rank 0 needs to be called.
    """
    state = model.state_dict()
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"weight sync bucket names {missing[:5]} are not in the model's state dict: re-plan the sync")
    out = {name: _full_cpu(state[name], dtype) for name in names}
    return out if rank == 0 else None
