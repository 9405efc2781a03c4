"""``RayExecutor``: the engines' ``Executor`` on a Ray cluster — one controller, three actor groups.

    from dapo_core.distributed import RayExecutor
    with RayExecutor(cfg) as ex:                 # connects (RAY_ADDRESS / resources.ray_address / local)
        results = ex.generate(prompt_ids, sampling)          # rollout workers, data parallel, in order
        scored = ex.score(texts, answers)                     # reward pool, per-item deadline
        batch.old_log_probs, _ = ex.compute_log_probs(batch)  # trainer ranks, row shards
        metrics = ex.update(batch)                            # trainer ranks in lock-step (gloo / NCCL)
        ex.sync_weights()                                     # trainer -> object store -> rollout, by bucket

The same flow code drives ``LocalExecutor`` and ``RayExecutor``; for the same config and seeds the two produce
the same samples and, up to float summation order, the same weights. Paths handed to the executor (model,
checkpoints, exports) are read and written by the actors: on a multi-node cluster they must be on storage every
node sees, as with verl.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from torch import Tensor

from dapo_core.config import DapoConfig
from dapo_core.distributed.cluster import connect
from dapo_core.distributed.cluster import shutdown as ray_shutdown
from dapo_core.distributed.placement import PlacementGroups, cluster_cpus_per_node, plan_placement
from dapo_core.distributed.reward_pool import RewardPool
from dapo_core.distributed.rollout_group import RolloutGroup
from dapo_core.distributed.trainer_group import TrainerGroup
from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.executor import Executor, PendingRollout
from dapo_core.engines.rollout import RolloutResult, SamplingConfig
from dapo_core.engines.rollout.base import WeightSyncStats, backend_shares_policy_model
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.rewards import ScoredBatch

logger = logging.getLogger(__name__)


class TrainerWeights:
    """The trainer ranks as the source of a streamed weight sync (``RolloutGroup.stream_weights``): buckets of
    ``rollout.weight_sync_bucket_mb`` in the dtype the rollout engines run in (``weight_sync_dtype``)."""

    def __init__(self, trainers: TrainerGroup, *, limit_bytes: int, dtype: str | None) -> None:
        self.trainers, self.limit_bytes, self.dtype = trainers, limit_bytes, dtype
        self._plan: list[list[str]] | None = None

    def plan(self) -> list[list[str]]:
        if self._plan is None:  # names and shapes never change during a run
            self._plan = self.trainers.weight_sync_plan(self.limit_bytes, self.dtype)
        return self._plan

    def submit(self, names: list[str]) -> list[Any]:
        return self.trainers.submit_bucket(names, self.dtype)

    def ref(self, pending: list[Any]) -> Any:
        return self.trainers.bucket_ref(pending)


def weight_sync_dtype(cfg: DapoConfig) -> str | None:
    """The dtype weights travel in: a vLLM engine's ``rollout.dtype`` (None for "auto": as the trainer holds them);
    an hf rollout worker's model dtype (it loads the policy in ``model.dtype``)."""
    if cfg.rollout.backend == "vllm":
        return None if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    return cfg.model.dtype


def staged_start(cfg: DapoConfig) -> bool:
    """Whether the trainer ranks must be up and settled before the rollout engines start: when both share GPUs
    (colocated, GPUs configured) and the rollout owns an engine (vLLM), whose start-up memory profiling assumes
    nobody else changes its GPU's usage meanwhile. Elsewhere the groups start in parallel."""
    r = cfg.resources
    owns_engine = not backend_shares_policy_model(cfg.rollout.backend)
    return r.placement == "colocate" and r.n_gpus_per_node > 0 and owns_engine


@dataclass(frozen=True)
class RayOptions:
    """Fault and time limits of the Ray executor (not in the run config yet; these are the defaults)."""

    reward_timeout_s: float = 10.0  # per reward item; an item over it scores -1 and is counted as failed
    max_actor_restarts: int = 3  # Ray restarts of a rollout worker
    max_actor_failures: int = 3  # failures of one actor before the step fails with ActorFailureError
    start_timeout_s: float = 300.0  # actor start / restart (model load) and placement-group reservation

    def __post_init__(self) -> None:
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s ({self.reward_timeout_s}) must be > 0 seconds: use e.g. 10")
        if self.max_actor_failures < 1:
            raise ValueError(f"max_actor_failures ({self.max_actor_failures}) must be >= 1")


def _abs(path: str | Path) -> str:
    """Absolute path: actors do not share the driver's working directory."""
    return str(Path(path).resolve())


