"""Placement: which bundle of which placement group each rollout worker and trainer rank lives on.

``plan_placement`` is pure (config in, ``PlacementPlan`` out) so its rules are unit-tested without Ray;
``PlacementGroups.create`` reserves the bundles on the cluster. As in verl's resource pools there is one
placement group per node (``STRICT_PACK``), each a full node's worth of bundles, so the groups land on different
nodes and the bundle a rank sits on fixes its node.

- GPU (``n_gpus_per_node > 0``): one bundle per GPU, ``{"GPU": 1, "CPU": cpus_per_node // n_gpus_per_node}``.
  ``colocate`` (verl's hybrid engine): trainer rank i and rollout worker i share bundle i, half a GPU each, and
  take turns (generation, then training). ``split``: separate groups for trainer ranks and rollout engines; a
  rollout engine reserves ``rollout.tensor_parallel_size`` bundles and sits on the first.
- CPU: bundles of ``cpus_per_node // bundles_per_node`` CPUs. ``colocate``: ``max(trainer ranks, rollout
  workers)`` bundles shared as above; ``split``: one bundle per actor. An actor runs ``torch`` with as many
  threads as its bundle has CPUs (colocated actors take turns, so they do not oversubscribe).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dapo_core.config.schema import ResourcesConfig

logger = logging.getLogger(__name__)

ROLLOUT = "rollout"
TRAINER = "trainer"
SHARED = "shared"


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: bundle ``bundle`` of the ``group``'s placement group number ``pg``."""

    group: str
    pg: int
    bundle: int


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles to reserve and each actor's slot and resource request (see the module docstring)."""

    placement: str  # colocate | split
    use_gpu: bool
    bundles: dict[str, list[list[dict[str, float]]]]  # group -> one bundle list per placement group (per node)
    rollout_slots: list[Slot]
    trainer_slots: list[Slot]
    rollout_request: dict[str, float]  # num_cpus / num_gpus of one rollout worker inside its bundle
    trainer_request: dict[str, float]
    threads: int  # torch threads per actor
    strategy: str = "STRICT_PACK"
    notes: list[str] = field(default_factory=list)
    # tensor-parallel engines (rollout TP > 1): per rollout worker, the bundles (of its slot's placement group)
    # its vLLM workers occupy, and the GPU share each of them takes; empty when TP = 1 (the actor holds the GPU)
    rollout_engine_bundles: list[list[int]] = field(default_factory=list)
    rollout_engine_gpu_share: float = 0.0

    @property
    def total_bundles(self) -> int:
        return sum(len(b) for pgs in self.bundles.values() for b in pgs)


def _per_node(groups: str, count: int, per_node: int, bundle: dict[str, float]) -> tuple[list[list[dict]], list]:
    """``count`` bundles packed ``per_node`` to a placement group; returns (bundles per pg, slot per bundle)."""
    pgs: list[list[dict[str, float]]] = []
    slots = []
    for g in range(count):
        if g % per_node == 0:
            pgs.append([])
        pgs[-1].append(dict(bundle))
        slots.append(Slot(groups, len(pgs) - 1, len(pgs[-1]) - 1))
    return pgs, slots


