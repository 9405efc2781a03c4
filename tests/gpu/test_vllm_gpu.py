"""The ``vllm`` backend on a real engine (CUDA GPU + vllm only; skipped elsewhere).

    python -m pytest tests/gpu/test_vllm_gpu.py -q -s        # also writes benchmarks/results/vllm_gpu.json

A small Qwen2 (head_dim 64, the char tokenizer) is built from a config and saved to a tmp dir. The engine
generates; the trainer-side "new policy" (another random init) is synced in; vLLM's raw log-probs of its own
samples must then equal the new HF model's teacher-forced log-probs (bf16 tolerance) and be far from the old
model's. Sleep frees GPU memory; wake-up and update-while-asleep keep the weights right. Figures (tokens/s, sync
seconds, GPU memory) go to benchmarks/results/vllm_gpu.json.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")  # conftest skips `gpu` tests without CUDA; this skips them without vllm

from dapo_core.config import load_config  # noqa: E402
from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir  # noqa: E402
from dapo_core.engines.rollout import SamplingConfig, get_rollout_backend_cls  # noqa: E402
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.gpu

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "vllm_gpu.json"
GIB = 1 << 30
# bf16 engine vs fp32 reference on logits of spread ~4 nats: per-token error of a few hundredths
MEAN_TOL, MAX_TOL = 0.05, 0.35


def small_qwen2(tok, seed: int, *, lm_head_std: float = 0.25):
    """hidden 256 / 4 heads: head_dim 64, which every vLLM attention backend supports. Untied output layer scaled up
    so that distributions have a spread of a few nats: two random policies then differ by whole nats (tied
    embeddings of this size would only copy the input token)."""
    model = build_tiny_qwen2(
        tok,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        seed=seed,
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std, generator=torch.Generator().manual_seed(seed))
    return model.float().eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    path = save_hf_dir(small_qwen2(tok, seed=0), tok, tmp_path_factory.mktemp("vllm") / "base")
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=[
            f"model.path={path}",
            "rollout.backend=vllm",
            "resources.n_gpus_per_node=1",
            "rollout.tensor_parallel_size=1",
            "rollout.gpu_memory_utilization=0.3",
            "rollout.max_num_batched_tokens=2048",
            "rollout.weight_sync_bucket_mb=1",  # several buckets even for this small model
            "data.max_prompt_length=32",
            "data.max_response_length=64",
        ],
        env={},
    )
    tokenizer = load_tokenizer(str(path))
    backend = get_rollout_backend_cls("vllm").from_config(cfg, model=None, tokenizer=tokenizer, model_path=str(path))
    figures: dict = {}
    # `current`: the HF twin of what the engine holds (tests that sync update it)
    yield SimpleNamespace(tokenizer=tokenizer, backend=backend, figures=figures, tok=tok, current=small_qwen2(tok, 0))
    backend.shutdown()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "vllm_gpu",
                "vllm": getattr(vllm, "__version__", "?"),
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0),
                "python": platform.python_version(),
                "model": "qwen2 hidden 256, 2 layers, 4/2 heads (head_dim 64), char vocab, bf16 engine",
                **figures,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    texts = [f"Q: {i}+{2 * i + 1}\n" for i in range(count)]
    return [tokenizer.encode(t) for t in texts]


def teacher_forced(model, results) -> list[list[float]]:
    """log p(response token | prefix) under an HF model (fp32, CPU): the trainer's old_log_probs."""
    out = []
    with torch.no_grad():
        for r in results:
            ids = torch.tensor([r.prompt_ids + r.response_ids])  # (1, P + R)
            logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float()  # (R, V)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def gaps(results, reference) -> torch.Tensor:
    return torch.tensor(
        [abs(a - b) for r, ref in zip(results, reference, strict=True) for a, b in zip(r.log_probs, ref, strict=True)]
    )


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def test_generation_matches_the_hf_model_and_throughput(setup) -> None:
    tokenizer, backend, figures = setup.tokenizer, setup.backend, setup.figures
    old = setup.current  # the checkpoint the engine loaded (or the last synced policy)
    sampling = SamplingConfig(
        n=4, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=48, seed=1, return_log_probs=True
    )
    results = backend.generate(prompts_for(tokenizer, 8), sampling)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(8) for j in range(4)]
    for r in results:
        assert len(r.log_probs) == r.response_length >= 1
        assert r.truncated == (r.response_ids[-1] not in backend.eos_token_ids)
    diff = gaps(results, teacher_forced(old, results))
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL, f"raw log-probs differ from HF: {diff.mean():.3f}"

    # determinism across sharding (seeds per global prompt index)
    whole = backend.generate(prompts_for(tokenizer, 6), sampling)
    split = backend.generate(prompts_for(tokenizer, 6)[:2], sampling) + backend.generate(
        prompts_for(tokenizer, 6)[2:], sampling, prompt_index_offset=2
    )
    same = sum(a.response_ids == b.response_ids for a, b in zip(whole, split, strict=True)) / len(whole)
    figures["shard_equal_fraction"] = same
    assert same >= 0.9  # equal up to batch-dependent bf16 near-ties

    # throughput: 64 prompts x 8 samples
    big = SamplingConfig(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64, seed=2)
    backend.generate(prompts_for(tokenizer, 8), big)  # warm-up
    t0 = time.perf_counter()
    out = backend.generate(prompts_for(tokenizer, 64), big)
    seconds = time.perf_counter() - t0
    figures["gen_tokens_per_s"] = round(sum(r.response_length for r in out) / seconds, 1)
    figures["gen_rows"] = len(out)


