"""A colocated step on one GPU: the trainer and a vLLM engine in one process (LocalExecutor), sleep mode on.

Needs CUDA and vLLM (skipped otherwise: the CPU half is tests/test_colocated_order.py, which records the order
update -> release -> wake -> generate with stand-ins; this file checks what the order is for). The engine is
given a memory share that fits only once the trainer's cached peak is handed back: before the fix, the wake-up
after an update ran out of memory. Records ``memory_reserved`` around the release.

    python -m pytest tests/gpu/test_colocated_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")  # conftest skips `gpu` tests without CUDA; this skips them without vllm

from dapo_core.config import load_config  # noqa: E402
from dapo_core.engines import executor as lex  # noqa: E402
from dapo_core.engines.batch import build_policy_batch  # noqa: E402
from dapo_core.engines.memory import release_cached_memory  # noqa: E402
from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir  # noqa: E402
from dapo_core.engines.rollout import SamplingConfig  # noqa: E402
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(
        tok, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=512, tie_word_embeddings=False, seed=0,
    )  # fmt: skip
    path = save_hf_dir(model.float(), tok, tmp_path_factory.mktemp("colocated") / "base")
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=[
            f"model.path={path}",
            "model.dtype=bfloat16",
            "trainer.device=cuda",
            "rollout.backend=vllm",
            "rollout.free_cache_engine=true",
            "resources.n_gpus_per_node=1",
            "rollout.tensor_parallel_size=1",
            "rollout.gpu_memory_utilization=0.5",
            "rollout.max_num_batched_tokens=2048",
            "data.max_prompt_length=32",
            "data.max_response_length=256",
            "trainer.micro_batch_size=64",
        ],
        env={},
    )
    ex = lex.LocalExecutor(cfg)
    yield ex
    ex.shutdown()


def test_update_release_wake_generate_on_one_gpu(colocated, monkeypatch):
    ex = colocated
    order: list[str] = []
    reports = []

    def release(where: str):
        order.append("release")
        reports.append(release_cached_memory(where))
        return reports[-1]

    monkeypatch.setattr(lex, "release_cached_memory", release)
    prompts = [[5, 6, 7]] * 8
    results = ex.generate(
        prompts,
        SamplingConfig(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=256, seed=1, return_log_probs=True),
    )
    batch = build_policy_batch(
        [r.prompt_ids for r in results], [r.response_ids for r in results], pad_token_id=0,
        group_ids=[r.prompt_index for r in results],
    )  # fmt: skip
    batch.old_log_probs, _ = ex.compute_log_probs(batch)
    batch.advantages = torch.randn(len(results))
    order.append("update")
    ex.update(batch)  # a large logits peak: 64 rows x 256 tokens x vocab in the allocator's cache
    peak_reserved = torch.cuda.memory_reserved()
    assert ex.sync_weights() == 1  # the release runs here, before the engine wakes its weights
    order.append("generate")
    again = ex.generate(prompts, SamplingConfig(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64, seed=2))
    assert order == ["update", "release", "generate"] and len(again) == 64
    (report,) = reports
    assert report.reserved_before >= peak_reserved * 0.99 and report.reserved_after < report.reserved_before
    print(
        f"\nreserved after the update {report.reserved_before / 2**30:.2f} GiB -> after the release "
        f"{report.reserved_after / 2**30:.2f} GiB; sync {ex.last_sync}"
    )