def plan_placement(resources: ResourcesConfig, *, cpus_per_node: int, rollout_tp: int = 1) -> PlacementPlan:
    """Bundles and slots for ``resources`` on nodes with ``cpus_per_node`` CPUs (rollout TP ``rollout_tp``).

    Raises:
        ValueError: the GPUs of ``nnodes x n_gpus_per_node`` cannot hold the requested ranks and engines.
    """
    if cpus_per_node < 1:
        raise ValueError(f"cpus_per_node ({cpus_per_node}) must be >= 1: the cluster has no schedulable CPU")
    world, workers, colocate = (
        resources.trainer_world_size,
        resources.rollout_workers,
        resources.placement == "colocate",
    )
    use_gpu = resources.n_gpus_per_node > 0
    if use_gpu:
        return _plan_gpu(resources, cpus_per_node, rollout_tp, world, workers, colocate)
    need = max(world, workers) if colocate else world + workers
    per_node = math.ceil(need / resources.nnodes)
    cpus = max(1, cpus_per_node // per_node)
    bundle = {"CPU": float(cpus)}
    share = 0.5 if colocate else 1.0
    if colocate:
        pgs, slots = _per_node(SHARED, need, per_node, bundle)
        bundles, trainer_slots, rollout_slots = {SHARED: pgs}, slots[:world], slots[:workers]
    else:
        t_pgs, trainer_slots = _per_node(TRAINER, world, per_node, bundle)
        r_pgs, rollout_slots = _per_node(ROLLOUT, workers, per_node, bundle)
        bundles = {TRAINER: t_pgs, ROLLOUT: r_pgs}
    request = {"num_cpus": cpus * share, "num_gpus": 0.0}
    return PlacementPlan(
        placement=resources.placement,
        use_gpu=False,
        bundles=bundles,
        rollout_slots=rollout_slots,
        trainer_slots=trainer_slots,
        rollout_request=dict(request),
        trainer_request=dict(request),
        threads=cpus,
    )


def _plan_gpu(
    resources: ResourcesConfig, cpus_per_node: int, tp: int, world: int, workers: int, colocate: bool
) -> PlacementPlan:
    gpus_per_node, total = resources.n_gpus_per_node, resources.nnodes * resources.n_gpus_per_node
    rollout_gpus = workers * tp
    if colocate and max(world, rollout_gpus) > total:
        raise ValueError(
            f"colocated placement needs max(trainer_world_size ({world}), rollout_workers x tensor_parallel_size "
            f"({workers} x {tp})) <= GPUs ({resources.nnodes} x {gpus_per_node} = {total}): lower them or add GPUs"
        )
    if not colocate and world + rollout_gpus > total:
        raise ValueError(
            f"split placement needs trainer_world_size + rollout_workers x tensor_parallel_size "
            f"({world} + {workers} x {tp}) <= GPUs ({resources.nnodes} x {gpus_per_node} = {total}): "
            "lower them, add GPUs, or use resources.placement=colocate"
        )
    if tp > 1 and gpus_per_node % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size ({tp}) must divide resources.n_gpus_per_node ({gpus_per_node}): a vLLM "
            f"engine's tensor-parallel group stays on one node; pick a divisor such as "
            + " or ".join(str(d) for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0)
        )
    cpus = max(1, cpus_per_node // gpus_per_node)
    bundle = {"GPU": 1.0, "CPU": float(cpus)}
    if colocate:
        pgs, slots = _per_node(SHARED, max(world, rollout_gpus), gpus_per_node, bundle)
        bundles = {SHARED: pgs}
        trainer_slots, rollout_slots = slots[:world], [slots[w * tp] for w in range(workers)]
        share = 0.5
    else:
        t_pgs, trainer_slots = _per_node(TRAINER, world, gpus_per_node, bundle)
        r_pgs, r_slots = _per_node(ROLLOUT, rollout_gpus, gpus_per_node, bundle)
        bundles, rollout_slots, share = {TRAINER: t_pgs, ROLLOUT: r_pgs}, [r_slots[w * tp] for w in range(workers)], 1.0
    request = {"num_cpus": cpus * share, "num_gpus": share}
    rollout_request, engine_bundles, notes = dict(request), [], []
    if tp > 1:
        # vLLM's Ray executor starts one worker per TP rank on the engine's bundles (VLLM_RAY_BUNDLE_INDICES),
        # each taking the GPU share; the driver actor itself holds no GPU.
        rollout_request["num_gpus"] = 0.0
        engine_bundles = [list(range(slot.bundle, slot.bundle + tp)) for slot in rollout_slots]
        notes = [f"rollout engines span {tp} bundles each: the worker actor sits on the first, vLLM's workers on all"]
    return PlacementPlan(
        placement=resources.placement,
        use_gpu=True,
        bundles=bundles,
        rollout_slots=rollout_slots,
        trainer_slots=trainer_slots,
        rollout_request=rollout_request,
        trainer_request=dict(request),
        threads=cpus,
        notes=notes,
        rollout_engine_bundles=engine_bundles,
        rollout_engine_gpu_share=share if tp > 1 else 0.0,
    )


def cluster_cpus_per_node() -> int:
    """CPUs of the smallest alive node that has any (a head started with ``--num-cpus 0`` is skipped)."""
    counts = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    counts = [c for c in counts if c > 0]
    return min(counts) if counts else 0


class PlacementGroups:
    """The reserved placement groups of a plan; ``strategy(slot)`` schedules an actor onto its bundle."""

    def __init__(self, plan: PlacementPlan, groups: dict[str, list[PlacementGroup]]) -> None:
        self.plan = plan
        self.groups = groups

    @classmethod
    def create(cls, plan: PlacementPlan, *, timeout_s: float = 120.0) -> PlacementGroups:
        """Reserve every bundle of ``plan``; raise a clear error if the cluster cannot hold them in time."""
        groups = {
            name: [placement_group(b, strategy=plan.strategy) for b in per_pg] for name, per_pg in plan.bundles.items()
        }
        made = cls(plan, groups)
        pending = [pg.ready() for pgs in groups.values() for pg in pgs]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        if len(ready) < len(pending):
            made.remove()
            raise RuntimeError(
                f"placement groups not ready after {timeout_s:.0f} s: the plan needs {plan.total_bundles} bundles "
                f"{_describe(plan)} but the cluster has {dict(ray.available_resources())} available. Lower "
                "resources.trainer_world_size / rollout_workers, raise resources.num_cpus, or add nodes"
            )
        return made

    def strategy(self, slot: Slot) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[slot.group][slot.pg], placement_group_bundle_index=slot.bundle
        )

    def remove(self) -> None:
        for pgs in self.groups.values():
            for pg in pgs:
                try:
                    remove_placement_group(pg)
                except Exception as exc:  # already removed or cluster gone: nothing left to free
                    logger.debug("could not remove placement group: %s", exc)
        self.groups = {}


def _describe(plan: PlacementPlan) -> str:
    parts: list[Any] = []
    for name, per_pg in plan.bundles.items():
        parts.append(f"{name}: {len(per_pg)} group(s) of {[len(b) for b in per_pg]} x {per_pg[0][0]}")
    return "(" + "; ".join(parts) + ")"
