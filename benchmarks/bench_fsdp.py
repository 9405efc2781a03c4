"""FSDP2 vs the DDP path vs one process: ``PolicyTrainer.update`` tokens/s and memory per rank, side by side.

Run: ``python -m benchmarks.bench_fsdp`` (writes benchmarks/results/fsdp.json and fsdp.md on CPU, fsdp_cuda.* on
a GPU machine).

Three layouts run the same DAPO update (one rollout step: 2 mini-batches, AdamW) on the same batch and model, each
in fresh spawned processes so that peak RSS belongs to the layout alone:

- ``single``: one process, the whole batch;
- ``ddp``: 2 ranks (gloo on CPU, NCCL on GPU), full replicas, gradients all-reduced by ``PolicyTrainer``;
- ``fsdp2``: 2 ranks, ``apply_fsdp2`` (fp32 parameters here, so the three do the same arithmetic), parameters,
  gradients and AdamW state sharded.

Every torch process runs one thread (on a shared 2-core box multi-threaded torch
mostly measures spin-waits), so the 2-rank layouts have twice the cores of ``single``. ``state MB/rank`` is exact:
fp32 parameters + gradients + the two AdamW moments that live on one rank. Peak RSS includes the ~0.4 GB torch +
transformers runtime and, for FSDP2, the full model each rank loads before sharding it.
"""

from __future__ import annotations

import os
import resource
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks.common import random_policy_batch, write_results
from dapo_core.config import AlgorithmConfig, TrainerConfig
from dapo_core.distributed.sharding import shard_for_update
from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer

# a ~16M-parameter Qwen2 (the tiny recipe's shape, wider): big enough that optimizer state shows in RSS
DIMS = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
DIMS_MLP = 2048
GROUPS, G, PROMPT_LEN, RESP_LEN, MICRO, MINI_GROUPS = 8, 4, 12, 40, 8, 4
REPEATS = 2
WORLD = 2


def _model() -> torch.nn.Module:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    return build_tiny_qwen2(tok, intermediate_size=DIMS_MLP, **DIMS, seed=0)


def _batch() -> PolicyBatch:
    vocab = len(build_char_tokenizer(DEFAULT_ALPHABET))
    return random_policy_batch(groups=GROUPS, g=G, prompt_len=PROMPT_LEN, resp_len=RESP_LEN, vocab=vocab)


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB (Linux)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * page / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return current, peak


def _state_mb(trainer: PolicyTrainer) -> float:
    """fp32 parameters + gradients + AdamW's two moments held by this rank (local shards under FSDP2)."""
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters())
    return 4 * local * 4 / 2**20


def _worker(rank: int, layout: str, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if world > 1 or layout == "fsdp2":
        if cuda:
            torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    model = _model()
    if layout == "fsdp2":
        from dapo_core.engines.fsdp import FsdpSettings, apply_fsdp2

        model = apply_fsdp2(model, FsdpSettings(param_dtype="float32", reduce_dtype="float32"))
    else:
        model.to(device)
    optim = OptimConfig.from_config(TrainerConfig(lr=1e-5, weight_decay=0.0, lr_warmup_steps=0))
    loss = LossConfig.from_config(AlgorithmConfig(clip_c=None), max_response_length=RESP_LEN)  # no dual clip
    trainer = PolicyTrainer(model, optim, micro_batch_size=MICRO, device=device)
    batch = _batch()
    shard = batch if world == 1 else shard_for_update(batch, MINI_GROUPS, world)[rank]
    groups = MINI_GROUPS if world == 1 else 1

    def step() -> None:
        trainer.update(shard, loss, ppo_epochs=1, mini_batch_groups=groups)
        if cuda:
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()  # the step ends when the slowest rank is done

    step()  # warm-up
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    current, peak = _rss_mb()
    result = {
        "step_s": min(times),
        "tokens": int(batch.attention_mask.sum()),
        "rss_mb": current,
        "peak_rss_mb": peak,
        "state_mb": _state_mb(trainer),
        "peak_cuda_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
    }
    torch.save(result, Path(out_dir) / f"{layout}-{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_layout(layout: str, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        args = (layout, world, _free_port(), out)
        mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
        ranks = [torch.load(Path(out) / f"{layout}-{r}.pt", weights_only=True) for r in range(world)]
    step_s = max(r["step_s"] for r in ranks)
    cuda = [r["peak_cuda_mb"] for r in ranks if r["peak_cuda_mb"] is not None]
    return {
        "world": world,
        "step_s": step_s,
        "tokens_per_s": ranks[0]["tokens"] / step_s,
        "state_mb_per_rank": max(r["state_mb"] for r in ranks),
        "rss_mb_per_rank": max(r["rss_mb"] for r in ranks),
        "peak_rss_mb_per_rank": max(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_total": sum(r["peak_rss_mb"] for r in ranks),
        "peak_cuda_mb_per_rank": max(cuda) if cuda else None,
    }


def main() -> None:
    cuda = torch.cuda.is_available()
    world = min(WORLD, torch.cuda.device_count()) if cuda else WORLD
    layouts = {"single": 1, "ddp": world, "fsdp2": world}
    results = {name: run_layout(name, w) for name, w in layouts.items()}
    params = sum(p.numel() for p in _model().parameters())
    payload = {
        "device": "cuda" if cuda else "cpu",
        "params": params,
        "layouts": results,
        "load_average_1m": os.getloadavg()[0],  # other jobs on a shared box slow every layout
        "setup": {**DIMS, "intermediate_size": DIMS_MLP, "groups": GROUPS, "G": G, "prompt_len": PROMPT_LEN,
                  "max_resp_len": RESP_LEN, "micro": MICRO, "mini_batch_groups": MINI_GROUPS, "threads": 1},
    }  # fmt: skip
    rows = [
        "| layout | ranks | step s | tokens/s | state MB/rank | RSS MB/rank (end) | peak RSS MB/rank | peak RSS MB total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['world']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['state_mb_per_rank']:.0f} "
            f"| {r['rss_mb_per_rank']:.0f} | {r['peak_rss_mb_per_rank']:.0f} | {r['peak_rss_mb_total']:.0f} |"
        )
    if cuda:
        rows.append("")
        rows += [f"- {name}: peak CUDA MB/rank {r['peak_cuda_mb_per_rank']:.0f}" for name, r in results.items()]
    rows.append("")
    rows.append(
        f"{params / 1e6:.1f}M-parameter Qwen2, one DAPO update of {GROUPS}x{G} responses (2 mini-batches), one "
        f"thread per process; 1-minute load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    )
    write_results("fsdp_cuda" if cuda else "fsdp", payload, "\n".join(rows))


if __name__ == "__main__":
    main()
