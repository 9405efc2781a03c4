"""A projection of one rollout step of the 32B DAPO recipe on GPUs: arithmetic from the recipe's tokens per step
and stated hardware assumptions, never a measurement (no GPU run of that recipe has been recorded).

Generation is bounded per engine by compute (2N FLOPs per token plus attention) and by memory traffic (the
weights and the KV cache read once per decode step), with as many sequences in flight as the KV cache holds;
training counts 10N FLOPs per token (forward + backward 6N, recomputed activations 2N, the pi_old pass 2N) plus
attention, at an assumed MFU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Assumptions:
    """Qwen2.5-32B (Qwen's model card) on the recipe's 128 GPUs; the H20 figures are NVIDIA's (bf16 dense)."""

    params: float = 32.5e9
    layers: int = 64
    q_heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    gpus: int = 128
    gpu: str = "H20 96 GB"
    peak_tflops: float = 148.0
    hbm_tb_s: float = 4.0
    tensor_parallel: int = 4
    kv_cache_gb_per_gpu: float = 55.0  # 0.8 x 96 GB less the 16.4 GB of weights at TP 4
    mean_prompt_tokens: int = 200
    mean_response_tokens: int = 4096  # grows during DAPO training: later steps cost more
    gen_prompts: int = 1536  # gen_batch_size (dynamic sampling over-samples 3x)
    train_prompts: int = 512  # train_batch_size
    n: int = 16
    gen_batches_per_step: float = 1.5  # dynamic sampling: 1.3-2 generation batches per step
    mfu_decode: float = 0.5  # of peak, when compute-bound
    mfu_train: float = 0.4


def _attn_flops(a: Assumptions, ctx: float) -> float:
    """Forward attention FLOPs per token at context ``ctx``: QK^T and AV, 2 x 2 x heads x head_dim x ctx a layer."""
    return 4.0 * a.layers * a.q_heads * a.head_dim * ctx


def project(a: Assumptions | None = None) -> dict[str, Any]:
    a = a or Assumptions()
    prompt, resp = a.mean_prompt_tokens, a.mean_response_tokens
    engines = a.gpus // a.tensor_parallel
    # generation: one decode step of an engine advances every sequence in flight by one token
    kv_bytes_per_token = 2 * a.layers * a.kv_heads * a.head_dim * 2  # K and V, bf16
    mean_ctx = prompt + resp / 2
    in_flight = a.kv_cache_gb_per_gpu * 1e9 * a.tensor_parallel / (kv_bytes_per_token * (prompt + resp))
    step_compute = (
        in_flight
        * (2 * a.params + _attn_flops(a, mean_ctx))
        / (a.tensor_parallel * a.peak_tflops * 1e12 * a.mfu_decode)
    )
    step_memory = (2 * a.params + in_flight * mean_ctx * kv_bytes_per_token) / (a.tensor_parallel * a.hbm_tb_s * 1e12)
    engine_tok_s = in_flight / max(step_compute, step_memory)
    gen_tokens = a.gen_prompts * a.n * resp * a.gen_batches_per_step
    gen_s = gen_tokens / (engine_tok_s * engines)
    # training: the kept batch, every token through 10N plus attention (forward, backward 2x, recompute, pi_old: 5x)
    train_tokens = a.train_prompts * a.n * (prompt + resp)
    train_flops = train_tokens * (10 * a.params + 5 * _attn_flops(a, mean_ctx))
    train_s = train_flops / (a.gpus * a.peak_tflops * 1e12 * a.mfu_train)
    return {
        "label": "PROJECTION (arithmetic, not a measurement): one rollout step of dapo-qwen2.5-32b",
        "assumptions": asdict(a),
        "generated_tokens_per_step": gen_tokens,
        "trained_tokens_per_step": train_tokens,
        "sequences_in_flight_per_engine": round(in_flight),
        "decode_bound": "compute" if step_compute >= step_memory else "memory",
        "generation_tok_s_all_engines": round(engine_tok_s * engines),
        "generation_s": round(gen_s),
        "train_flops": train_flops,
        "train_s": round(train_s),
        "hours_per_step": round((gen_s + train_s) / 3600, 2),
    }


def markdown(p: dict[str, Any]) -> str:
    a = p["assumptions"]
    return "\n".join(
        [
            f"**{p['label']}** on {a['gpus']} x {a['gpu']} ({a['peak_tflops']:.0f} TFLOP/s bf16, "
            f"{a['hbm_tb_s']} TB/s), mean prompt {a['mean_prompt_tokens']} and response {a['mean_response_tokens']} "
            f"tokens, {a['gen_batches_per_step']} generation batches per step (benchmarks/projection.py):",
            "",
            "| | projected |",
            "|---|---:|",
            f"| generated tokens per step | {p['generated_tokens_per_step'] / 1e6:.0f}M |",
            f"| generation ({a['gpus'] // a['tensor_parallel']} engines of TP {a['tensor_parallel']}, "
            f"{p['sequences_in_flight_per_engine']} sequences in flight each, {p['decode_bound']}-bound at "
            f"MFU {a['mfu_decode']}) | {p['generation_tok_s_all_engines'] / 1e3:.0f}k tok/s, "
            f"{p['generation_s'] / 60:.0f} min |",
            f"| training ({p['trained_tokens_per_step'] / 1e6:.1f}M tokens, {p['train_flops']:.2e} FLOPs at MFU "
            f"{a['mfu_train']}) | {p['train_s'] / 60:.0f} min |",
            f"| one rollout step | {p['hours_per_step']:.2f} h |",
        ]
    )
