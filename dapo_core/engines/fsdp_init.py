"""Rank-0 loading for FSDP2: one rank reads the checkpoint, every rank receives only its shard.

Loading the full model on every rank before sharding costs ``ranks x 4 bytes x parameters`` of host memory
(Qwen2.5-32B in fp32: ~131 GB per rank, ~1 TB on an 8-GPU node). Instead:

    skeleton = meta_skeleton(path)                          # every rank: the architecture, no memory
    full = load_model(path, dtype=MASTER_DTYPE) if rank == 0 else None
    model = apply_fsdp2(skeleton, settings, mesh=mesh)      # shard the (meta) parameters
    materialize_from_rank0(model, full, device=device)      # allocate the shards, rank 0's weights broadcast in

Only rank 0 holds a full copy, once, while the weights are broadcast; the others allocate just their shards.
Buffers that state dicts leave out (non-persistent ones such as RoPE's ``inv_freq``) are broadcast from rank 0
too, so every rank ends up with exactly the model ``load_model`` would have given it. Pure torch + transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from dapo_core.engines.fsdp import DTYPES, MASTER_DTYPE
from dapo_core.engines.models import load_model, offline_mode

logger = logging.getLogger(__name__)


def meta_skeleton(path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``path`` built on the meta device (shapes only, no storage), in ``MASTER_DTYPE``.

    Reads only ``config.json``; a missing model fails like ``load_model`` (the path is checked the same way).
    """
    config = AutoConfig.from_pretrained(
        path, revision=revision, trust_remote_code=trust_remote_code, local_files_only=offline_mode()
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[MASTER_DTYPE], trust_remote_code=trust_remote_code
        )
    model.eval()
    return model


def load_master_on_rank0(
    path: str, *, rank: int, revision: str | None = None, trust_remote_code: bool = False
) -> tuple[nn.Module, nn.Module | None]:
    """(meta skeleton, full fp32 model on CPU for rank 0 / None elsewhere)."""
    skeleton = meta_skeleton(path, revision=revision, trust_remote_code=trust_remote_code)
    full = None
    if rank == 0:
        full = load_model(path, dtype=MASTER_DTYPE, revision=revision, trust_remote_code=trust_remote_code)
    return skeleton, full


def _same_tying(skeleton: nn.Module, full: nn.Module) -> None:
    """The skeleton must tie exactly what the loaded model ties (else a broadcast would fill a stale copy)."""

    def tied(m: nn.Module) -> bool:
        get_in, get_out = getattr(m, "get_input_embeddings", None), getattr(m, "get_output_embeddings", None)
        if not callable(get_in) or not callable(get_out) or get_out() is None:
            return False
        return get_in().weight is get_out().weight

    if tied(skeleton) != tied(full):
        raise RuntimeError(
            f"rank-0 loading: the meta skeleton ties embeddings = {tied(skeleton)} but the loaded model = "
            f"{tied(full)}; the checkpoint's config.json and weights disagree (check tie_word_embeddings)"
        )


@torch.no_grad()
def materialize_from_rank0(
    model: nn.Module,
    full: nn.Module | None,
    *,
    device: torch.device | str,
    buffer_device: torch.device | str | None = None,
) -> None:
    """Collective, after ``apply_fsdp2`` on a meta skeleton: allocate every rank's shards on ``device`` and fill
    them (and all buffers) from rank 0's ``full`` model (``None`` on the other ranks).

    ``device``: where the sharded parameters live (the GPU, or ``"cpu"`` with CPU offload); ``buffer_device``:
    where buffers live (the compute device, which differs from ``device`` under CPU offload; default ``device``).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and full is None:
        raise ValueError("materialize_from_rank0: rank 0 must pass the loaded full model (got None)")
    if rank == 0:
        assert full is not None
        _same_tying(model, full)
    model.to_empty(device=device)
    if buffer_device is not None and torch.device(buffer_device) != torch.device(device):
        for module in model.modules():  # the forward runs on the compute device: buffers go there
            for key, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[key] = buf.to(buffer_device)
    full_state: dict[str, Any] = full.state_dict() if full is not None else {}
    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    # Buffers are not sharded by FSDP; non-persistent ones (RoPE inv_freq) are absent from state dicts.
    source = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if rank == 0:
            buf.copy_(source[name])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)
    logger.info("FSDP2 rank-0 loading: rank %d holds its shards on %s", rank, device)
