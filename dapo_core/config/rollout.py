"""The ``rollout`` section: sampling for training and validation, the engines, and the rollout schedule.

``mode: one_step_off`` overlaps generation with training (``dapo_core.training.overlap``): the first generation
batch of step t+1 is submitted before step t's update and generated with the weights of version t-1 while the
trainer updates, so when step t+1 trains on it, it is one version stale (``max_staleness`` bounds how far ahead
generation may run). The ratio's pi_old is then the behaviour policy's log-probs, as the sampler returned them;
with ``algorithm.rollout_correction.enable`` pi_old is the trainer's recomputation (the proximal policy) and the
truncated importance weight pi_old / pi_behaviour corrects for the lag (decoupled PPO).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from dapo_core.config.section import _Section

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig


class RolloutConfig(_Section):
    backend: Literal["hf", "vllm"] = Field(
        default="vllm", description="Generation engine: hf (transformers, CPU) or vllm (GPU). verl DAPO: vllm."
    )
    n: int = Field(default=16, gt=0, description="G, responses sampled per prompt (Eq. 8). Paper: 16.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature for training. Paper: 1.0.")
    top_p: float = Field(default=1.0, description="Nucleus top-p for training, in (0, 1]. Paper: 1.0.")
    top_k: int = Field(default=-1, description="Top-k for training; -1 = off. verl DAPO: -1.")
    max_new_tokens: int | None = Field(
        default=None, gt=0, description="Generation cap; null -> data.max_response_length (L_max)."
    )
    micro_batch_size: int = Field(
        default=32,
        gt=0,
        description="Rows (prompt x sample) per generate call on the hf backend; larger is faster on CPU "
        "until memory binds (vLLM batches itself).",
    )
    hf_decode: Literal["generate", "static"] = Field(
        default="generate",
        description="How the hf backend decodes: generate (transformers' model.generate, any architecture) or "
        "static (a lean loop with a preallocated KV cache over the same module's weights, Qwen2/Llama only; "
        "same seeded tokens and log-probs, several times the tokens/s of generate on small CPU models).",
    )
    hf_procs: int = Field(
        default=1,
        gt=0,
        description="CPU processes that decode each hf micro-batch together, each on its share of the rows with "
        "torch threads / hf_procs (the same seeded tokens; weights copied to shared memory per call). 2 on 2 cores: "
        "see benchmarks/results/rollout.md. Scripts need an if __name__ == '__main__' guard (spawn).",
    )
    val_n: int = Field(default=32, gt=0, description="k samples per validation prompt for avg@k. Paper: 32.")
    val_temperature: float = Field(default=1.0, gt=0, description="Validation temperature. Paper: 1.0.")
    val_top_p: float = Field(default=0.7, description="Validation top-p, in (0, 1]. Paper/verl: 0.7.")
    val_top_k: int = Field(default=-1, description="Validation top-k; -1 = off. verl: -1.")
    tensor_parallel_size: int = Field(default=4, gt=0, description="vLLM tensor parallel size. verl 32B: 4.")
    gpu_memory_utilization: float = Field(default=0.8, description="vLLM share of GPU memory, in (0, 1]. verl: 0.8.")
    enable_chunked_prefill: bool = Field(default=True, description="vLLM chunked prefill. verl: true.")
    max_num_batched_tokens: int = Field(
        default=22528, gt=0, description="vLLM tokens per scheduler step. verl: prompt + response = 22528."
    )
    free_cache_engine: bool = Field(
        default=True, description="Sleep/wake vLLM (free its KV cache) around updates when colocated. verl: true."
    )
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs in vLLM. verl DAPO: false.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="vLLM engine dtype (auto = the checkpoint's). The hf backend uses the policy's own dtype. "
        "verl: bfloat16.",
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="vLLM context length; null -> data.max_prompt_length + max_new_tokens (the longest sequence).",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM prefix caching: the G samples of a prompt share its KV blocks. verl: true."
    )
    weight_sync_bucket_mb: int = Field(
        default=512,
        gt=0,
        description="Weight sync to vLLM ships the state dict in buckets of at most this many MiB (bounds the "
        "extra host/GPU memory of one sync).",
    )
    weight_sync: Literal["bytes", "cuda_ipc", "nccl"] = Field(
        default="bytes",
        description="How trainer weights reach a vLLM engine. bytes (default, tested on vLLM's CPU build): buckets "
        "of raw bytes in rollout.dtype through Ray's object store and vLLM's RPC. cuda_ipc (colocated) / nccl "
        "(separate GPUs or nodes): vLLM 0.32's weight-transfer engines, GPU only and not yet verified on a GPU "
        "by this project (docs/gpu.md).",
    )
    mode: Literal["sync", "one_step_off"] = Field(
        default="sync",
        description="sync: every generation batch uses the weights the step trains (Algorithm 1, on-policy). "
        "one_step_off: the first generation batch of step t+1 is generated while step t updates, with the weights "
        "one version behind (verl / TRL one-step-off-policy), and pi_old in the ratio is the sampler's log-probs "
        "(the behaviour policy). Overlaps only with resources.executor=ray; in-process it runs the same schedule "
        "without the speed-up.",
    )
    max_staleness: int = Field(
        default=1,
        ge=1,
        description="one_step_off: how many weight versions a generation batch may lag the trainer when it is "
        "trained on: the first batches of the next max_staleness steps are generated ahead. 1 = one step off.",
    )


def rollout_problems(cfg: DapoConfig) -> list[str]:
    """Sampling ranges and the rollout schedule, one "location (value) rule: fix" line per problem."""
    out = []
    ro = cfg.rollout
    for key, value, advice in (("top_p", ro.top_p, "1.0 (paper)"), ("val_top_p", ro.val_top_p, "0.7 (paper)")):
        if not 0 < value <= 1:
            out.append(f"rollout.{key} ({value}) must be in (0, 1]: it is a probability mass; use {advice}")
    for key, value in (("top_k", ro.top_k), ("val_top_k", ro.val_top_k)):
        if value == 0 or value < -1:
            out.append(f"rollout.{key} ({value}) must be -1 (off) or >= 1: use -1 as the paper")
    if not 0 < ro.gpu_memory_utilization <= 1:
        out.append(
            f"rollout.gpu_memory_utilization ({ro.gpu_memory_utilization}) must be in (0, 1]: "
            f"it is a fraction of GPU memory; use 0.8 (verl)"
        )
    if cfg.algorithm.dynamic_sampling.enable and ro.n < 2:
        out.append(
            f"rollout.n ({ro.n}) must be >= 2 when algorithm.dynamic_sampling.enable is on: a group of one "
            f"never varies, so every group would be filtered out; use n >= 2 (paper: 16) or disable it"
        )
    raw_log_probs = ro.backend == "vllm" and ro.temperature != 1.0  # vLLM's are before temperature
    if ro.mode == "one_step_off" and raw_log_probs and not cfg.algorithm.rollout_correction.enable:
        out.append(
            f"rollout.mode (one_step_off) uses the sampler's log-probs as pi_old, but vLLM returns raw log-probs "
            f"(before temperature) and rollout.temperature is {ro.temperature}: set rollout.temperature=1.0, or "
            "algorithm.rollout_correction.enable=true (pi_old recomputed by the trainer at the temperature)"
        )
    if cfg.algorithm.old_log_probs == "rollout":
        if cfg.algorithm.rollout_correction.enable:
            out.append(
                "algorithm.old_log_probs (rollout) skips the trainer's recomputation that "
                "algorithm.rollout_correction compares the sampler with: set algorithm.old_log_probs=recompute, or "
                "algorithm.rollout_correction.enable=false"
            )
        elif raw_log_probs:
            out.append(
                f"algorithm.old_log_probs (rollout) uses the sampler's log-probs as pi_old, but vLLM returns raw "
                f"log-probs (before temperature) and rollout.temperature is {ro.temperature}: set "
                "rollout.temperature=1.0, or algorithm.old_log_probs=recompute"
            )
    if ro.mode == "sync" and ro.max_staleness != 1:
        out.append(
            f"rollout.max_staleness ({ro.max_staleness}) only applies to rollout.mode=one_step_off (sync is never "
            "stale): set rollout.mode=one_step_off or leave max_staleness at 1"
        )
    return out