def test_weight_sync_makes_the_engine_use_the_new_weights(setup) -> None:
    tokenizer, backend, figures = setup.tokenizer, setup.backend, setup.figures
    old, new = setup.current, small_qwen2(setup.tok, seed=1)
    sampling = SamplingConfig(
        n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=32, seed=3, return_log_probs=True
    )
    prompts = prompts_for(tokenizer, 8)

    t0 = time.perf_counter()
    backend.update_weights(new.state_dict(), version=backend.weight_version + 1)
    setup.current = new
    figures["sync_seconds"] = round(time.perf_counter() - t0, 4)
    figures["sync_mib"] = round(sum(v.numel() * 2 for v in new.state_dict().values()) / (1 << 20), 2)
    results = backend.generate(prompts, sampling)
    to_new = gaps(results, teacher_forced(new, results))
    to_old = gaps(results, teacher_forced(old, results))
    assert to_new.mean() < MEAN_TOL and to_new.max() < MAX_TOL, f"engine != new weights: {to_new.mean():.3f}"
    assert to_old.mean() > 0.5, f"the new weights barely differ from the old ones ({to_old.mean():.3f})"

    greedy = backend.generate(
        prompts, SamplingConfig(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=16, return_log_probs=True)
    )
    with torch.no_grad():
        for r in greedy:  # each greedy token is (within bf16 error) the new model's argmax
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logp = torch.log_softmax(new(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float(), dim=-1)
            chosen = logp.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
            assert torch.all(logp.max(dim=-1).values - chosen < 0.25)

    with pytest.raises(ValueError, match="older"):
        backend.update_weights(old.state_dict(), version=backend.weight_version - 1)


def test_sleep_frees_memory_and_wake_up_restores_the_weights(setup) -> None:
    tokenizer, backend, figures = setup.tokenizer, setup.backend, setup.figures
    sampling = SamplingConfig(
        n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=32, seed=4, return_log_probs=True
    )
    prompts = prompts_for(tokenizer, 8)
    before = backend.generate(prompts, sampling)
    awake = used_gib()
    t0 = time.perf_counter()
    backend.sleep()
    figures["sleep_seconds"] = round(time.perf_counter() - t0, 3)
    asleep = used_gib()
    figures["gpu_used_gib_awake"], figures["gpu_used_gib_asleep"] = round(awake, 2), round(asleep, 2)
    assert awake - asleep > 1.0, f"sleep freed only {awake - asleep:.2f} GiB"
    backend.sleep()  # idempotent
    t0 = time.perf_counter()
    after = backend.generate(prompts, sampling)  # wakes up first
    figures["wake_and_generate_seconds"] = round(time.perf_counter() - t0, 3)
    diff = gaps(after, teacher_forced(setup.current, after))  # the weights came back intact
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL
    same = sum(a.response_ids == b.response_ids for a, b in zip(before, after, strict=True)) / len(before)
    figures["same_samples_after_wake_fraction"] = same
    assert same >= 0.9  # same weights and seeds; only bf16 near-ties (prefix cache vs recompute) may differ

    # update while asleep: the weights are woken alone, the KV cache on the next generate
    newer = small_qwen2(setup.tok, seed=2)
    backend.sleep()
    t0 = time.perf_counter()
    backend.update_weights(newer.state_dict(), version=backend.weight_version + 1)
    figures["sync_while_asleep_seconds"] = round(time.perf_counter() - t0, 4)
    setup.current = newer
    assert backend.is_asleep
    results = backend.generate(prompts, sampling)
    diff = gaps(results, teacher_forced(newer, results))
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL
