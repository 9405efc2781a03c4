"""The plan's verdict: one line per limit hit, "what is over, by how much, which knob fixes it"."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dapo_core.planning.plan import TRAINER_CONTEXT_BYTES, gib

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig
    from dapo_core.planning.plan import Plan


def check(cfg: DapoConfig, p: Plan) -> None:
    """Fill ``p.problems`` and ``p.warnings``; GPU limits only when the plan runs on GPUs."""
    if p.on_gpu:
        _gpu_counts(cfg, p)
        _trainer_fits(cfg, p)
        if p.vllm is not None:
            _vllm_fits(cfg, p)
    if p.hw.host_mem is not None and p.host_per_node > p.hw.host_mem:
        p.problems.append(
            f"host memory per node: {gib(p.host_per_node)} needed > {gib(p.hw.host_mem)} (over by "
            f"{gib(p.host_per_node - p.hw.host_mem)}): set trainer.fsdp.cpu_offload=false if the GPUs have room, "
            "or spread the ranks over more nodes (resources.nnodes)"
        )
    d = p.disk
    if p.hw.disk is not None and d.run_total > p.hw.disk:
        keep = max(1, (p.hw.disk - d.final_copies * d.hf_bytes) // max(1, d.per_checkpoint))
        p.problems.append(
            f"disk: {gib(d.run_total)} over the run > {gib(p.hw.disk)} (over by {gib(d.run_total - p.hw.disk)}): "
            f"set trainer.max_ckpt_to_keep={keep} (each checkpoint {gib(d.per_checkpoint)})"
        )
    if d.unbounded and d.saves > 1:
        p.warnings.append(
            f"trainer.max_ckpt_to_keep is null: all {d.saves} checkpoints stay on disk ({gib(d.saves * d.per_checkpoint)}"
            f"); set trainer.max_ckpt_to_keep (e.g. 2: {gib(min(2, d.saves) * d.per_checkpoint)})"
        )


def _gpu_counts(cfg: DapoConfig, p: Plan) -> None:
    res, total = cfg.resources, p.hw.gpus
    rollout_gpus = res.rollout_workers * cfg.rollout.tensor_parallel_size if p.vllm is not None else 0
    if p.colocated:
        for what, n, knob in (
            ("trainer ranks", res.trainer_world_size, "resources.trainer_world_size"),
            ("rollout GPUs (engines x TP)", rollout_gpus, "resources.rollout_workers"),
        ):
            if n > total:
                p.problems.append(f"{what}: {n} > {total} GPUs (over by {n - total}): lower {knob} or add GPUs")
    elif res.trainer_world_size + rollout_gpus > total:
        need = res.trainer_world_size + rollout_gpus
        p.problems.append(
            f"GPUs: split placement needs {need} (trainer {res.trainer_world_size} + rollout {rollout_gpus}) > "
            f"{total} (over by {need - total}): lower resources.trainer_world_size or resources.rollout_workers, "
            "or use resources.placement=colocate"
        )


def _trainer_knobs(cfg: DapoConfig, p: Plan) -> list[str]:
    """The knobs that would shrink the trainer's peak, biggest lever first."""
    t, acts, knobs = cfg.trainer, p.trainer.activations, []
    if t.strategy == "fsdp2" and not t.fsdp.cpu_offload and p.trainer.resident:
        knobs.append(f"trainer.fsdp.cpu_offload=true (moves {gib(p.trainer.resident)} of state to host)")
    if t.strategy == "fsdp2" and cfg.resources.trainer_world_size < p.hw.gpus:
        knobs.append(f"resources.trainer_world_size={p.hw.gpus} (shards the state over every GPU)")
    if t.strategy == "ddp":
        knobs.append("trainer.strategy=fsdp2 (shards the state)")
    if not cfg.model.gradient_checkpointing:
        knobs.append(f"model.gradient_checkpointing=true (activations {gib(acts.layers_total)} now)")
    if t.micro_batch_size > 1:
        knobs.append(f"trainer.micro_batch_size={max(1, t.micro_batch_size // 2)} (activation peak {gib(acts.peak)})")
    return knobs or ["a GPU with more memory, or shorter data.max_response_length"]


def _trainer_fits(cfg: DapoConfig, p: Plan) -> None:
    need, avail = p.trainer.peak, p.trainer_available
    if need > avail:
        p.problems.append(
            f"trainer GPU memory: peak {gib(need)} > {gib(avail)} available (over by {gib(need - avail)}): set "
            + ", or ".join(_trainer_knobs(cfg, p))
        )


def _vllm_fits(cfg: DapoConfig, p: Plan) -> None:
    v, ro = p.vllm, cfg.rollout
    assert v is not None
    if p.colocated:
        beside = p.trainer.resident + TRAINER_CONTEXT_BYTES
        if v.budget + beside > p.hw.gpu_mem:
            most = max(0.0, math.floor(100 * (p.hw.gpu_mem - beside) / p.hw.gpu_mem) / 100)  # rounded down
            p.problems.append(
                f"colocated vLLM awake: gpu_memory_utilization share {gib(v.budget)} + trainer resident "
                f"{gib(beside)} > {gib(p.hw.gpu_mem)} (over by {gib(v.budget + beside - p.hw.gpu_mem)}): set "
                f"rollout.gpu_memory_utilization<={most:.2f}, or trainer.fsdp.cpu_offload=true"
            )
    if v.seqs_fit < 1:
        short = v.kv_bytes_per_token * v.max_model_len - max(0, v.kv_cache)
        p.problems.append(
            f"vLLM KV cache: {gib(max(0, v.kv_cache))} holds no sequence of {v.max_model_len} tokens (short by "
            f"{gib(short)}): raise rollout.tensor_parallel_size (now {ro.tensor_parallel_size}) or "
            f"rollout.gpu_memory_utilization (now {ro.gpu_memory_utilization})"
        )
    elif v.seqs_fit < v.seqs_asked:
        p.warnings.append(
            f"vLLM KV cache holds {v.seqs_fit} full-length sequences per engine, a generation batch asks "
            f"{v.seqs_asked}: the rest queue (slower, not an error); raise rollout.gpu_memory_utilization or "
            "rollout.tensor_parallel_size for more in flight"
        )
