"""Rollout throughput: ``HFRolloutBackend`` vs a bare ``model.generate`` loop, same tiny model and prompts.

    python -m benchmarks.bench_rollout            # writes benchmarks/results/rollout.json, prints a table
    python -m benchmarks.bench_rollout --repeats 5 --threads 2

Both sides sample at temperature 1.0 with no top-k/top-p, ``max_new_tokens`` new tokens, micro-batches of the same
number of rows, on the default tiny Qwen2 (~1M parameters, random init: lengths vary because EOS is sampled
now and then). Throughput counts response tokens up to and including EOS, per second of wall time (best of
``--repeats`` rounds after one warm-up). Every round times each row once, alternating the order, and a ratio is
the median over rounds of the ratio within a round (the machine's speed drifts by ~30% between minutes, so ratios of
best-ofs measured minutes apart mislead). The backend's extras — per-row seeded Gumbel sampling, length bucketing, result
objects and (one column) raw log-probs — are what the ratio measures; the goal is >= 0.9x the bare loop.

Where vLLM is installed (``.venv-vllm/bin/python -m benchmarks.bench_rollout``: vLLM 0.32's CPU build) the same
cases also run on the ``vllm`` backend (float32, eager, log-probs on, the same tiny model from a directory), with
the engine's load time and the time of one weight sync (the whole state dict through ``update_weights``).

``static`` columns: the same backend with ``rollout.hf_decode: static`` (a preallocated KV cache and a lean decode
loop, ``dapo_core.engines.rollout.static_decode``), log-probs on as training uses them, against the generate path
with log-probs; the parity of their tokens is checked on every case. The arithmetic bound is this machine's dense
matmul rate (1024^3 float32 GEMM at the same thread count) divided by the FLOPs of one decoded token (2 x the
weights it multiplies, lm_head included, + attention over the mean context): no decode can beat it. The third case
is the default recipe's generation batch (48 prompts x 8 samples = 384 rows, up to 80 new tokens).

``procs`` columns: the static loop again with ``rollout.hf_procs`` = the torch thread count (each process decodes
its share of the rows with one thread; ``dapo_core.engines.rollout.decode_procs``), timed in the same rounds, against
the static loop in one process and against generate; its tokens are checked against generate's too.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from benchmarks.common import matmul_gflops
from benchmarks.rollout_default import add_default_columns, default_lines, default_setting, span
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


def _interleaved(fns: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[tuple[float, int]]]:
    """(tokens/s, tokens) of each function in each of ``repeats`` rounds; every round runs each function once, in
    alternating order, so a ratio taken within a round compares runs seconds apart (the machine's speed drifts)."""
    for fn in fns.values():
        fn()  # warm-up
    rounds: dict[str, list[tuple[float, int]]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            tokens = fns[name]()
            rounds[name].append((tokens / (time.perf_counter() - t0), tokens))
    return rounds


def _median_ratio(rounds: dict[str, list[tuple[float, int]]], num: str, den: str) -> float:
    return statistics.median(a[0] / b[0] for a, b in zip(rounds[num], rounds[den], strict=True))


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
                sampling = SamplingConfig(
                    n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, seed=0, return_log_probs=True
                )
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


def decode_flops_per_token(model: torch.nn.Module, context: float) -> float:
    """FLOPs of one decoded token: 2 x every weight it multiplies (the input embedding is a lookup, the tied
    lm_head a matmul) + QK^T and PV over ``context`` positions in every layer."""
    cfg = model.config
    embed = model.get_input_embeddings().weight  # type: ignore[operator]
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    params = sum(p.numel() for p in model.parameters())
    matmul_weights = params - embed.numel() + (head.numel() if head.data_ptr() == embed.data_ptr() else 0)
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    return 2.0 * matmul_weights + attention * context


def run(repeats: int, rows: int) -> dict:
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tokenizer, seed=0)
    gflops = matmul_gflops()
    cases = [
        ("256 prompts x 1", 256, 1, 32, rows),
        ("32 prompts x 8", 32, 8, 32, rows),
        ("48 prompts x 8, 80 tokens (default rollout batch)", 48, 8, 80, 384),
    ]
    out = [_case(name, count, n, new, case_rows, model, tokenizer, make_prompts(tokenizer, count), repeats, gflops)
           for name, count, n, new, case_rows in cases]  # fmt: skip
    real = _warm_started_batch()
    if real is not None:  # the default rollout batch as training sees it: the base model on curated prompts
        base, base_tok, prompts = real
        name = "48 curated prompts x 8, 80 tokens, warm-started base model"
        out.append(_case(name, 48, 8, 80, 384, base, base_tok, prompts, repeats, gflops))
    return {
        "vllm_cpu": vllm_results(model, tokenizer, [c[:4] for c in cases[:2]], repeats),
        "benchmark": "rollout",
        "model": "tiny qwen2 (hidden 128, 4 layers, 4/2 heads, intermediate 512, tied), random init"
        + ("; last case: outputs/base_model" if real is not None else ""),
        "params": sum(p.numel() for p in model.parameters()),
        "matmul_gflops": round(gflops, 1),
        "rows_per_micro_batch": rows,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "results": out,
    }


def _warm_started_batch() -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase, list[list[int]]] | None:
    """The base model and 48 curated training prompts (None before ``make run`` / ``dapo base-model``)."""
    base, train = Path("outputs/base_model"), Path("outputs/curated/train.parquet")
    if not (base / "config.json").is_file() or not train.is_file():
        return None
    from dapo_core.data.schema import read_rl_files
    from dapo_core.engines.tokenizer import load_tokenizer
    from dapo_core.training.prompts import encode_prompts

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = load_tokenizer(str(base))
    items = encode_prompts(read_rl_files([train])[:48], tokenizer, max_prompt_length=32)
    return model, tokenizer, [list(i.prompt_ids) for i in items]