def _model_ref(path: str) -> str:
    """A local model directory made absolute; anything else (a hub id) passes through."""
    return _abs(path) if Path(path).exists() else path


class RayExecutor(Executor):
    """Generate / score / log-probs / update / sync / checkpoint on Ray actor groups (see the module docstring)."""

    def __init__(self, cfg: DapoConfig, *, model_path: str | None = None, options: RayOptions | None = None) -> None:
        self.cfg = cfg
        self.options = options or RayOptions()
        self._version = 0
        self.placement: PlacementGroups | None = None
        self.trainers: TrainerGroup | None = None
        self.rollout: RolloutGroup | None = None
        self.rewards: RewardPool | None = None
        self._source: TrainerWeights | None = None
        self._trainer_dirty = False  # the trainer ran since its memory was last released
        self.last_sync: WeightSyncStats | None = None
        path = _model_ref(model_path or cfg.model.path)
        self._tokenizer = load_tokenizer(
            cfg.model.tokenizer_path or path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
        self._owns_ray = not ray.is_initialized()
        try:
            info = connect(cfg.resources)
            tp = cfg.rollout.tensor_parallel_size if cfg.rollout.backend == "vllm" else 1
            plan = plan_placement(cfg.resources, cpus_per_node=cluster_cpus_per_node(), rollout_tp=tp)
            self.placement = PlacementGroups.create(plan, timeout_s=self.options.start_timeout_s)
            self._start_groups(path)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Ray executor up on %d node(s): %d rollout worker(s), %d trainer rank(s), %d reward worker(s), %s",
            info.num_nodes,
            len(self.rollout.actors),
            self.trainers.world_size,
            len(self.rewards.actors),
            cfg.resources.placement,
        )

    def _start_groups(self, path: str) -> None:
        """Start the three actor groups: in parallel, or, when trainer and vLLM share GPUs (``staged_start``), the
        trainer ranks first (model loaded, sharded, cache released) and the engines only then."""
        assert self.placement is not None
        opts = self.options
        self.rewards = RewardPool(  # CPU only: starts alongside either way
            self.cfg.algorithm.reward_fn,
            num_workers=self.cfg.resources.reward_workers,
            item_timeout_s=opts.reward_timeout_s,
            start_timeout_s=opts.start_timeout_s,
        )
        self.trainers = TrainerGroup(self.cfg, path, self.placement, start_timeout_s=opts.start_timeout_s)
        staged = staged_start(self.cfg)
        if staged:
            self.trainers.ready()
            self.trainers.release_memory()  # what vLLM's profiling sees stays put while it starts
            logger.info("colocated GPUs: trainer ranks settled; starting the rollout engines")
        self.rollout = RolloutGroup(
            self.cfg,
            path,
            self.placement,
            max_restarts=opts.max_actor_restarts,
            max_failures=opts.max_actor_failures,
            start_timeout_s=opts.start_timeout_s,
        )
        if not staged:
            self.trainers.ready()
        self.rollout.ready()
        self.rewards.ready()

    # ------------------------------------------------------------------ Executor interface
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        return self._version

    def _groups(self) -> tuple[TrainerGroup, RolloutGroup, RewardPool]:
        if self.trainers is None or self.rollout is None or self.rewards is None:
            raise RuntimeError("this RayExecutor was shut down: create a new one")
        return self.trainers, self.rollout, self.rewards

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> list[RolloutResult]:
        self._release_trainer_memory()
        return self._groups()[1].generate(prompts, sampling, self._version)

    def submit_generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> PendingRollout:
        """The rollout workers start now; the trainer ranks are free for an update until ``result()``."""
        self._release_trainer_memory()
        return PendingRollout(self._groups()[1].submit(prompts, sampling, self._version), self._version)

    def _release_trainer_memory(self) -> None:
        """Before an engine wakes (weight sync, generate): the trainer ranks give their cached GPU memory back, once
        after each training phase. Only where a rollout engine of its own will allocate (vLLM)."""
        if self._trainer_dirty and not backend_shares_policy_model(self.cfg.rollout.backend):
            self._groups()[0].release_memory()
        self._trainer_dirty = False

    def score(self, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch:
        return self._groups()[2].score(completions, ground_truths)

    def _free_rollout_memory(self) -> None:
        """Training phase next: colocated rollout engines release their GPU memory (vLLM sleep). Not for hf, whose
        sleep frees nothing: the call would wait behind a generation in flight (rollout.mode=one_step_off)."""
        owns_engine = not backend_shares_policy_model(self.cfg.rollout.backend)
        if owns_engine and self.cfg.rollout.free_cache_engine and self.cfg.resources.placement == "colocate":
            self._groups()[1].sleep(timeout_s=self.cfg.resources.rollout_sleep_timeout_s)
        self._trainer_dirty = True

    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        self._free_rollout_memory()
        return self._groups()[0].compute_log_probs(batch, with_entropy=with_entropy)

    def update(self, batch: PolicyBatch) -> dict[str, float]:
        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("update() needs batch.advantages and batch.old_log_probs (compute them first)")
        self._free_rollout_memory()
        return self._groups()[0].update(batch)

    def sft_step(self, batch: PolicyBatch) -> dict[str, float]:
        self._free_rollout_memory()
        return self._groups()[0].sft_step(batch)

    def _stream_weights(self, version: int) -> None:
        """The trainer's weights to every rollout worker, bucket by bucket (``RolloutGroup.stream_weights``)."""
        trainers, rollout, _ = self._groups()
        self._release_trainer_memory()  # after the update, before the engines wake their weights
        if self._source is None:
            self._source = TrainerWeights(
                trainers,
                limit_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
                dtype=weight_sync_dtype(self.cfg),
            )
        t0 = time.perf_counter()
        stats = rollout.stream_weights(self._source, version)
        held = [int(s["version"]) for s in stats]
        if any(v != version for v in held):
            raise RuntimeError(f"rollout workers hold weight versions {held} after syncing version {version}")
        self.last_sync = WeightSyncStats(
            version=version,
            tensors=int(stats[0]["tensors"]),
            buckets=int(stats[0]["buckets"]),
            bytes=int(stats[0]["bytes"]),  # what each engine received
            seconds=time.perf_counter() - t0,  # gather + transfer + load, on the controller's clock
        )

    def sync_weights(self) -> int:
        """The trainer ranks' weights -> every rollout worker, streamed by bucket in the rollout dtype; returns
        the version they all hold. ``last_sync`` holds the bytes and seconds."""
        version = self._version + 1
        self._stream_weights(version)
        self._version = version
        return version

    def save_checkpoint(self, root: str | Path, step: int, meta: dict[str, Any]) -> Path:
        trainers = self._groups()[0]
        return trainers.save_checkpoint(_abs(root), step, {**meta, "weight_version": self._version})

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Every rank loads weights + optimizer state; the rollout workers then get the loaded weights."""
        trainers = self._groups()[0]
        meta: dict[str, Any] = trainers.load_checkpoint(_abs(path))
        self._version = int(meta.get("weight_version", self._version))
        self._trainer_dirty = True
        self._stream_weights(self._version)
        return meta

    def export_model(self, path: str | Path) -> Path:
        return Path(self._groups()[0].export_model(_abs(path)))

    # ------------------------------------------------------------------ introspection and teardown
    def placement_report(self) -> dict[str, list[str]]:
        """Node id of every actor, by group (what the multi-node test checks)."""
        trainers, rollout, rewards = self._groups()
        return {
            "rollout": rollout.nodes,
            "trainer": trainers.nodes,
            "reward": [str(a.node.get("node_id")) for a in rewards.actors],
        }

    def phase_spans(self) -> dict[str, list[tuple[str, float, float]]]:
        """Wall-clock (call, start, end) of every rollout worker's generate calls and every trainer rank's updates
        so far: shows whether generation of the next step overlapped an update (``rollout.mode=one_step_off``)."""
        trainers, rollout, _ = self._groups()
        return {
            "rollout": [s for spans in ray.get([a.handle.spans.remote() for a in rollout.actors]) for s in spans],
            "trainer": [s for spans in ray.get([a.handle.spans.remote() for a in trainers.actors]) for s in spans],
        }

    def rollout_versions(self) -> list[int]:
        """Weight version each rollout worker holds (equals ``weight_version`` after every sync)."""
        return self._groups()[1].versions()

    def shutdown(self) -> None:
        """Kill the actors, free the placement groups, and stop Ray if this executor started it."""
        for group in (self.rollout, self.trainers, self.rewards):
            if group is not None:
                try:
                    group.kill()
                except Exception as exc:  # the cluster may already be gone
                    logger.debug("could not kill %s: %s", type(group).__name__, exc)
        self.rollout = self.trainers = self.rewards = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self._owns_ray:
            ray_shutdown()
            self._owns_ray = False
