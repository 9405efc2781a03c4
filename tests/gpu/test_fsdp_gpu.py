"""FSDP2 on one GPU: a world of one (NCCL), bf16 parameters / fp32 reduce, activation checkpointing, a ~150M Qwen2.

Checks that the sharded bf16 policy computes the fp32 model's log-probs up to bf16 rounding, that a DAPO update
runs with finite metrics and keeps fp32 master weights, and writes step time, tokens/s and peak GPU memory to
benchmarks/results/fsdp_gpu.json. Run: ``python -m pytest tests/gpu/test_fsdp_gpu.py -q`` (skipped without CUDA).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.fsdp import FsdpSettings, apply_fsdp2
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fsdp_gpu.json"
DIMS = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
GROUPS, G, PROMPT_LEN, RESP_LEN, MICRO = 16, 4, 128, 512, 16
REPEATS = 3


def small_qwen2(dims: dict[str, int], seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(**dims, max_position_embeddings=2048, tie_word_embeddings=False, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)  # fp32 on CPU: the master copy before sharding


def random_batch(vocab: int, groups: int, g: int, prompt_len: int, resp_len: int) -> PolicyBatch:
    """scripts/gpu_check.py's seeded batch: ``groups`` prompts x ``g`` responses with advantages."""
    check = _gpu_check()
    return check.random_batch(vocab, check.Sizes(groups, g, prompt_len, resp_len, micro=MICRO))


def fsdp_step_figures(device: torch.device, dims: dict[str, int], sizes: tuple[int, int, int, int, int]) -> dict:
    """One bf16 FSDP2 policy vs its fp32 unsharded twin, then timed DAPO updates (needs a process group)."""
    groups, g, prompt_len, resp_len, micro = sizes
    reference = small_qwen2(dims)
    params = sum(p.numel() for p in reference.parameters())
    settings = FsdpSettings(param_dtype="bfloat16", reduce_dtype="float32")
    model = apply_fsdp2(copy.deepcopy(reference), settings, gradient_checkpointing=True)
    optim = OptimConfig(
        lr=1e-5,
        weight_decay=0.1,
        grad_clip=1.0,
        warmup_steps=0,
        scheduler="constant",
        total_steps=1,
        min_lr_ratio=0.0,
        betas=None,
    )
    trainer = PolicyTrainer(model, optim, micro_batch_size=micro, device=device)
    batch = random_batch(dims["vocab_size"], groups, g, prompt_len, resp_len)
    mask = batch.response_mask.bool()  # (N, T)

    log_probs = trainer.compute_log_probs(batch)[0]  # (N, T), bf16 compute
    plain = PolicyTrainer(reference.to(device), optim, micro_batch_size=micro, device=device)
    log_probs_fp32 = plain.compute_log_probs(batch)[0]  # (N, T)
    lp_gap = float((log_probs - log_probs_fp32)[mask].abs().mean())
    del plain, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    batch.old_log_probs = log_probs
    loss = LossConfig(  # DAPO: clip-higher 0.2 / 0.28, dual clip, token-mean
        mode="ppo-clip",
        clip_low=0.2,
        clip_high=0.28,
        clip_c=10.0,
        loss_agg="token-mean",
        norm_length=None,
        entropy_coef=0.0,
    )
    metrics = [trainer.update(batch, loss, ppo_epochs=1, mini_batch_groups=groups // 2)]  # warm-up
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        metrics.append(trainer.update(batch, loss, ppo_epochs=1, mini_batch_groups=groups // 2))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    tokens = int(batch.attention_mask.sum())
    return {
        "params": params,
        "tokens_per_update": tokens,
        "step_time_s": min(times),
        "tokens_per_s": tokens / min(times),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "log_prob_gap_bf16_vs_fp32": lp_gap,
        "metrics": metrics,
        "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "setup": {**dims, "groups": groups, "G": g, "prompt_len": prompt_len, "max_resp_len": resp_len,
                  "micro": micro, "param_dtype": "bfloat16", "reduce_dtype": "float32",
                  "gradient_checkpointing": True},
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group() -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def test_fsdp2_bf16_update_on_one_gpu_writes_its_figures(one_rank_group):
    device = one_rank_group
    out = fsdp_step_figures(device, DIMS, (GROUPS, G, PROMPT_LEN, RESP_LEN, MICRO))
    assert out["master_dtypes"] == ["torch.float32"]  # fp32 master shards; bf16 only for all-gather / compute
    assert out["log_prob_gap_bf16_vs_fp32"] < 0.05  # bf16 rounding of the same model, not another model
    for m in out["metrics"]:
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
        assert m["num_updates"] == 2.0 and m["grad_norm"] > 0
    assert out["peak_memory_gb"] > 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "fsdp_gpu",
        "machine": {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "python": platform.python_version()},
        **{k: v for k, v in out.items() if k != "metrics"},
        "last_metrics": out["metrics"][-1],
    }  # fmt: skip
    RESULTS.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------- the sections of scripts/gpu_check.py
# CPU offload through a binding grad clip, DCP round trip, rank-0 materialisation (also offloaded), release before
# wake: on one GPU (a world of one, "cpu:gloo,cuda:nccl") and on two ranks when two GPUs are there. The same code
# runs on CPU in tests/test_gpu_check.py (dry run, 2 gloo ranks).
CHECKED = ["cpu_offload_clip", "dcp_round_trip", "rank0_materialise", "release_before_wake"]


def _gpu_check() -> Any:
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # spawned ranks pickle its functions by this name
    spec.loader.exec_module(module)
    return module


def _run_sections(tmp_path: Path, world: int) -> dict[str, Any]:
    gpu_check = _gpu_check()
    result = gpu_check.run(False, tmp_path, world, CHECKED, deadline_s=540.0, timeout_s=300.0)
    failed = {
        s["name"]: (s.get("error"), s.get("errors"), s.get("traceback")) for s in result["sections"] if not s["ok"]
    }
    assert not failed, failed
    assert result["backend"] == "cpu:gloo,cuda:nccl"
    return {s["name"]: s["figures"] for s in result["sections"]}


def test_offload_dcp_rank0_loading_and_release_on_one_gpu(tmp_path):
    figures = _run_sections(tmp_path, world=1)
    assert (
        figures["cpu_offload_clip"]["grad_devices"] == ["cpu"] and figures["cpu_offload_clip"]["clip_coefficient"] < 1
    )
    assert figures["release_before_wake"]["wake_after_release"] == "ok"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (multi-rank FSDP2 over NCCL + gloo)")
def test_offload_dcp_rank0_loading_and_release_on_two_gpus(tmp_path):
    figures = _run_sections(tmp_path, world=2)
    # two ranks: the grad-norm all-reduce of the CPU-offloaded gradients really crosses ranks over gloo
    assert figures["cpu_offload_clip"]["step_gap_vs_no_offload"] < 1e-2
    assert figures["rank0_materialise"]["cpu_offload_logit_gap"] < 1e-3
