"""The FSDP2 checks to run the day a GPU is lent: each section timed and recorded, failures recorded and skipped past.

    scripts/gpu_check.sh                 # CUDA: one rank per GPU, "cpu:gloo,cuda:nccl", a 0.5B-shaped Qwen2
    scripts/gpu_check.sh --dry-run       # CPU: 2 gloo ranks, tiny shapes, ~1 min; writes to a temp dir (or --out)

Sections (every rank runs each, in order; they agree on pass/fail after each one):

    fsdp_bf16_update     bf16 all-gather/compute, fp32 reduce + master weights, activation checkpointing, a DAPO
                         update of the 0.5B-shaped Qwen2 (hidden 896, 24 layers, vocab 151936, tied); peak memory
    cpu_offload_clip     CPU-offloaded shards through an update whose grad clip binds (clip_grad_norm_ over CPU
                         DTensor gradients: the gloo side of the group), against the same update without offload
    dcp_round_trip       sharded save (DCP) -> a fresh model loads it -> the next step's loss is identical
    rank0_materialise    meta skeleton everywhere, rank 0 reads the HF dir, shards filled by broadcast (also with
                         CPU offload: CPU shards broadcast over gloo)
    release_before_wake  after an update: memory_reserved around release_cached_memory, and whether a "wake"
                         allocation of 70% of the free memory fits in another process before / after the release
    planner              dapo plan's trainer peak for the 0.5B update vs the measured peak (GPU; planned only on CPU)

Writes gpu.json and gpu.md (machine, versions, each section's figures, pass/fail) to benchmarks/results/ (GPU) or
the --out directory; exits 1 when a section failed. Needs only torch, transformers and this repository's
dapo_core modules that import neither pydantic nor Ray, Prefect or MLflow (tests/test_gpu_check.py checks that).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from dapo_core.distributed.sharding import shard_for_update  # noqa: E402
from dapo_core.engines.batch import PolicyBatch, build_policy_batch  # noqa: E402
from dapo_core.engines.dist_setup import init_process_group_kwargs, process_group_backend  # noqa: E402
from dapo_core.engines.fsdp import (  # noqa: E402
    FsdpSettings,
    all_ranks_ok,
    apply_fsdp2,
    full_state_dict,
    load_sharded,
    save_sharded,
    sum_over_ranks,
)
from dapo_core.engines.fsdp_init import load_master_on_rank0, materialize_from_rank0  # noqa: E402
from dapo_core.engines.memory import release_cached_memory  # noqa: E402
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GIB = float(1 << 30)

# Qwen2.5-0.5B's shapes (random init, nothing downloaded)
QWEN_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
MEDIUM = {**QWEN_05B, "num_hidden_layers": 4}  # the same widths, 4 layers (~0.2B): the correctness sections
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 256,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Sizes:
    """A batch: ``groups`` prompts x ``g`` responses, prompt / max response length, rows per micro-batch."""

    groups: int
    g: int
    prompt_len: int
    resp_len: int
    micro: int


@dataclass
class Ctx:
    """What every section gets: this rank, its device, the shapes and a scratch directory shared by the ranks."""

    rank: int
    world: int
    device: torch.device
    dry_run: bool
    scratch: Path
    big: dict[str, Any]
    medium: dict[str, Any]
    big_sizes: Sizes
    sizes: Sizes
    notes: list[str] = field(default_factory=list)
    _mesh: DeviceMesh | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def mesh(self) -> DeviceMesh:
        """All ranks on this section's device type (explicit: a dry run on a CUDA machine stays on the CPU)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh


