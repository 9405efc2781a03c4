"""Rollout workers: data-parallel generation over Ray actors, each owning a rollout backend and a model copy.

A worker builds its backend with ``RolloutBackend.from_config``: an ``hf`` worker loads an HF model copy for it;
a ``vllm`` worker loads none (the engine reads ``model_path`` itself, on the worker's GPUs).

A prompt batch is cut into contiguous shards (``split_evenly``); worker k generates its shard with
``prompt_index_offset`` = the shard's start, so every sample is seeded by its global (seed, prompt, sample)
position and the gathered results equal one in-process ``generate`` call (the ``LocalExecutor``'s).

Weights: ``update_weights(state_ref, version)`` hands every worker the trainer's state dict through the Ray
object store (one ``ray.put`` by the trainer, read by each worker). Every ``generate`` states the version it
expects; a worker holding another version (e.g. one Ray restarted between steps, which reloads the base model)
refuses, and the controller re-syncs it and retries its share. A worker that dies mid-call is restarted by Ray
(``max_restarts``), re-synced, and its share retried once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any, Protocol

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from dapo_core.config import DapoConfig
from dapo_core.distributed.faults import ManagedActor, this_node, wait_ready
from dapo_core.distributed.placement import PlacementGroups
from dapo_core.distributed.ranges import split_evenly
from dapo_core.engines.models import load_model, resolve_device
from dapo_core.engines.rollout import RolloutResult, SamplingConfig, get_rollout_backend_cls
from dapo_core.engines.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ROLE = "rollout worker"


class StaleWeightsError(RuntimeError):
    """A rollout worker was asked to generate with a weight version it does not hold."""


class RolloutSleepError(RuntimeError):
    """Colocated engines did not release their GPU memory in time: an update now would overlap them."""


class WeightSource(Protocol):
    """Where a streamed sync reads the weights from (the trainer ranks): a plan of buckets, each gathered on
    demand into the object store (``dapo_core.distributed.executor.TrainerWeights``)."""

    def plan(self) -> list[list[str]]: ...

    def submit(self, names: list[str]) -> Any: ...

    def ref(self, pending: Any) -> Any: ...


class RolloutWorker:
    """Ray actor body: a rollout backend over its own copy of the policy (``ray.remote`` is applied by the group)."""

    def __init__(
        self,
        cfg: DapoConfig,
        model_path: str,
        threads: int,
        engine_bundles: Sequence[int] = (),
        engine_gpu_share: float = 1.0,
    ) -> None:
        """``engine_bundles`` (tensor parallel > 1): bundles of this actor's placement group where vLLM's Ray
        executor puts one worker per TP rank, each taking ``engine_gpu_share`` of a GPU."""
        torch.set_num_threads(max(1, threads))
        backend_cls = get_rollout_backend_cls(cfg.rollout.backend)
        engine_overrides: dict[str, Any] = {}
        if engine_bundles:
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in engine_bundles)
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(engine_gpu_share)
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # this actor holds no GPU; vLLM's workers each get one
            engine_overrides["distributed_executor_backend"] = "ray"
        model = None
        if backend_cls.shares_policy_model:  # hf generates with a module; vllm loads the checkpoint itself
            model = load_model(
                model_path,
                dtype=cfg.model.dtype,
                revision=cfg.model.revision,
                trust_remote_code=cfg.model.trust_remote_code,
                device=resolve_device(cfg.trainer.device),
            )
        tokenizer = load_tokenizer(
            cfg.model.tokenizer_path or model_path,
            revision=cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.backend = backend_cls.from_config(
            cfg, model=model, tokenizer=tokenizer, model_path=model_path, engine_overrides=engine_overrides
        )
        self._exit_on_generate = False
        self._spans: list[tuple[str, float, float]] = []

    def node_info(self) -> dict[str, Any]:
        return this_node()

    def weight_version(self) -> int:
        return self.backend.weight_version

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, offset: int, expected_version: int
    ) -> list[RolloutResult]:
        """Generate a shard whose first prompt is number ``offset`` of the batch, with weights ``expected_version``."""
        if self._exit_on_generate:
            os._exit(1)  # fault injection: die mid-call, as an OOM kill would
        if self.backend.weight_version != expected_version:
            raise StaleWeightsError(
                f"this worker holds weight version {self.backend.weight_version}, the step expects "
                f"{expected_version}: the controller re-syncs the weights and retries"
            )
        start = time.time()
        results = self.backend.generate(prompts, sampling, prompt_index_offset=offset)
        self._spans.append(("generate", start, time.time()))
        return results

    def spans(self) -> list[tuple[str, float, float]]:
        """(call, start, end) wall-clock times of this worker's generate calls (overlap diagnostics, tests)."""
        return list(self._spans)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.backend.update_weights(state_dict, version)
        return self.backend.weight_version

    def begin_weight_update(self, version: int) -> None:
        """A streamed sync starts: the engine wakes only its weights (its KV cache stays released)."""
        self.backend.begin_weight_update(version)

    def load_weight_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        """One bucket of HF-named tensors (Ray resolved its object-store ref); returns the bytes loaded."""
        return self.backend.load_weight_bucket(list(bucket.items()))

    def finish_weight_update(self, version: int) -> dict[str, Any]:
        """The sync's last call: the engine finalises the weights and records ``version``; its figures."""
        return asdict(self.backend.finish_weight_update(version))

    def sleep(self) -> bool:
        """Release the engine's accelerator memory until the next generate (vLLM sleep mode; no-op for hf);
        True when the engine is asleep afterwards."""
        self.backend.sleep()
        return bool(getattr(self.backend, "is_asleep", False))

    def exit_on_next_generate(self) -> None:
        """Fault injection for tests and drills: the next ``generate`` call kills this process."""
        self._exit_on_generate = True


