"""vLLM rollout throughput and weight-sync time through ``VllmRollout`` (GPU only).

    python -m benchmarks.bench_vllm                                   # a small Qwen2 built here (no download)
    python -m benchmarks.bench_vllm --model /path/to/Qwen2.5-Math-1.5B --prompts 256 --n 16 --max-new-tokens 1024
    python -m benchmarks.bench_vllm --tp 2 --gpu-memory-utilization 0.6 --bucket-mb 256

Measures, on one engine: generation tokens/s (response tokens up to and including EOS, per second of wall time,
best of ``--repeats`` after one warm-up), the time of a full weight sync of the model's own weights (HF names,
``--bucket-mb`` buckets, cast to the engine dtype), level-1 sleep and wake-up times, and GPU memory in use awake
and asleep (device-wide ``cudaMemGetInfo``). Writes benchmarks/results/vllm.json and vllm.md. Elsewhere (no CUDA
GPU or no vllm package) it exits with a message and measures nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_results

GIB = 1 << 30


def small_model_dir(root: Path) -> str:
    """A randomly initialised Qwen2 (hidden 512, 4 layers, head_dim 64) with the char tokenizer."""
    from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(
        tok,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        max_position_embeddings=4096,
        seed=0,
    )
    return str(save_hf_dir(model, tok, root / "small-qwen2"))


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Arithmetic questions through the chat template (as bench_rollout), as token ids."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        expr = str(rng.randint(1, 99)) + "".join(rng.choice("+-*") + str(rng.randint(1, 99)) for _ in range(3))
        messages = [{"role": "user", "content": f"Q: {expr}"}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (ValueError, AttributeError):  # no chat template: the plain question
            text = f"Q: {expr}\n"
        prompts.append(tokenizer.encode(text))
    return prompts


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def run(args: argparse.Namespace) -> dict:
    from dapo_core.config import load_config
    from dapo_core.engines.models import load_model
    from dapo_core.engines.rollout import SamplingConfig, get_rollout_backend_cls
    from dapo_core.engines.tokenizer import load_tokenizer

    path = args.model or small_model_dir(Path(tempfile.mkdtemp(prefix="bench-vllm-")))
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=[
            f"model.path={path}",
            "rollout.backend=vllm",
            f"resources.n_gpus_per_node={torch.cuda.device_count()}",
            f"rollout.tensor_parallel_size={args.tp}",
            f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"rollout.weight_sync_bucket_mb={args.bucket_mb}",
            f"rollout.max_num_batched_tokens={max(8192, args.max_prompt_length + args.max_new_tokens)}",
            f"rollout.dtype={args.dtype}",
            f"data.max_prompt_length={args.max_prompt_length}",
            f"data.max_response_length={args.max_new_tokens}",
        ],
        env={},
    )
    tokenizer = load_tokenizer(path)
    t0 = time.perf_counter()
    backend = get_rollout_backend_cls("vllm").from_config(cfg, model=None, tokenizer=tokenizer, model_path=path)
    startup = time.perf_counter() - t0
    try:
        prompts = make_prompts(tokenizer, args.prompts)
        sampling = SamplingConfig(
            n=args.n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens, seed=0
        )
        backend.generate(prompts[: max(1, len(prompts) // 8)], sampling)  # warm-up
        best, tokens = 0.0, 0
        for k in range(args.repeats):
            t0 = time.perf_counter()
            results = backend.generate(prompts, dataclasses.replace(sampling, seed=k))
            tokens = sum(r.response_length for r in results)
            best = max(best, tokens / (time.perf_counter() - t0))

        policy = load_model(path, dtype="bfloat16" if args.dtype == "auto" else args.dtype)  # CPU copy
        state = policy.state_dict()
        sync_times = []
        for k in range(args.repeats):
            t0 = time.perf_counter()
            backend.update_weights(state, version=k + 1)
            sync_times.append(time.perf_counter() - t0)
        unique = {v.data_ptr(): v for v in state.values()}.values()  # tied lm_head = embeddings: not shipped
        sync_mib = sum(v.numel() * v.element_size() for v in unique) / (1 << 20)

        awake = used_gib()
        t0 = time.perf_counter()
        backend.sleep()
        sleep_s = time.perf_counter() - t0
        asleep = used_gib()
        t0 = time.perf_counter()
        backend.update_weights(state, version=args.repeats + 1)  # wakes the weights only
        sync_asleep_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend.wake_up()
        wake_s = time.perf_counter() - t0
    finally:
        backend.shutdown()
    return {
        "model": args.model or "small qwen2 (hidden 512, 4 layers, 8/2 heads, char vocab), random init",
        "params": sum(p.numel() for p in policy.parameters()),
        "engine_dtype": args.dtype,
        "tensor_parallel_size": args.tp,
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "engine_startup_s": round(startup, 2),
        "gen_tokens_per_s": round(best, 1),
        "gen_tokens": tokens,
        "sync_s": round(min(sync_times), 4),
        "sync_mib": round(sync_mib, 1),
        "sync_mib_per_s": round(sync_mib / min(sync_times), 1),
        "bucket_mb": args.bucket_mb,
        "sync_while_asleep_s": round(sync_asleep_s, 4),
        "sleep_s": round(sleep_s, 3),
        "wake_up_s": round(wake_s, 3),
        "gpu_used_gib_awake": round(awake, 2),
        "gpu_used_gib_asleep": round(asleep, 2),
    }


def markdown(r: dict) -> str:
    return "\n".join(
        [
            "| model | rows | gen tok/s | sync (MiB) | sync s | MiB/s | sleep s | wake s | GiB awake | GiB asleep |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {r['model']} | {r['prompts']}x{r['n']} | {r['gen_tokens_per_s']:.0f} | {r['sync_mib']:.0f} "
            f"| {r['sync_s']:.3f} | {r['sync_mib_per_s']:.0f} | {r['sleep_s']:.2f} | {r['wake_up_s']:.2f} "
            f"| {r['gpu_used_gib_awake']:.1f} | {r['gpu_used_gib_asleep']:.1f} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local HF directory (default: build a small Qwen2 here)")
    parser.add_argument("--prompts", type=int, default=128, help="prompts per generate call")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (the paper's G)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="response cap")
    parser.add_argument("--max-prompt-length", type=int, default=256, help="prompt cap (sets max_model_len)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM share of GPU memory")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        # a skip, not a failure: `make bench` runs every benchmark on CPU machines too
        print(
            "bench_vllm skipped: it needs a CUDA GPU and the vllm package (pip install .[gpu]); "
            f"here: cuda={torch.cuda.is_available()}, vllm={importlib.util.find_spec('vllm') is not None}. "
            "Nothing measured.",
            file=sys.stderr,
        )
        return
    report = run(args)
    write_results("vllm", report, markdown(report))


if __name__ == "__main__":
    main()