# ---------------------------------------------------------------------------------------------- helpers
def qwen2(dims: dict[str, Any], seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 in fp32 on CPU (the master copy before sharding)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(**dims, max_position_embeddings=4096, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)


def random_batch(vocab: int, sizes: Sizes, seed: int = 0) -> PolicyBatch:
    """The same batch on every rank (seeded): random prompts / responses, advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, gids = [], [], []
    for k in range(sizes.groups):
        prompt = torch.randint(3, vocab, (sizes.prompt_len,), generator=gen).tolist()
        for _ in range(sizes.g):
            n = int(torch.randint(sizes.resp_len // 2, sizes.resp_len + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
            gids.append(k)
    batch = build_policy_batch(prompts, responses, pad_token_id=0, group_ids=gids)
    batch.advantages = torch.randn(len(prompts), generator=gen)  # (N,)
    return batch


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def fsdp_trainer(ctx: Ctx, dims: dict[str, Any], settings: FsdpSettings, optim: OptimConfig, *, seed: int = 1,
                 micro: int, checkpointing: bool = False) -> PolicyTrainer:  # fmt: skip
    model = apply_fsdp2(qwen2(dims, seed), settings, mesh=ctx.mesh, gradient_checkpointing=checkpointing)
    return PolicyTrainer(model, optim, micro_batch_size=micro, device=ctx.device)


def with_old_log_probs(trainer: PolicyTrainer, batch: PolicyBatch) -> PolicyBatch:
    """pi_old from the trainer itself (a collective: every rank computes every row), slightly perturbed so that
    ratios clip."""
    noise = 0.05 * torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5))
    batch.old_log_probs = trainer.compute_log_probs(batch)[0] + noise * batch.response_mask  # (N, T)
    return batch


def my_shard(ctx: Ctx, batch: PolicyBatch, mini_batch_groups: int) -> PolicyBatch:
    return shard_for_update(batch, mini_batch_groups, ctx.world)[ctx.rank]


def finite(metrics: dict[str, float]) -> bool:
    return all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())


def grad_norm_now(ctx: Ctx, model: torch.nn.Module) -> float:
    """Collective: the global L2 norm of the (sharded) gradients as they are now, e.g. after the clip."""
    local = sum(float(p.grad.to_local().double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    return sum_over_ranks(local, ctx.device) ** 0.5


def require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


# The settings of the checks, written out: this script runs where the config package (pydantic) is absent, so it
# cannot build them from a recipe. DAPO's loss (clip-higher 0.2 / 0.28, dual clip 10, token-mean) and AdamW at a
# constant lr without warm-up, weight decay 0.1, grad clip 1.0 unless a check says otherwise.
LOSS = LossConfig(
    mode="ppo-clip",
    clip_low=0.2,
    clip_high=0.28,
    clip_c=10.0,
    loss_agg="token-mean",
    norm_length=None,
    entropy_coef=0.0,
)


def adamw(lr: float, grad_clip: float = 1.0) -> OptimConfig:
    return OptimConfig(
        lr=lr, weight_decay=0.1, grad_clip=grad_clip, warmup_steps=0, scheduler="constant", total_steps=1,
        min_lr_ratio=0.0, betas=None,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- sections
def fsdp_bf16_update(ctx: Ctx) -> dict[str, Any]:
    """bf16 FSDP2 DAPO updates of the 0.5B-shaped model (tiny in a dry run): step time, tokens/s, peak memory."""
    s = ctx.big_sizes
    settings = FsdpSettings(param_dtype="bfloat16", reduce_dtype="float32")
    trainer = fsdp_trainer(ctx, ctx.big, settings, adamw(1e-5),
                           micro=s.micro, checkpointing=True)  # fmt: skip
    params = sum(p.numel() for p in trainer.model.parameters()) * ctx.world  # shards x ranks (approx. the model)
    batch = with_old_log_probs(trainer, random_batch(ctx.big["vocab_size"], s))
    shard = my_shard(ctx, batch, s.groups // 2)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    metrics = [trainer.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)]  # warm-up
    times = []
    for _ in range(2):
        sync(ctx)
        t0 = time.perf_counter()
        metrics.append(trainer.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1))
        sync(ctx)
        times.append(time.perf_counter() - t0)
    tokens = int(batch.attention_mask.sum())
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    require(all(finite(m) for m in metrics), f"non-finite metrics: {metrics[-1]}")
    require(all(m["num_updates"] == 2.0 and m["grad_norm"] > 0 for m in metrics), f"metrics: {metrics[-1]}")
    require(dtypes == ["torch.float32"], f"master weights {dtypes}, expected fp32 shards")
    return {
        "params": params,
        "tokens_per_update": tokens,
        "step_time_s": min(times),
        "tokens_per_s": tokens / min(times),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(ctx.device) / GIB if ctx.cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(ctx.device) / GIB if ctx.cuda else None,
        "grad_norm": metrics[-1]["grad_norm"],
        "pg_loss": metrics[-1]["pg_loss"],
        "master_dtypes": dtypes,
        "setup": {**{k: v for k, v in ctx.big.items()}, **s.__dict__, "param_dtype": "bfloat16", "world": ctx.world},
    }


def cpu_offload_clip(ctx: Ctx) -> dict[str, Any]:
    """CPU offload through an update whose grad clip binds, vs the same fp32 update without offload."""
    s = ctx.sizes
    clip = 1e-3  # far below the grad norm: clip coefficient << 1
    optim = adamw(1e-4, grad_clip=clip)
    fp32 = FsdpSettings("float32", "float32")
    start = {
        k: v.clone()
        for k, v in full_state_dict(fsdp_trainer(ctx, ctx.medium, fp32, optim, micro=s.micro).model).items()
    }
    ref = fsdp_trainer(ctx, ctx.medium, fp32, optim, micro=s.micro)
    batch = with_old_log_probs(ref, random_batch(ctx.medium["vocab_size"], s))
    shard = my_shard(ctx, batch, s.groups)
    m_ref = ref.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)
    want = full_state_dict(ref.model)
    del ref
    offload = FsdpSettings("float32", "float32", cpu_offload=True)
    off = fsdp_trainer(ctx, ctx.medium, offload, optim, micro=s.micro)
    sync(ctx)
    t0 = time.perf_counter()
    m_off = off.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)
    sync(ctx)
    step_s = time.perf_counter() - t0
    grad_devices = sorted({p.grad.to_local().device.type for p in off.model.parameters() if p.grad is not None})
    clipped_norm = grad_norm_now(ctx, off.model)  # the clip scaled the gradients to norm `clip`
    got = full_state_dict(off.model)  # collective; {} off rank 0
    out: dict[str, Any] = {
        "grad_clip": clip,
        "grad_norm": m_off["grad_norm"],
        "grad_norm_no_offload": m_ref["grad_norm"],
        "clip_coefficient": clip / m_off["grad_norm"],
        "grad_norm_after_clip": clipped_norm,
        "grad_devices": grad_devices,
        "step_time_s": step_s,
    }
    require(grad_devices == ["cpu"], f"offloaded gradients live on {grad_devices}, expected cpu")
    require(m_off["grad_norm"] > 10 * clip, f"grad norm {m_off['grad_norm']} does not make the clip {clip} bind")
    require(abs(clipped_norm / clip - 1) < 1e-2, f"gradients after the clip have norm {clipped_norm}, expected {clip}")
    require(
        abs(m_off["grad_norm"] / m_ref["grad_norm"] - 1) < 1e-3,
        f"grad norm {m_off['grad_norm']} vs {m_ref['grad_norm']}",
    )
    if ctx.rank == 0:
        moved = torch.cat([(want[k] - start[k]).flatten() for k in want])  # (P,)
        moved_off = torch.cat([(got[k] - start[k]).flatten() for k in want])  # (P,)
        gap = float((moved_off - moved).norm() / moved.norm())
        out["step_gap_vs_no_offload"] = gap
        require(gap < 1e-2, f"offloaded step differs from the plain one by {gap:.2e} (relative)")
    return out


def dcp_round_trip(ctx: Ctx) -> dict[str, Any]:
    """Sharded save after a step, a fresh model loads it, the next step's loss is identical."""
    s = ctx.sizes
    optim = adamw(1e-4)
    settings = FsdpSettings("bfloat16", "float32")
    trainer = fsdp_trainer(ctx, ctx.medium, settings, optim, micro=s.micro)
    batch = with_old_log_probs(trainer, random_batch(ctx.medium["vocab_size"], s))
    shard = my_shard(ctx, batch, s.groups)
    trainer.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)
    path = ctx.scratch / "dcp"
    sync(ctx)
    t0 = time.perf_counter()
    save_sharded(trainer.model, trainer.optimizer, path)
    save_s = time.perf_counter() - t0
    state = trainer.state_dict()
    before = full_state_dict(trainer.model)  # collective; {} off rank 0
    m_next = trainer.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)
    after = full_state_dict(trainer.model)
    fresh = fsdp_trainer(ctx, ctx.medium, settings, optim, seed=7, micro=s.micro)
    t0 = time.perf_counter()
    load_sharded(fresh.model, fresh.optimizer, path)
    load_s = time.perf_counter() - t0
    fresh.load_state_dict(state)
    m_resumed = fresh.update(shard, LOSS, ppo_epochs=1, mini_batch_groups=1)
    after_resumed = full_state_dict(fresh.model)
    step_gap = None
    if ctx.rank == 0:  # the step itself (weights and Adam state): a lost optimizer state moves the weights otherwise
        moved = torch.cat([(after[k] - before[k]).flatten() for k in before])  # (P,)
        moved_resumed = torch.cat([(after_resumed[k] - before[k]).flatten() for k in before])  # (P,)
        step_gap = float((moved_resumed - moved).norm() / moved.norm())
    bytes_written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if ctx.rank == 0 else None
    require(m_resumed["pg_loss"] == m_next["pg_loss"], f"next-step loss {m_resumed['pg_loss']} != {m_next['pg_loss']}")
    rel = abs(m_resumed["grad_norm"] / m_next["grad_norm"] - 1)
    require(rel < 1e-3, f"next-step grad norm {m_resumed['grad_norm']} vs {m_next['grad_norm']}")
    require(step_gap is None or step_gap < 1e-2, f"the resumed step differs from the original by {step_gap} (relative)")
    if all_ranks_ok(True) and ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"next_step_pg_loss": m_next["pg_loss"], "resumed_pg_loss": m_resumed["pg_loss"],
            "grad_norm_rel_gap": rel, "next_step_gap": step_gap, "save_s": save_s, "load_s": load_s, "bytes": bytes_written}  # fmt: skip


