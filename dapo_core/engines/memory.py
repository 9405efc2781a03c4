"""Giving cached accelerator memory back between the phases of a colocated step.

PyTorch's CUDA caching allocator keeps every block it ever handed out: after an update it still holds the
trainer's peak (the logits of a micro-batch: micro x length x vocab, plus activations), reserved but unused. A
colocated vLLM engine that then wakes its KV cache (``wake_up(tags=["kv_cache"])``) allocates outside that cache
and finds the GPU full. So the trainer releases its cache after the update and before the engine wakes, and the
vLLM worker releases its own after a weight sync (the sync's staging copies), as verl does before every rollout.

    report = release_cached_memory("trainer")   # gc, then torch.cuda.empty_cache() where CUDA is in use

On CPU there is no cache to give back: only ``gc`` runs, and the report's byte counts are 0.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryReport:
    """Reserved (cached + in use) and allocated bytes of this process's CUDA allocator around one release."""

    where: str
    reserved_before: int
    reserved_after: int
    allocated: int

    @property
    def released(self) -> int:
        return self.reserved_before - self.reserved_after


def cuda_in_use() -> bool:
    """True when this process has initialised CUDA (a release there has something to give back)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def release_cached_memory(where: str) -> MemoryReport:
    """Collect garbage, then hand the CUDA caching allocator's unused blocks back to the driver.

    ``where`` names the caller in the log line and the report (e.g. ``"trainer rank 0"``, ``"vllm worker"``).
    """
    gc.collect()  # reference cycles (autograd graphs kept by an exception, HF outputs) free their tensors first
    if not cuda_in_use():
        return MemoryReport(where, 0, 0, 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    report = MemoryReport(where, before, torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
    logger.info(
        "%s: released %.2f GiB of cached GPU memory (reserved %.2f -> %.2f GiB, allocated %.2f GiB)",
        where, report.released / GIB, before / GIB, report.reserved_after / GIB, report.allocated / GIB,
    )  # fmt: skip
    return report
