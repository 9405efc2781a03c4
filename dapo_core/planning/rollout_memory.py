"""vLLM per GPU (weights, KV cache, sequences that fit), colocated sleep headroom, and the per-step weight sync.

All estimates: vLLM's own profile run decides the real KV cache at start-up. The model here:

- weights per GPU = parameters x rollout dtype bytes / tensor_parallel_size (embeddings and LM head are
  vocabulary-parallel, so they split too; the RMSNorm weights replicated on each rank are ignored: < 0.01%);
- KV cache = gpu_memory_utilization x GPU memory - weights - ``VLLM_FIXED_BYTES`` (CUDA context, NCCL, CUDA graphs:
  stated constant) - the profile run's activation peak, estimated as max_num_batched_tokens x (4·h + 2·I / TP) x
  dtype bytes + ``SAMPLER_SEQS`` x V / TP x 4 (the sampler's float32 logits);
- KV bytes per token per GPU = 2 (K and V) x L x max(1, KV / TP) x d x dtype bytes (KV heads split over TP ranks,
  replicated when TP exceeds them);
- sequences of max_model_len that fit = KV cache / (KV bytes per token x max_model_len), compared with what a
  generation batch asks per engine (gen_batch_size x n / rollout engines). Fewer is not an error (vLLM queues and
  preempts), only slower; no room for one sequence is (vLLM refuses to start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo_core.planning.arch import DTYPE_BYTES, Arch, param_count

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

GIB = 1 << 30
VLLM_FIXED_BYTES = GIB  # CUDA context + NCCL + CUDA graphs of one vLLM worker (estimate; ~0.5 GiB with enforce_eager)
VLLM_ASLEEP_BYTES = GIB // 2  # what a level-1-asleep vLLM worker still holds: its CUDA context (estimate)
SAMPLER_SEQS = 256  # vLLM's default max_num_seqs: the profile run's sampler batch


def rollout_dtype(cfg: DapoConfig, a: Arch) -> str:
    """The engine dtype: rollout.dtype, with "auto" = the checkpoint's torch_dtype."""
    return a.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def ship_dtype(cfg: DapoConfig) -> str:
    """The dtype weight syncs travel in (dapo_core.engines.weight_buckets.ship_dtype): rollout.dtype, or the
    trainer's own dtype for "auto" (float32 masters under fsdp2, model.dtype under ddp)."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    return "float32" if cfg.trainer.strategy == "fsdp2" else cfg.model.dtype


@dataclass(frozen=True)
class VllmGpu:
    """One vLLM worker's GPU: its budget and how it is spent."""

    dtype: str
    budget: int  # gpu_memory_utilization x GPU memory
    weights: int
    overhead: int  # fixed + profile activations (estimate)
    kv_cache: int  # may be negative: the plan cannot start
    kv_bytes_per_token: int
    max_model_len: int
    seqs_fit: int  # full-length sequences the KV cache holds
    seqs_asked: int  # sequences of one generation batch per engine


def kv_bytes_per_token(a: Arch, tp: int, e: int) -> int:
    """K and V of every layer for one token on one TP rank."""
    return 2 * a.layers * max(1, a.kv_heads // tp) * a.head_dim * e


def vllm_gpu(cfg: DapoConfig, a: Arch, *, gpu_mem: int) -> VllmGpu:
    """The vLLM worker's memory on a GPU of ``gpu_mem`` bytes."""
    from dapo_core.config.schema import resolved_max_new_tokens

    ro = cfg.rollout
    dtype = rollout_dtype(cfg, a)
    e, tp = DTYPE_BYTES[dtype], ro.tensor_parallel_size
    weights = param_count(a) * e // tp
    fixed = VLLM_FIXED_BYTES // 2 if ro.enforce_eager else VLLM_FIXED_BYTES
    profile = ro.max_num_batched_tokens * (4 * a.hidden + 2 * a.intermediate // tp) * e
    overhead = fixed + profile + SAMPLER_SEQS * (a.vocab // tp) * 4
    budget = int(ro.gpu_memory_utilization * gpu_mem)
    kv = budget - weights - overhead
    per_token = kv_bytes_per_token(a, tp, e)
    max_len = ro.max_model_len or cfg.data.max_prompt_length + resolved_max_new_tokens(cfg)
    fit = max(0, kv) // (per_token * max_len)
    asked = -(-cfg.data.gen_batch_size * ro.n // cfg.resources.rollout_workers)
    return VllmGpu(dtype, budget, weights, overhead, kv, per_token, max_len, fit, asked)


@dataclass(frozen=True)
class StepFigures:
    """Per rollout step: the weight sync and the tokens generated."""

    sync_dtype: str
    sync_bytes_per_engine: int  # what each rollout engine receives
    engines: int
    sync_seconds: float  # one engine's bytes at the stated bandwidth (engines in parallel)
    sync_seconds_serial: float  # all engines' bytes through one link (the upper bound)
    gbps: float
    tokens_max: int  # gen_batch_size x n x max_new_tokens (one generation batch)
    tokens_mean: int  # at a mean response of half max_new_tokens (assumption)


def step_figures(cfg: DapoConfig, a: Arch, *, gbps: float) -> StepFigures:
    """Weight-sync bytes and time (at ``gbps`` GB/s, 1e9 bytes) and tokens of one generation batch."""
    from dapo_core.config.schema import resolved_max_new_tokens

    dtype = ship_dtype(cfg)
    per_engine = param_count(a) * DTYPE_BYTES[dtype]
    engines = cfg.resources.rollout_workers
    rows = cfg.data.gen_batch_size * cfg.rollout.n
    max_new = resolved_max_new_tokens(cfg)
    return StepFigures(
        sync_dtype=dtype,
        sync_bytes_per_engine=per_engine,
        engines=engines,
        sync_seconds=per_engine / (gbps * 1e9),
        sync_seconds_serial=per_engine * engines / (gbps * 1e9),
        gbps=gbps,
        tokens_max=rows * max_new,
        tokens_mean=rows * max_new // 2,
    )