def _case(
    name: str, count: int, n: int, new: int, case_rows: int, model: torch.nn.Module,
    tokenizer: transformers.PreTrainedTokenizerBase, prompts: list[list[int]], repeats: int, gflops: float,
) -> dict:  # fmt: skip
    """Bare generate, the backend on generate (without / with log-probs) and on the static loop, one case."""
    backend = HFRolloutBackend(model, tokenizer, micro_batch_size=case_rows)
    static = HFRolloutBackend(model, tokenizer, micro_batch_size=case_rows, decode="static")
    procs = torch.get_num_threads()
    multi = HFRolloutBackend(model, tokenizer, micro_batch_size=case_rows, decode="static", procs=procs)

    def hf(log_probs: bool, engine=backend, prompts=prompts, n=n, new=new) -> int:
        sampling = SamplingConfig(
            n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, seed=0, return_log_probs=log_probs
        )
        return sum(r.response_length for r in engine.generate(prompts, sampling))

    rounds = _interleaved(
        {
            "bare": lambda: bare_generate(model, tokenizer, prompts, n, new, case_rows),
            "hf": lambda: hf(False),
            "hf_lp": lambda: hf(True),
            "static": lambda: hf(True, static),
            **({"procs": lambda: hf(True, multi)} if procs > 1 else {}),
        },
        repeats,
    )
    (bare, bare_tokens), (ours, ours_tokens) = max(rounds["bare"]), max(rounds["hf"])
    ours_lp, (fast_lp, fast_tokens) = max(rounds["hf_lp"])[0], max(rounds["static"])
    sampling = SamplingConfig(
        n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, seed=0, return_log_probs=True
    )
    reference = [r.response_ids for r in backend.generate(prompts, sampling)]
    same = reference == [r.response_ids for r in static.generate(prompts, sampling)]
    procs_same = procs > 1 and reference == [r.response_ids for r in multi.generate(prompts, sampling)]
    multi.shutdown()
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    bound = gflops * 1e9 / decode_flops_per_token(model, mean_prompt + fast_tokens / (2 * count * n))
    return {
        "case": name,
        "prompts": count,
        "n": n,
        "max_new_tokens": new,
        "rows_per_call": case_rows,
        "bare_tokens_per_s": round(bare, 1),
        "hf_tokens_per_s": round(ours, 1),
        "hf_logprobs_tokens_per_s": round(ours_lp, 1),
        "static_logprobs_tokens_per_s": round(fast_lp, 1),
        "ratio": round(_median_ratio(rounds, "hf", "bare"), 3),
        "ratio_logprobs": round(_median_ratio(rounds, "hf_lp", "bare"), 3),
        "static_vs_generate": round(_median_ratio(rounds, "static", "hf_lp"), 3),
        "static_vs_generate_rounds": sorted(
            round(a[0] / b[0], 3) for a, b in zip(rounds["static"], rounds["hf_lp"], strict=True)
        ),
        "static_same_tokens": same,
        "arithmetic_bound_tokens_per_s": round(bound, 1),
        "static_of_bound": round(fast_lp / bound, 3),
        "bare_tokens": bare_tokens,
        "hf_tokens": ours_tokens,
        **(_procs_columns(rounds, procs, procs_same, bound) if procs > 1 else {}),
    }


