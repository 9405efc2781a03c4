"""Rollout throughput: ``HFRolloutBackend`` vs a bare ``model.generate`` loop, same tiny model and prompts.

    python -m benchmarks.bench_rollout            # writes benchmarks/results/rollout.json, prints a table
    python -m benchmarks.bench_rollout --repeats 5 --threads 2

Both sides sample at temperature 1.0 with no top-k/top-p, ``max_new_tokens`` new tokens, micro-batches of the same
number of rows, on the default tiny Qwen2 (~1M parameters, random init: lengths vary because EOS is sampled
now and then). Throughput counts response tokens up to and including EOS, per second of wall time (best of
``--repeats`` after one warm-up). The backend's extras — per-row seeded Gumbel sampling, length bucketing, result
objects and (one column) raw log-probs — are what the ratio measures; the goal is >= 0.9x the bare loop.

Where vLLM is installed (``.venv-vllm/bin/python -m benchmarks.bench_rollout``: vLLM 0.32's CPU build) the same
cases also run on the ``vllm`` backend (float32, eager, log-probs on, the same tiny model from a directory), with
the engine's load time and the time of one weight sync (the whole state dict through ``update_weights``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.rollout import HFRolloutBackend, SamplingConfig
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

RESULTS = Path(__file__).parent / "results" / "rollout.json"


def make_prompts(tokenizer: transformers.PreTrainedTokenizerBase, count: int, seed: int = 0) -> list[list[int]]:
    """Arithmetic questions rendered through the chat template, e.g. ``"Q: 71-57*6<|im_end|><|im_start|>"``."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ops = rng.randint(1, 4)
        expr = str(rng.randint(1, 99)) + "".join(rng.choice("+-*") + str(rng.randint(1, 99)) for _ in range(ops))
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Q: {expr}"}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(text))
    return prompts


def _count_tokens(responses: torch.Tensor, eos_id: int) -> int:
    """Response tokens up to and including the first EOS (the rest is padding). responses (b, t)."""
    is_eos = responses == eos_id
    has_eos = is_eos.any(dim=1)
    lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, responses.shape[1])
    return int(lengths.sum())


def bare_generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int, rows: int) -> int:
    """The reference: tokenizer left-padding + ``generate(do_sample=True, num_return_sequences=n)``."""
    tokens = 0
    per_call = max(1, rows // n)
    with torch.inference_mode():
        for start in range(0, len(prompts), per_call):
            batch = tokenizer.pad({"input_ids": prompts[start : start + per_call]}, return_tensors="pt")
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )  # (b*n, L + t)
            tokens += _count_tokens(out[:, batch["input_ids"].shape[1] :], tokenizer.eos_token_id)
    return tokens


def _best_rate(fn: Callable[[], int], repeats: int) -> tuple[float, int]:
    fn()  # warm-up
    best = 0.0
    tokens = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        best = max(best, tokens / (time.perf_counter() - t0))
    return best, tokens