def rank0_materialise(ctx: Ctx) -> dict[str, Any]:
    """Meta skeleton on every rank, rank 0 reads the HF dir, shards filled by broadcast; on the device and offloaded."""
    hf_dir = ctx.scratch / "hf"
    reference = qwen2(ctx.medium, seed=3)
    ok = True
    if ctx.rank == 0:
        try:
            reference.save_pretrained(hf_dir, safe_serialization=True)
        except Exception:
            ok = False
            raise
        finally:
            all_ranks_ok(ok)
    elif not all_ranks_ok(True):
        raise RuntimeError("rank 0 failed to write the HF directory; see rank 0's error")
    ids = (torch.arange(64).view(2, 32) * 7919) % ctx.medium["vocab_size"]  # (2, 32)
    with torch.no_grad():
        want_logits = reference.to(ctx.device)(input_ids=ids.to(ctx.device)).logits.float().cpu()  # (2, 32, V)
    want_state = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    del reference
    out: dict[str, Any] = {}
    for label, offload in (("on_device", False), ("cpu_offload", True)):
        t0 = time.perf_counter()
        skeleton, full = load_master_on_rank0(str(hf_dir), rank=ctx.rank)
        model = apply_fsdp2(skeleton, FsdpSettings("float32", "float32", cpu_offload=offload), mesh=ctx.mesh)
        materialize_from_rank0(model, full, device="cpu" if offload else ctx.device, buffer_device=ctx.device)
        del full
        out[f"{label}_s"] = time.perf_counter() - t0
        state = full_state_dict(model)  # collective; {} off rank 0
        with torch.no_grad():
            logits = model(input_ids=ids.to(ctx.device)).logits.float().cpu()  # collective forward
        gap = float((logits - want_logits).abs().max())
        out[f"{label}_logit_gap"] = gap
        require(gap < 1e-3, f"{label}: logits differ from the loaded model by {gap:.2e}")
        if ctx.rank == 0:
            bad = [k for k in want_state if k in state and not torch.equal(state[k], want_state[k])]
            missing = sorted(set(want_state) - set(state))
            require(not bad and not missing, f"{label}: tensors differ {bad[:3]} / missing {missing[:3]}")
        del model
    if all_ranks_ok(True) and ctx.rank == 0:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return out