def _procs_columns(rounds: dict[str, list[tuple[float, int]]], procs: int, same: bool, bound: float) -> dict:
    """The ``rollout.hf_procs`` row's figures: best tok/s and median per-round ratios to static and generate."""
    best = max(rounds["procs"])[0]
    return {
        "procs": procs,
        "procs_tokens_per_s": round(best, 1),
        "procs_vs_static": round(_median_ratio(rounds, "procs", "static"), 3),
        "procs_vs_static_rounds": sorted(
            round(a[0] / b[0], 3) for a, b in zip(rounds["procs"], rounds["static"], strict=True)
        ),
        "procs_vs_generate": round(_median_ratio(rounds, "procs", "hf_lp"), 3),
        "procs_vs_generate_rounds": sorted(
            round(a[0] / b[0], 3) for a, b in zip(rounds["procs"], rounds["hf_lp"], strict=True)
        ),
        "procs_same_tokens": same,
        "procs_of_bound": round(best / bound, 3),
    }


def markdown(report: dict) -> str:
    lines = default_lines(report) if "default_setting" in report else []
    lines += [
        "| case | bare generate tok/s | HFRolloutBackend tok/s | ratio | with log-probs tok/s | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['case']} | {r['bare_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | {r['ratio']:.2f}x "
            f"| {r['hf_logprobs_tokens_per_s']:.0f} | {r['ratio_logprobs']:.2f}x |"
        )
    lines += [
        "",
        f"`rollout.hf_decode: static` (log-probs on) vs generate (log-probs on); arithmetic bound at "
        f"{report['matmul_gflops']} GFLOP/s:",
        "",
        "| case | generate tok/s | static tok/s | speed-up (rounds) | same tokens | bound tok/s | static / bound |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['case']} | {r['hf_logprobs_tokens_per_s']:.0f} | {r['static_logprobs_tokens_per_s']:.0f} "
            f"| {r['static_vs_generate']:.2f}x ({span(r.get('static_vs_generate_rounds'))}) "
            f"| {'yes' if r['static_same_tokens'] else 'NO'} "
            f"| {r['arithmetic_bound_tokens_per_s']:.0f} | {r['static_of_bound']:.0%} |"
        )
    multi = [r for r in report["results"] if "procs" in r]
    if multi:
        lines += [
            "",
            f"`rollout.hf_procs: {multi[0]['procs']}` (the static loop in {multi[0]['procs']} processes, one torch "
            "thread each) vs the static loop in one process and vs generate (log-probs on):",
            "",
            "| case | static tok/s | procs tok/s | vs static (rounds) | vs generate (rounds) | same tokens "
            "| procs / bound |",
            "|---|---:|---:|---:|---:|---|---:|",
        ]
        for r in multi:
            lines.append(
                f"| {r['case']} | {r['static_logprobs_tokens_per_s']:.0f} | {r['procs_tokens_per_s']:.0f} "
                f"| {r['procs_vs_static']:.2f}x ({span(r['procs_vs_static_rounds'])}) "
                f"| {r['procs_vs_generate']:.2f}x ({span(r['procs_vs_generate_rounds'])}) "
                f"| {'yes' if r['procs_same_tokens'] else 'NO'} | {r['procs_of_bound']:.0%} |"
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
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each times every row once (tok/s: best)")
    parser.add_argument("--rows", type=int, default=64, help="rows (prompt x sample) per generate call")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON report")
    parser.add_argument(
        "--rerender", action="store_true", help="re-derive the default-setting columns and the markdown from --out"
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.rerender:  # no timing: the committed measurements, with the columns derived from them
        report = add_default_columns(json.loads(args.out.read_text()), default_setting())
    else:
        report = add_default_columns(run(args.repeats, args.rows), default_setting())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    note = (
        f"Rollout throughput, tokens/s (best of {report['repeats']} rounds; ratios: median of the per-round ratios; torch threads {report['threads']}; "
        f"{report['machine']}, torch {report['torch']}, transformers {report['transformers']}). Written by "
        "`python -m benchmarks.bench_rollout` (from `.venv-vllm` for the vLLM rows).\n\n"
    )
    args.out.with_suffix(".md").write_text(note + markdown(report) + "\n")
    print(markdown(report))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