def vllm_results(model, tokenizer, cases: list[tuple[str, int, int, int]], repeats: int) -> dict | None:
    """The cases on the ``vllm`` backend (None without vLLM): tokens/s, engine load time, one weight sync."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("vllm") is None:
        return None
    from dapo_core.engines.models import save_hf_dir
    from dapo_core.engines.rollout.vllm import VllmRollout

    with tempfile.TemporaryDirectory() as tmp:
        path = str(save_hf_dir(model, tokenizer, f"{tmp}/model"))
        kwargs = {
            "model": path, "tokenizer": path, "dtype": "float32", "enforce_eager": True, "max_model_len": 96,
            "gpu_memory_utilization": 0.2, "seed": 0, "logprobs_mode": "raw_logprobs",
            "max_num_batched_tokens": 2048, "enable_chunked_prefill": False,
            "worker_extension_cls": "dapo_core.engines.rollout.vllm_worker.WeightSyncWorkerExtension",
        }  # fmt: skip
        t0 = time.perf_counter()
        engine = VllmRollout(
            kwargs, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id], free_cache_engine=False
        )
        load_s = time.perf_counter() - t0
        try:
            out = []
            for name, count, n, new in cases:
                prompts = make_prompts(tokenizer, count)
                sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new, seed=0, return_log_probs=True)
                rate, tokens = _best_rate(
                    lambda p=prompts, s=sampling: sum(r.response_length for r in engine.generate(p, s)), repeats
                )
                out.append({"case": name, "vllm_tokens_per_s": round(rate, 1), "vllm_tokens": tokens})
            syncs = []
            for version in range(1, repeats + 2):
                t0 = time.perf_counter()
                engine.update_weights(model.state_dict(), version=version)
                syncs.append(time.perf_counter() - t0)
        finally:
            engine.shutdown()
    import vllm

    return {"vllm": vllm.__version__, "load_s": round(load_s, 1), "weight_sync_s": round(min(syncs), 3), "results": out}


def run(repeats: int, rows: int) -> dict:
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tokenizer, seed=0)
    backend = HFRolloutBackend(model, tokenizer, micro_batch_size=rows)
    cases = [("256 prompts x 1", 256, 1, 32), ("32 prompts x 8", 32, 8, 32)]
    out = []
    for name, count, n, new in cases:
        prompts = make_prompts(tokenizer, count)

        def hf(log_probs: bool, prompts=prompts, n=n, new=new) -> int:
            sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new, seed=0, return_log_probs=log_probs)
            return sum(r.response_length for r in backend.generate(prompts, sampling))

        bare, bare_tokens = _best_rate(
            lambda prompts=prompts, n=n, new=new: bare_generate(model, tokenizer, prompts, n, new, rows), repeats
        )
        ours, ours_tokens = _best_rate(lambda: hf(False), repeats)
        ours_lp, _ = _best_rate(lambda: hf(True), repeats)
        out.append(
            {
                "case": name,
                "prompts": count,
                "n": n,
                "max_new_tokens": new,
                "bare_tokens_per_s": round(bare, 1),
                "hf_tokens_per_s": round(ours, 1),
                "hf_logprobs_tokens_per_s": round(ours_lp, 1),
                "ratio": round(ours / bare, 3),
                "ratio_logprobs": round(ours_lp / bare, 3),
                "bare_tokens": bare_tokens,
                "hf_tokens": ours_tokens,
            }
        )
    return {
        "vllm_cpu": vllm_results(model, tokenizer, cases, repeats),
        "benchmark": "rollout",
        "model": "tiny qwen2 (hidden 128, 4 layers, 4/2 heads, intermediate 512, tied), random init",
        "params": sum(p.numel() for p in model.parameters()),
        "rows_per_micro_batch": rows,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "results": out,
    }


def markdown(report: dict) -> str:
    lines = [
        "| case | bare generate tok/s | HFRolloutBackend tok/s | ratio | with log-probs tok/s | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['case']} | {r['bare_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | {r['ratio']:.2f}x "
            f"| {r['hf_logprobs_tokens_per_s']:.0f} | {r['ratio_logprobs']:.2f}x |"
        )
    v = report.get("vllm_cpu")
    if v:
        bare = {r["case"]: r["bare_tokens_per_s"] for r in report["results"]}
        lines += [
            "",
            f"vLLM {v['vllm']} (CPU build): engine load {v['load_s']} s, weight sync {v['weight_sync_s']} s",
            "",
        ]
        lines += ["| case | vllm tok/s (log-probs on) | vs bare generate |", "|---|---:|---:|"]
        for r in v["results"]:
            lines.append(
                f"| {r['case']} | {r['vllm_tokens_per_s']:.0f} | {r['vllm_tokens_per_s'] / bare[r['case']]:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    parser.add_argument("--rows", type=int, default=64, help="rows (prompt x sample) per generate call")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON report")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = run(args.repeats, args.rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    note = (
        f"Rollout throughput, tokens/s (best of {report['repeats']}; torch threads {report['threads']}; "
        f"{report['machine']}, torch {report['torch']}, transformers {report['transformers']}). Written by "
        "`python -m benchmarks.bench_rollout` (from `.venv-vllm` for the vLLM rows).\n\n"
    )
    args.out.with_suffix(".md").write_text(note + markdown(report) + "\n")
    print(markdown(report))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