_WAKE_PROBE = """
import sys, torch
n = int(sys.argv[1])
try:
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("ok")
except torch.OutOfMemoryError:
    print("oom")
"""


def _wake(device: torch.device, nbytes: int) -> str:
    """Another process (as vLLM's engine allocates outside this process's cache) allocating ``nbytes``."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(device.index or 0)}
    done = subprocess.run([sys.executable, "-c", _WAKE_PROBE, str(nbytes)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip
    return done.stdout.strip() or f"error: {done.stderr.strip()[-300:]}"


def release_before_wake(ctx: Ctx) -> dict[str, Any]:
    """After an update: what release_cached_memory gives back, and whether a 70%-of-free wake fits before / after."""
    s = ctx.big_sizes
    trainer = fsdp_trainer(ctx, ctx.big, FsdpSettings("bfloat16", "float32"), adamw(1e-5),
                           micro=s.micro, checkpointing=True)  # fmt: skip
    batch = with_old_log_probs(trainer, random_batch(ctx.big["vocab_size"], s))
    trainer.update(my_shard(ctx, batch, s.groups), LOSS, ppo_epochs=1, mini_batch_groups=1)
    if not ctx.cuda:
        report = release_cached_memory(f"gpu_check rank {ctx.rank}")
        require(report.released == 0, f"CPU release reported {report.released} bytes")
        return {"note": "no CUDA: the release only runs gc (byte counts 0)", "released_gib": 0.0}
    sync(ctx)
    free_before, total = torch.cuda.mem_get_info(ctx.device)
    reserved_before = torch.cuda.memory_reserved(ctx.device)
    report = release_cached_memory(f"gpu_check rank {ctx.rank}")
    free_after, _ = torch.cuda.mem_get_info(ctx.device)
    need = int(0.7 * free_after)  # what the waking engine asks for, sized to the memory free after the release
    out = {
        "total_gib": total / GIB,
        "reserved_before_gib": reserved_before / GIB,
        "reserved_after_gib": report.reserved_after / GIB,
        "allocated_gib": report.allocated / GIB,
        "released_gib": report.released / GIB,
        "free_before_gib": free_before / GIB,
        "free_after_gib": free_after / GIB,
        "wake_request_gib": need / GIB,
    }
    # the probe before the release has to run against the cache as it was: fill it back first
    hold = torch.empty(max(0, reserved_before - torch.cuda.memory_reserved(ctx.device)), dtype=torch.uint8,
                       device=ctx.device)  # fmt: skip
    del hold  # freed into the cache, still reserved: the state before the release
    out["wake_before_release"] = _wake(ctx.device, need)
    release_cached_memory(f"gpu_check rank {ctx.rank}")
    out["wake_after_release"] = _wake(ctx.device, need)
    require(report.reserved_after <= reserved_before, "the release grew memory_reserved")
    require(out["wake_after_release"] == "ok", f"the wake after the release failed: {out['wake_after_release']}")
    return out


def planner_section(ctx: Ctx) -> dict[str, Any]:
    """``dapo plan``'s trainer memory for the 0.5B-shaped update against the measured peak on this GPU.

    The planner's per-rank peak (sharded fp32 state + gathered bf16 layers + gradient buffers + one micro-batch's
    activations and logits, every row at the longest length) must not be exceeded by more than 20%, and must not
    be more than twice what is measured (a planner that refuses what fits is as wrong as one that lets an OOM
    through). On CPU (dry run) only the planned figures are recorded."""
    from transformers import Qwen2Config

    from dapo_core.planning.arch import arch_from_hf_config
    from dapo_core.planning.trainer_memory import trainer_gpu_for

    s = ctx.big_sizes
    arch = arch_from_hf_config(Qwen2Config(**ctx.big), "gpu_check 0.5B-shaped Qwen2")
    plan = trainer_gpu_for(
        arch, fsdp=True, master="float32", compute="bfloat16", reduce="float32", reshard_after_forward=True,
        defer_grad_sync=False, cpu_offload=False, world=ctx.world, micro=s.micro, prompt_len=s.prompt_len,
        response_len=s.resp_len, checkpointing=True,
    )  # fmt: skip
    out: dict[str, Any] = {
        "planned_peak_gib": plan.peak / GIB,
        "planned_state_gib": plan.state.total / GIB,
        "planned_activations_gib": plan.activations.peak / GIB,
    }
    if not ctx.cuda:
        require(plan.peak > plan.state.total > 0, f"planned figures not positive: {out}")
        out["note"] = "no CUDA: planned figures only"
        return out
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)  # what earlier sections left allocated (not this update's)
    trainer = fsdp_trainer(ctx, ctx.big, FsdpSettings("bfloat16", "float32"), adamw(1e-5),
                           micro=s.micro, checkpointing=True)  # fmt: skip
    batch = with_old_log_probs(trainer, random_batch(ctx.big["vocab_size"], s))
    trainer.update(my_shard(ctx, batch, s.groups), LOSS, ppo_epochs=1, mini_batch_groups=1)
    sync(ctx)
    measured = torch.cuda.max_memory_allocated(ctx.device) - base
    out.update(measured_peak_gib=measured / GIB, measured_over_planned=measured / plan.peak)
    require(0.5 * plan.peak <= measured <= 1.2 * plan.peak,
            f"measured peak {measured / GIB:.2f} GiB vs planned {plan.peak / GIB:.2f} GiB")  # fmt: skip
    return out


SECTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "fsdp_bf16_update": fsdp_bf16_update,
    "cpu_offload_clip": cpu_offload_clip,
    "dcp_round_trip": dcp_round_trip,
    "rank0_materialise": rank0_materialise,
    "release_before_wake": release_before_wake,
    "planner": planner_section,
}


# ---------------------------------------------------------------------------------------------- ranks
def _rank_main(
    rank: int, world: int, port: int, out_dir: str, dry_run: bool, names: list[str], timeout_s: float
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cuda = not dry_run
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    records: list[dict[str, Any]] = []
    out_path = Path(out_dir) / f"rank{rank}.json"

    def flush() -> None:
        out_path.write_text(json.dumps({"rank": rank, "sections": records}, indent=2, default=str))

    try:
        dist.init_process_group(**init_process_group_kwargs(
            device.type, address="127.0.0.1", port=port, rank=rank, world_size=world, collective_timeout_s=timeout_s
        ))  # fmt: skip
    except Exception as exc:
        records.append({"name": "init_process_group", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        flush()
        raise
    scratch = Path(out_dir) / "scratch"
    ctx = Ctx(rank=rank, world=world, device=device, dry_run=dry_run, scratch=scratch,
              big=TINY if dry_run else QWEN_05B, medium=TINY if dry_run else MEDIUM,
              big_sizes=Sizes(4, 2, 8, 16, 2) if dry_run else Sizes(8, 4, 256, 1024, 8),
              sizes=Sizes(4, 2, 8, 16, 2) if dry_run else Sizes(4, 4, 128, 256, 4))  # fmt: skip
    for name in names:
        t0 = time.perf_counter()
        record: dict[str, Any] = {"name": name}
        try:
            if os.environ.get("GPU_CHECK_INJECT_FAILURE") == name:  # tests/test_gpu_check.py: a failing section
                raise RuntimeError(f"injected failure in {name} (GPU_CHECK_INJECT_FAILURE)")
            record["figures"] = SECTIONS[name](ctx)
            ok = True
        except Exception as exc:
            ok = False
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()[-3000:]
        try:
            agreed = all_ranks_ok(ok)  # a section that failed on one rank failed
        except Exception as exc:
            agreed = False
            record.setdefault("error", f"agreeing on the result failed: {type(exc).__name__}: {exc}")
        record["ok"], record["ok_here"], record["seconds"] = agreed, ok, time.perf_counter() - t0
        records.append(record)
        flush()
        if cuda:
            release_cached_memory(f"gpu_check after {name}")
    if dist.is_initialized():
        dist.destroy_process_group()


def machine() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as exc:  # pragma: no cover - informative only
            info["nccl"] = f"unknown ({exc})"
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(dry_run: bool, out_dir: Path, world: int, names: list[str], deadline_s: float, timeout_s: float) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    if __name__ != "__main__" and here not in sys.path:  # imported (tests/gpu): the spawned ranks import it by name
        sys.path.insert(0, here)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=out_dir))
    started = time.perf_counter()
    ctx = mp.start_processes(_rank_main, args=(world, _free_port(), str(work), dry_run, names, timeout_s),
                             nprocs=world, join=False, start_method="spawn")  # fmt: skip
    crashed = None
    try:
        while not ctx.join(timeout=5):
            if time.perf_counter() - started > deadline_s:
                crashed = f"ranks still running after {deadline_s:.0f} s: stopped"
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                break
    except Exception as exc:  # a rank raised outside the sections (e.g. init_process_group)
        crashed = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    ranks = []
    for r in range(world):
        path = work / f"rank{r}.json"
        ranks.append(json.loads(path.read_text())["sections"] if path.is_file() else [])
    sections = []
    for name in names:
        mine = [next((s for s in rs if s["name"] == name), None) for rs in ranks]
        rec = mine[0] or {"name": name, "ok": False, "error": crashed or "rank 0 never reached this section"}
        errors = {f"rank{r}": s["error"] for r, s in enumerate(mine) if s is not None and "error" in s}
        if any(s is None for s in mine):
            rec = {**rec, "ok": False}
            errors.setdefault("missing", f"ranks {[r for r, s in enumerate(mine) if s is None]} have no record")
        sections.append({**rec, "errors": errors} if errors else rec)
    init_errors = [s for rs in ranks for s in rs if s["name"] == "init_process_group"]
    shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "gpu_check",
        "dry_run": dry_run,
        "world": world,
        "backend": process_group_backend("cpu" if dry_run else "cuda"),
        "machine": machine(),
        "wall_s": time.perf_counter() - started,
        "crashed": crashed,
        "init_errors": init_errors,
        "passed": all(s.get("ok") for s in sections) and not init_errors,
        "sections": sections,
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# GPU check{' (dry run, CPU)' if result['dry_run'] else ''}",
        "",
        f"- machine: {m['host']}, {', '.join(m['gpus']) or 'no GPU'}; Python {m['python']}",
        f"- torch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}, NCCL {m.get('nccl', '-')}",
        f"- {result['world']} rank(s), backend `{result['backend']}`; {result['wall_s']:.0f} s in all; "
        f"**{'all passed' if result['passed'] else 'FAILED'}**",
        "",
        "| section | result | seconds | figures / error |",
        "|---|---|---|---|",
    ]
    for s in result["sections"]:
        detail = json.dumps(s.get("figures", {}), default=str) if s.get("ok") else s.get("error", "")
        lines.append(f"| {s['name']} | {'pass' if s.get('ok') else 'FAIL'} | {s.get('seconds', 0):.1f} | "
                     f"{str(detail).replace('|', '/')[:600]} |")  # fmt: skip
    if result.get("crashed"):
        lines += ["", f"Stopped: {result['crashed']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 gloo ranks, tiny shapes")
    parser.add_argument("--out", type=Path, default=None, help="where gpu.json / gpu.md go")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 2 dry, else one per GPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {list(SECTIONS)}")
    parser.add_argument("--deadline-s", type=float, default=None, help="stop the ranks after this many seconds")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; run with --dry-run to check the sections on CPU", file=sys.stderr)
        return 2
    world = args.world or (2 if args.dry_run else min(torch.cuda.device_count(), 8))
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check_dry-")) if args.dry_run else RESULTS)
    deadline = args.deadline_s or (240.0 if args.dry_run else 540.0)
    result = run(args.dry_run, out, world, names, deadline, timeout_s=60.0 if args.dry_run else 300.0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    (out / "gpu.md").write_text(markdown(result))
    for s in result["sections"]:
        print(f"{'pass' if s.get('ok') else 'FAIL'}  {s['name']:<20} {s.get('seconds', 0):7.1f} s  "
              f"{'' if s.get('ok') else s.get('error', '')}")  # fmt: skip
    print(f"gpu_check: wrote {out / 'gpu.json'} and {out / 'gpu.md'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
