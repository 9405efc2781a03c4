"""Trainer ranks: N Ray actors forming one ``torch.distributed`` group, each running ``PolicyTrainer``.

Rank 0 publishes the rendezvous address (its node IP and a free port); every rank then joins with
``init_process_group`` (NCCL on GPU, gloo on CPU). The ``PolicyTrainer`` already all-reduces the loss
denominators and the gradients when a group is initialised, so the ranks only need their shards
(``shard_for_update``: whole prompt groups of every mini-batch) and to be called together: every collective
call happens on every rank, in the same order.

With ``trainer.strategy=fsdp2`` every rank builds the architecture on the meta device and only rank 0 reads the
fp32 master weights (on CPU); once the process group exists (also for a world of one) the skeleton is sharded
(``dapo_core.engines.fsdp.apply_fsdp2``) and each rank allocates just its shards, filled by a broadcast from rank 0
(``dapo_core.engines.fsdp_init``): host memory is one full copy per cluster, not one per rank. Then *every* call that touches the model is a collective, made on every rank: log-probs (every rank gets a
row shard, possibly only a masked dummy), ``state_dict`` (gathered on rank 0 for the weight sync), checkpoints
(every rank writes its shard under ``shards/``, rank 0 the HF files and metadata), loading and export.

Trainer ranks are not restarted: a dead rank takes the process group and the optimizer state with it, so the
step fails with an error naming the rank, its node and the cause (resume from the last checkpoint).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from dapo_core.config import DapoConfig
from dapo_core.distributed.faults import ManagedActor, describe, this_node, wait_ready
from dapo_core.distributed.placement import PlacementGroups
from dapo_core.distributed.sharding import shard_for_update, shard_rows
from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.checkpoint import load_checkpoint, save_checkpoint
from dapo_core.engines.executor import (
    load_policy_model,
    loss_config_from,
    policy_state_dict,
    policy_trainer_from,
)
from dapo_core.engines.fsdp import (
    FsdpSettings,
    apply_fsdp2,
    export_hf_dir,
    full_state_dict,
    load_fsdp_checkpoint,
    save_fsdp_checkpoint,
)
from dapo_core.engines.fsdp_init import load_master_on_rank0, materialize_from_rank0
from dapo_core.engines.memory import release_cached_memory
from dapo_core.engines.models import DTYPES, resolve_device, save_hf_dir
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.engines.trainer import PolicyTrainer, short_mini_batch_scales
from dapo_core.engines.weight_buckets import gather_bucket, ship_dtype, sync_plan

logger = logging.getLogger(__name__)

ROLE = "trainer rank"
# TrainerRank methods that every rank must join under FSDP2 (besides update / sft_step / compute_log_probs)
_COLLECTIVE_UNDER_FSDP = frozenset(
    {"state_dict", "save_checkpoint", "load_checkpoint", "export_model", "gather_weight_bucket"}
)


class TrainerRank:
    """Ray actor body: one data-parallel rank of the policy trainer (``ray.remote`` is applied by the group)."""

    def __init__(self, cfg: DapoConfig, model_path: str, rank: int, world_size: int, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.cfg = cfg
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(cfg.trainer.device)
        self.fsdp = cfg.trainer.strategy == "fsdp2"
        self._trainer: PolicyTrainer | None = None
        self.model: Any  # an HF causal LM; under FSDP2 also an FSDPModule once sharded
        self._full: Any = None  # FSDP2: rank 0's full fp32 model on CPU until the shards are filled from it
        if self.fsdp:  # a meta skeleton on every rank; sharded and filled from rank 0 once the group exists
            m = cfg.model
            self.model, self._full = load_master_on_rank0(
                model_path, rank=rank, revision=m.revision, trust_remote_code=m.trust_remote_code
            )
        else:
            self.model = load_policy_model(cfg, model_path, self.device)
            self._trainer = policy_trainer_from(cfg, self.model, self.device)
        self.loss_cfg = loss_config_from(cfg)
        self._tokenizer: Any = None
        self._spans: list[tuple[str, float, float]] = []

    @property
    def trainer(self) -> PolicyTrainer:
        if self._trainer is None:
            raise RuntimeError(
                f"trainer rank {self.rank} (trainer.strategy=fsdp2) has no trainer before init_process_group: "
                "call TrainerGroup.ready() first"
            )
        return self._trainer

    @property
    def model_dtype(self) -> torch.dtype:
        """The configured model dtype: what weight syncs, checkpoints' HF files and exports are written in."""
        dtype = DTYPES[self.cfg.model.dtype]
        assert isinstance(dtype, torch.dtype)
        return dtype

    def node_info(self) -> dict[str, Any]:
        return this_node()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free TCP port for ``init_process_group``."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, address: str, port: int, timeout_s: float) -> str:
        """Join the group; ``timeout_s`` is the collectives' timeout (``resources.collective_timeout_s``: also how
        long the others wait while rank 0 writes an export or checkpoint), not the actor start timeout. The backend
        is ``cpu:gloo,cuda:nccl`` on GPU (CPU-offloaded gradients, rank-0 broadcasts of CPU shards and the
        write barrier go over gloo) and ``gloo`` on CPU: see ``dapo_core.engines.dist_setup``."""
        from dapo_core.engines.dist_setup import init_process_group_kwargs

        kwargs = init_process_group_kwargs(
            self.device.type,
            address=address,
            port=port,
            rank=self.rank,
            world_size=self.world_size,
            collective_timeout_s=timeout_s,
        )
        backend: str = kwargs["backend"]
        if self.device.type == "cuda":  # the GPU Ray gave this actor (index 0 of its CUDA_VISIBLE_DEVICES): FSDP's
            torch.cuda.set_device(self.device.index or 0)  # mesh and NCCL use the current device
        dist.init_process_group(**kwargs)
        logger.info(
            "trainer rank %d joined the group (%s, collective timeout %s)",
            self.rank,
            backend,
            timedelta(seconds=timeout_s),
        )
        if self.fsdp:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            settings = FsdpSettings.from_config(self.cfg.trainer.fsdp)
            self.model = apply_fsdp2(
                self.model, settings, mesh=mesh, gradient_checkpointing=self.cfg.model.gradient_checkpointing
            )
            # only this rank's shards are allocated; rank 0 broadcasts the weights (and buffers) into them
            param_device = torch.device("cpu") if settings.cpu_offload else self.device
            materialize_from_rank0(self.model, self._full, device=param_device, buffer_device=self.device)
            self._full = None
            self._trainer = policy_trainer_from(self.cfg, self.model, self.device)  # optimizer over the shards
        return backend

    def compute_log_probs(self, batch: PolicyBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        return self.trainer.compute_log_probs(batch, with_entropy=with_entropy)

    def update(self, shard: PolicyBatch, mini_batch_scales: list[float] | None = None) -> dict[str, float]:
        # the shard holds one relabelled "group" per mini-batch (see sharding.shard_for_update), so the short
        # last mini-batch's lr scale comes from the whole batch (TrainerGroup.update)
        start = time.time()
        metrics = self.trainer.update(
            shard,
            self.loss_cfg,
            ppo_epochs=self.cfg.trainer.ppo_epochs,
            mini_batch_groups=1,
            mini_batch_scales=mini_batch_scales,
        )
        self._spans.append(("update", start, time.time()))
        return metrics

    def spans(self) -> list[tuple[str, float, float]]:
        """(call, start, end) wall-clock times of this rank's updates (overlap diagnostics, tests)."""
        return list(self._spans)

    def sft_step(self, shard: PolicyBatch) -> dict[str, float]:
        return self.trainer.sft_step(shard)

    def state_dict(self) -> dict[str, Tensor]:
        """The weights as CPU tensors. Under FSDP2 a collective: rank 0 gets the full dict, the others ``{}``."""
        if self.fsdp:
            return full_state_dict(self.model, dtype=self.model_dtype)
        return policy_state_dict(self.model)

    def global_step(self) -> int:
        return self.trainer.global_step

    def _tok(self) -> Any:
        if self._tokenizer is None:
            m = self.cfg.model
            self._tokenizer = load_tokenizer(
                m.tokenizer_path or self.model_path, revision=m.revision, trust_remote_code=m.trust_remote_code
            )
        return self._tokenizer

    def save_checkpoint(self, root: str, step: int, meta: dict[str, Any]) -> str:
        if self.fsdp:  # collective: shards from every rank, the rest from rank 0
            return str(
                save_fsdp_checkpoint(
                    root,
                    step,
                    model=self.model,
                    optimizer=self.trainer.optimizer,
                    trainer_state=self.trainer.state_dict(),
                    meta=meta,
                    tokenizer=self._tok() if self.rank == 0 else None,
                    max_to_keep=self.cfg.trainer.max_ckpt_to_keep,
                    dtype=self.model_dtype,
                )
            )
        path = save_checkpoint(
            root,
            step,
            model=self.model,
            tokenizer=self._tok(),
            trainer_state=self.trainer.state_dict(),
            meta=meta,
            max_to_keep=self.cfg.trainer.max_ckpt_to_keep,
        )
        return str(path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        if self.fsdp:  # collective
            loaded = load_fsdp_checkpoint(path, model=self.model, optimizer=self.trainer.optimizer)
        else:
            loaded = load_checkpoint(path, model=self.model)
        self.trainer.load_state_dict(loaded.trainer_state)
        return loaded.meta

    def export_model(self, path: str) -> str:
        if self.fsdp:  # collective: gathered on rank 0, which writes
            tokenizer = self._tok() if self.rank == 0 else None
            return str(export_hf_dir(self.model, tokenizer, path, dtype=self.model_dtype))
        return str(save_hf_dir(self.model, self._tok(), path))

    # ------------------------------------------------------------------ colocated memory and streamed weight sync
    def release_memory(self) -> dict[str, Any]:
        """After an update, before a colocated engine wakes: give the allocator's cached blocks back."""
        return asdict(release_cached_memory(f"trainer rank {self.rank}"))

    def weight_sync_plan(self, limit_bytes: int, dtype: str | None) -> list[list[str]]:
        """The sync's buckets (names), the same on every rank (``weight_buckets.sync_plan``)."""
        return sync_plan(self.model, limit_bytes=limit_bytes, dtype=ship_dtype(dtype))

    def gather_weight_bucket(self, names: list[str], dtype: str | None) -> list[Any]:
        """One bucket of full CPU tensors in ``dtype``, put in the object store by rank 0: ``[ref]`` there, ``[]``
        elsewhere (under FSDP2 a collective). The ref is wrapped in a list so the controller receives the small ref,
        not the bucket: the rollout workers read the bucket from the object store themselves."""
        bucket = gather_bucket(self.model, names, dtype=ship_dtype(dtype), rank=self.rank)
        return [] if bucket is None else [ray.put(bucket)]


class TrainerGroup:
    """The controller's view of the trainer ranks: shard, call every rank together, gather."""

    def __init__(self, cfg: DapoConfig, model_path: str, placement: PlacementGroups, *, start_timeout_s: float) -> None:
        plan = placement.plan
        world = len(plan.trainer_slots)
        remote_cls = ray.remote(TrainerRank)
        self.cfg = cfg
        self.actors = [
            ManagedActor(
                ROLE,
                rank,
                remote_cls.options(  # type: ignore[attr-defined]
                    num_cpus=plan.trainer_request["num_cpus"],
                    num_gpus=plan.trainer_request["num_gpus"],
                    scheduling_strategy=placement.strategy(slot),
                    max_restarts=0,  # a restarted rank would have lost the group and the optimizer state
                ).remote(cfg, model_path, rank, world, plan.threads),
            )
            for rank, slot in enumerate(plan.trainer_slots)
        ]
        self.start_timeout_s = start_timeout_s
        self.backend = "none"
        self.fsdp = cfg.trainer.strategy == "fsdp2"  # every model call goes to every rank (collectives)

    def ready(self) -> None:
        """Wait for every rank to load its model, then form the process group (rank 0 publishes the address)."""
        wait_ready(self.actors, self.start_timeout_s)
        world = self.world_size
        # the collectives' own timeout, not the start timeout: the other ranks wait in one while rank 0 alone writes
        # an HF export or a checkpoint (minutes at 32B), and the NCCL watchdog aborts past it
        collective_timeout_s = self.cfg.resources.collective_timeout_s
        if world > 1 or self.fsdp:  # FSDP2 needs a process group even for one rank
            address, port = self._get([self.actors[0].handle.rendezvous.remote()], [self.actors[0]])[0]
            calls = [a.handle.init_process_group.remote(address, port, collective_timeout_s) for a in self.actors]
            self.backend = self._get(calls, self.actors)[0]
            logger.info("trainer group of %d ranks up (%s, rendezvous %s:%d)", world, self.backend, address, port)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def nodes(self) -> list[str]:
        return [str(a.node.get("node_id")) for a in self.actors]

    def _get(self, refs: Sequence[Any], actors: Sequence[ManagedActor]) -> list[Any]:
        """``ray.get`` per rank; a dead rank becomes an ``ActorFailureError`` naming it, its node and the cause."""
        owner = {ref: k for k, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:  # first finished first: a dead rank surfaces while its peers still wait in a collective
            ready, pending = ray.wait(pending, num_returns=1)
            k = owner[ready[0]]
            try:
                out[k] = ray.get(ready[0])
            except RayActorError as exc:
                actor = actors[k]
                actor.failures += 1
                actor.last_cause = describe(exc)
                raise actor.error(
                    "died; trainer ranks are not restarted (the process group and optimizer state died with it)",
                    "Resume from the last checkpoint (dapo train --resume) after fixing the cause",
                ) from exc
        return out

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """The same call on every rank (e.g. ``load_checkpoint``), results by rank."""
        return self._get([getattr(a.handle, method).remote(*args) for a in self.actors], self.actors)

    def call_rank0(self, method: str, *args: Any) -> Any:
        """Rank 0's answer. Under FSDP2 the model methods are collectives: every rank is called, rank 0 answers
        (calling rank 0 alone would leave it waiting for its peers)."""
        if self.fsdp and method in _COLLECTIVE_UNDER_FSDP:
            return self.call_all(method, *args)[0]
        return self._get([getattr(self.actors[0].handle, method).remote(*args)], self.actors[:1])[0]

    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        # under FSDP2 every rank takes part (a rank without rows gets shard_rows' masked dummy row)
        pairs = zip(shard_rows(batch, self.world_size), self.actors, strict=True)
        shards = [(s, n, a) for (s, n), a in pairs if n or self.fsdp]
        outs = self._get(
            [a.handle.compute_log_probs.remote(s, with_entropy) for s, _, a in shards], [a for *_, a in shards]
        )
        log_probs = torch.cat([lp[:n] for (lp, _), (_, n, _) in zip(outs, shards, strict=True)])  # (N, T)
        entropy = None
        if with_entropy:
            entropy = torch.cat([ent[:n] for (_, ent), (_, n, _) in zip(outs, shards, strict=True)])  # (N, T)
        return log_probs, entropy

    def update(self, batch: PolicyBatch) -> dict[str, float]:
        groups = self.cfg.trainer.ppo_mini_batch_size
        shards = shard_for_update(batch, groups, self.world_size)
        scales = short_mini_batch_scales(batch, groups)  # lr x groups / mini-batch size: < 1 for a short last one
        refs = [a.handle.update.remote(s, scales) for s, a in zip(shards, self.actors, strict=True)]
        metrics = self._get(refs, self.actors)
        return metrics[0]  # every rank returns the same all-reduced metrics

    def sft_step(self, batch: PolicyBatch) -> dict[str, float]:
        shards = shard_rows(batch, self.world_size)
        refs = [a.handle.sft_step.remote(s) for (s, _), a in zip(shards, self.actors, strict=True)]
        return self._get(refs, self.actors)[0]

    def state_ref(self) -> Any:
        """ObjectRef of rank 0's weights (CPU tensors) in the object store, for the rollout workers to read.

        Under FSDP2 every rank joins the gather (their refs hold ``{}`` and are dropped); rank 0's holds the
        full state dict in the configured model dtype."""
        if self.fsdp:
            refs = [a.handle.state_dict.remote() for a in self.actors]
            return refs[0]
        return self.actors[0].handle.state_dict.remote()

    def release_memory(self) -> list[dict[str, Any]]:
        """Every rank gives its cached GPU memory back (after an update, before a colocated engine wakes)."""
        return self.call_all("release_memory")

    def weight_sync_plan(self, limit_bytes: int, dtype: str | None) -> list[list[str]]:
        """The names of each bucket of a streamed sync (rank 0's plan; every rank computes the same)."""
        plan: list[list[str]] = self.call_rank0("weight_sync_plan", limit_bytes, dtype)
        return plan

    def submit_bucket(self, names: list[str], dtype: str | None) -> list[Any]:
        """Start gathering one bucket (every rank under FSDP2, else rank 0); ``bucket_ref`` waits for it."""
        actors = self.actors if self.fsdp else self.actors[:1]
        return [a.handle.gather_weight_bucket.remote(names, dtype) for a in actors]

    def bucket_ref(self, calls: list[Any]) -> Any:
        """Wait for a submitted gather on every rank (a dead rank raises ``ActorFailureError`` naming it); returns
        the object-store ref of rank 0's bucket."""
        answers = self._get(calls, self.actors[: len(calls)])
        return answers[0][0]

    def save_checkpoint(self, root: str | Path, step: int, meta: dict[str, Any]) -> Path:
        return Path(self.call_rank0("save_checkpoint", str(root), step, meta))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Every rank restores weights, optimizer, scheduler and RNG; returns the checkpoint's JSON meta."""
        meta: dict[str, Any] = self.call_all("load_checkpoint", str(path))[0]
        return meta

    def export_model(self, path: str | Path) -> Path:
        """The current policy as one HF directory (model + tokenizer) at ``path``."""
        return Path(self.call_rank0("export_model", str(path)))

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor.handle, no_restart=True)
