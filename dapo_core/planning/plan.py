"""The plan: every figure for one config on one cluster, and the verdict (problems, each with the knob to change).

    plan = make_plan(cfg, Hardware(nodes=16, gpus_per_node=8, gpu_mem=80 * GIB))
    plan.fits, plan.problems, plan.warnings

A problem is something that will not run (out of GPU memory, not enough GPUs, no KV cache for one sequence, over
the stated host memory or disk); a warning is something that runs but costs (fewer sequences in flight than a
generation batch asks, unbounded checkpoint retention). Memory in GiB (2^30 bytes) throughout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dapo_core.planning.arch import Arch, param_count, resolve_arch
from dapo_core.planning.disk import DiskFigures, disk_figures
from dapo_core.planning.rollout_memory import (
    VLLM_ASLEEP_BYTES,
    StepFigures,
    VllmGpu,
    step_figures,
    vllm_gpu,
)
from dapo_core.planning.trainer_memory import TrainerGpu, trainer_gpu

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

GIB = 1 << 30
TRAINER_CONTEXT_BYTES = GIB  # CUDA context + NCCL buffers + allocator slack of a trainer rank (estimate)
DEFAULT_GPU_MEM_GIB = 80.0
DEFAULT_SYNC_GBPS = 10.0  # GB/s (1e9 bytes) for the bytes path (Ray object store over the network): an assumption
GPU_MEM_ENV = "DAPO_PLAN_GPU_MEM_GB"


def gib(n: float) -> str:
    """Bytes as GiB (MiB below 1 GiB, so that the CPU recipes' figures are readable)."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_mem: int  # bytes per GPU
    host_mem: int | None = None  # bytes per node; None: reported, not checked
    disk: int | None = None  # bytes for outputs/; None: reported, not checked
    sync_gbps: float = DEFAULT_SYNC_GBPS

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Plan:
    recipe: str
    arch: Arch
    params: int
    hw: Hardware
    on_gpu: bool
    trainer: TrainerGpu
    vllm: VllmGpu | None
    colocated: bool
    step: StepFigures
    disk: DiskFigures
    host_per_node: int
    trainer_available: int  # GPU bytes the trainer may use (after contexts and a sleeping / awake vLLM)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def default_hardware(cfg: DapoConfig, **given: float | int | None) -> Hardware:
    """Hardware from the config (nodes, GPUs per node) and the given overrides (None = default)."""
    res = cfg.resources
    gpu_mem = given.get("gpu_mem_gib") or float(os.environ.get(GPU_MEM_ENV, DEFAULT_GPU_MEM_GIB))
    host, disk = given.get("host_mem_gib"), given.get("disk_gib")
    return Hardware(
        nodes=int(given.get("nodes") or res.nnodes),
        gpus_per_node=int(res.n_gpus_per_node if given.get("gpus_per_node") is None else given["gpus_per_node"]),  # type: ignore[arg-type]
        gpu_mem=int(gpu_mem * GIB),
        host_mem=None if host is None else int(host * GIB),
        disk=None if disk is None else int(disk * GIB),
        sync_gbps=float(given.get("sync_gbps") or DEFAULT_SYNC_GBPS),
    )


def _host_per_node(cfg: DapoConfig, p: Plan) -> int:
    """Node 0's host memory: offloaded trainer state of its ranks, sleeping vLLM weights, rank 0's full fp32
    model while it loads (fsdp2 rank-0 loading, once at start-up)."""
    ranks = min(p.hw.gpus_per_node, cfg.resources.trainer_world_size) if p.on_gpu else 1
    total = ranks * p.trainer.host
    if p.vllm is not None and p.colocated and cfg.rollout.free_cache_engine:
        total += p.hw.gpus_per_node * p.vllm.weights
    if cfg.trainer.strategy == "fsdp2":
        total += p.params * 4
    return total


def _trainer_available(cfg: DapoConfig, p: Plan) -> int:
    """The GPU bytes a trainer rank may use during its update."""
    avail = p.hw.gpu_mem - TRAINER_CONTEXT_BYTES
    if p.vllm is not None and p.colocated:
        avail -= VLLM_ASLEEP_BYTES if cfg.rollout.free_cache_engine else p.vllm.budget
    return avail


def make_plan(cfg: DapoConfig, hw: Hardware, *, model_config: str | os.PathLike | None = None) -> Plan:
    """Every figure of ``cfg`` on ``hw``, and its problems and warnings."""
    from dapo_core.planning.verdict import check

    arch = resolve_arch(cfg, model_config)
    on_gpu = hw.gpus_per_node > 0
    world = cfg.resources.trainer_world_size
    vllm = vllm_gpu(cfg, arch, gpu_mem=hw.gpu_mem) if on_gpu and cfg.rollout.backend == "vllm" else None
    p = Plan(
        recipe=cfg.recipe,
        arch=arch,
        params=param_count(arch),
        hw=hw,
        on_gpu=on_gpu,
        trainer=trainer_gpu(cfg, arch, world=world),
        vllm=vllm,
        colocated=cfg.resources.placement == "colocate",
        step=step_figures(cfg, arch, gbps=hw.sync_gbps),
        disk=disk_figures(cfg, arch),
        host_per_node=0,
        trainer_available=0,
    )
    p.host_per_node = _host_per_node(cfg, p)
    p.trainer_available = _trainer_available(cfg, p)
    check(cfg, p)
    return p