class RolloutGroup:
    """The controller's view of the rollout workers: split, gather in order, sync weights, survive restarts."""

    def __init__(
        self,
        cfg: DapoConfig,
        model_path: str,
        placement: PlacementGroups,
        *,
        max_restarts: int,
        max_failures: int,
        start_timeout_s: float,
    ) -> None:
        plan = placement.plan
        remote_cls = ray.remote(RolloutWorker)
        self.max_failures = max_failures
        self.start_timeout_s = start_timeout_s
        self.actors = [
            ManagedActor(
                ROLE,
                k,
                remote_cls.options(  # type: ignore[attr-defined]
                    num_cpus=plan.rollout_request["num_cpus"],
                    num_gpus=plan.rollout_request["num_gpus"],
                    scheduling_strategy=placement.strategy(slot),
                    max_restarts=max_restarts,
                    max_task_retries=0,  # the group retries, after re-syncing the restarted worker's weights
                ).remote(
                    cfg,
                    model_path,
                    plan.threads,
                    plan.rollout_engine_bundles[k] if plan.rollout_engine_bundles else (),
                    plan.rollout_engine_gpu_share,
                ),
            )
            for k, slot in enumerate(plan.rollout_slots)
        ]
        self._weights: tuple[Any, int] | None = None  # (state-dict ObjectRef, version) of the last full-dict sync
        self._source: tuple[WeightSource, int] | None = None  # (source, version) of the last streamed sync

    def ready(self) -> None:
        """Wait for every worker to load its model (constructors run in parallel with the other groups')."""
        wait_ready(self.actors, self.start_timeout_s)

    @property
    def nodes(self) -> list[str]:
        return [str(a.node.get("node_id")) for a in self.actors]

    def _resync(self, actor: ManagedActor) -> None:
        """Wait for Ray's restart of ``actor`` and put the latest synced weights back on it."""
        actor.wait_alive(self.start_timeout_s)
        if self._source is not None:  # stream the trainer's current weights to this worker alone
            source, version = self._source
            _, failed = self._stream([self.actors.index(actor)], source, version)
            if failed:
                raise next(iter(failed.values()))
        elif self._weights is not None:
            ref, version = self._weights
            ray.get(actor.handle.update_weights.remote(ref, version), timeout=self.start_timeout_s)

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig, version: int) -> list[RolloutResult]:
        """All samples of ``prompts`` in (prompt, sample) order, generated with weights ``version``."""
        return self.submit(prompts, sampling, version)()

    def submit(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, version: int
    ) -> Callable[[], list[RolloutResult]]:
        """Send every worker its shard now; the returned call gathers them in order (retrying a dead worker)."""
        shards = [(k, a, b) for k, (a, b) in enumerate(split_evenly(len(prompts), len(self.actors))) if b > a]
        prompts = [list(p) for p in prompts]
        calls = {k: self._submit(k, prompts[a:b], sampling, a, version) for k, a, b in shards}

        def gather() -> list[RolloutResult]:
            results: list[RolloutResult] = []
            for k, a, b in shards:

                def again(k: int = k, a: int = a, b: int = b) -> Any:
                    return self._submit(k, prompts[a:b], sampling, a, version)

                results.extend(self._gather(k, calls[k], again))
            return results

        return gather

    def _submit(self, k: int, prompts: Sequence[list[int]], sampling: SamplingConfig, offset: int, version: int) -> Any:
        return self.actors[k].handle.generate.remote(list(prompts), sampling, offset, version)

    def _gather(self, k: int, ref: Any, resubmit: Callable[[], Any]) -> Any:
        """``ray.get(ref)``; on death or stale weights: count it, re-sync worker ``k`` and resubmit once."""
        actor = self.actors[k]
        try:
            return ray.get(ref)
        except (RayActorError, StaleWeightsError) as exc:
            actor.record_failure(exc, self.max_failures)  # raises at the limit
        try:
            self._resync(actor)
            return ray.get(resubmit(), timeout=self.start_timeout_s)
        except (RayActorError, StaleWeightsError, GetTimeoutError) as exc:
            actor.record_failure(exc, self.max_failures)
            raise actor.error(
                "its share of the step failed again after a restart", "Check the worker's log and its node"
            ) from exc

    def update_weights(self, state_ref: Any, version: int) -> list[int]:
        """Load the trainer's state dict (an ObjectRef) on every worker; returns the versions they now hold."""
        self._weights, self._source = (state_ref, version), None
        calls = [a.handle.update_weights.remote(state_ref, version) for a in self.actors]
        held = []
        for k, ref in enumerate(calls):

            def again(k: int = k) -> Any:
                return self.actors[k].handle.update_weights.remote(state_ref, version)

            held.append(self._gather(k, ref, again))
        return held

    def stream_weights(self, source: WeightSource, version: int) -> list[dict[str, Any]]:
        """A streamed sync: every worker begins, loads the buckets one by one as the trainer gathers them (bucket
        i+1 is gathered while the engines load bucket i), and finishes; returns each worker's sync figures.

        A worker that dies on the way is restarted by Ray and streamed the weights again on its own."""
        self._source, self._weights = (source, version), None
        stats, failed = self._stream(range(len(self.actors)), source, version)
        for k, exc in failed.items():
            actor = self.actors[k]
            actor.record_failure(exc, self.max_failures)  # raises at the limit
            try:
                self._resync(actor)
            except (RayActorError, GetTimeoutError) as again:
                actor.record_failure(again, self.max_failures)
                raise actor.error("its weight sync failed again after a restart", "Check the worker's log") from again
            stats[k] = ray.get(actor.handle.finish_weight_update.remote(version), timeout=self.start_timeout_s)
        return [stats[k] for k in range(len(self.actors))]

    def _stream(
        self, workers: Iterable[int], source: WeightSource, version: int
    ) -> tuple[dict[int, dict[str, Any]], dict[int, BaseException]]:
        """Stream the source's buckets to ``workers``: (figures by worker, failures by worker)."""
        live = list(workers)
        failed: dict[int, BaseException] = {}
        self._settle({k: self.actors[k].handle.begin_weight_update.remote(version) for k in live}, failed)
        plan = source.plan()
        pending = source.submit(plan[0]) if plan else None
        for i in range(len(plan)):
            ref = source.ref(pending)  # the gather of bucket i is done (a dead trainer rank raises here)
            if i + 1 < len(plan):
                pending = source.submit(plan[i + 1])  # the trainer gathers the next bucket meanwhile
            loads = {k: self.actors[k].handle.load_weight_bucket.remote(ref) for k in live if k not in failed}
            self._settle(loads, failed)
            del ref  # the object store frees the bucket once no worker holds it
        finishes = {k: self.actors[k].handle.finish_weight_update.remote(version) for k in live if k not in failed}
        return self._settle(finishes, failed), failed

    def _settle(self, calls: dict[int, Any], failed: dict[int, BaseException]) -> dict[int, Any]:
        """``ray.get`` each worker's call; a dead worker goes to ``failed`` (other errors propagate)."""
        out = {}
        for k, ref in calls.items():
            try:
                out[k] = ray.get(ref)
            except RayActorError as exc:
                failed[k] = exc
        return out

    def sleep(self, timeout_s: float | None = None) -> None:
        """Put every worker's engine to sleep before a training phase (colocated GPUs).

        The call waits behind a generation in flight (``rollout.mode=one_step_off``), up to ``timeout_s`` (default
        the start timeout). Past it, ``RolloutSleepError``: an update now would run while vLLM still holds its
        memory. A worker that died restarts with its engine awake, so it is put to sleep again after the restart.
        """
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        calls = [a.handle.sleep.remote() for a in self.actors]
        for actor, ref in zip(self.actors, calls, strict=True):
            try:
                ray.get(ref, timeout=timeout_s)
            except GetTimeoutError as exc:
                raise RolloutSleepError(
                    f"{actor.label} did not release its GPU memory within {timeout_s:.0f} s (its engine is still "
                    "generating or stuck), so the update cannot start without overlapping it. Raise "
                    "resources.rollout_sleep_timeout_s, lower the generation batch (data.gen_batch_size) or "
                    "rollout.max_staleness, or use resources.placement=split"
                ) from exc
            except RayActorError as exc:  # Ray restarts it awake, holding the GPU memory again
                actor.record_failure(exc, self.max_failures)
                logger.warning("%s died before going to sleep: %s; putting its restart to sleep", actor.label, exc)
                self._resync(actor)
                ray.get(actor.handle.sleep.remote(), timeout=timeout_s)

    def versions(self) -> list[int]:
        return ray.get([a.handle.weight_version.remote() for a in self.actors])

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor.handle, no_restart=True)
