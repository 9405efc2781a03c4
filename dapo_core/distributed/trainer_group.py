"""Trainer ranks: N Ray actors forming one ``torch.distributed`` group, each running ``PolicyTrainer``.

Rank 0 publishes the rendezvous address (its node IP and a free port); every rank then joins with
``init_process_group`` (NCCL on GPU, gloo on CPU). The ``PolicyTrainer`` already all-reduces the loss
denominators and the gradients when a group is initialised, so the ranks only need their shards
(``shard_for_update``: whole prompt groups of every mini-batch) and to be called together: every collective
call happens on every rank, in the same order.

Trainer ranks are not restarted: a dead rank takes the process group and the optimizer state with it, so the
step fails with an error naming the rank, its node and the cause (resume from the last checkpoint).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError
from torch import Tensor

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
from dapo_core.engines.models import resolve_device, save_hf_dir
from dapo_core.engines.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ROLE = "trainer rank"


class TrainerRank:
    """Ray actor body: one data-parallel rank of the policy trainer (``ray.remote`` is applied by the group)."""

    def __init__(self, cfg: DapoConfig, model_path: str, rank: int, world_size: int, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.cfg = cfg
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(cfg.trainer.device)
        self.model = load_policy_model(cfg, model_path, self.device)
        self.trainer = policy_trainer_from(cfg, self.model, self.device)
        self.loss_cfg = loss_config_from(cfg)
        self._tokenizer: Any = None

    def node_info(self) -> dict[str, Any]:
        return this_node()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free TCP port for ``init_process_group``."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, address: str, port: int, timeout_s: float) -> str:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return backend

    def compute_log_probs(self, batch: PolicyBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        return self.trainer.compute_log_probs(batch, with_entropy=with_entropy)

    def update(self, shard: PolicyBatch) -> dict[str, float]:
        # the shard holds one relabelled "group" per mini-batch (see sharding.shard_for_update)
        return self.trainer.update(shard, self.loss_cfg, ppo_epochs=self.cfg.trainer.ppo_epochs, mini_batch_groups=1)

    def sft_step(self, shard: PolicyBatch) -> dict[str, float]:
        return self.trainer.sft_step(shard)

    def state_dict(self) -> dict[str, Tensor]:
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
        loaded = load_checkpoint(path, model=self.model)
        self.trainer.load_state_dict(loaded.trainer_state)
        return loaded.meta

    def export_model(self, path: str) -> str:
        return str(save_hf_dir(self.model, self._tok(), path))


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

    def ready(self) -> None:
        """Wait for every rank to load its model, then form the process group (rank 0 publishes the address)."""
        wait_ready(self.actors, self.start_timeout_s)
        start_timeout_s, world = self.start_timeout_s, self.world_size
        if world > 1:
            address, port = self._get([self.actors[0].handle.rendezvous.remote()], [self.actors[0]])[0]
            calls = [a.handle.init_process_group.remote(address, port, start_timeout_s) for a in self.actors]
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
        return self._get([getattr(self.actors[0].handle, method).remote(*args)], self.actors[:1])[0]

    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        shards = [(s, n, a) for (s, n), a in zip(shard_rows(batch, self.world_size), self.actors, strict=True) if n]
        outs = self._get(
            [a.handle.compute_log_probs.remote(s, with_entropy) for s, _, a in shards], [a for *_, a in shards]
        )
        log_probs = torch.cat([lp[:n] for (lp, _), (_, n, _) in zip(outs, shards, strict=True)])  # (N, T)
        entropy = None
        if with_entropy:
            entropy = torch.cat([ent[:n] for (_, ent), (_, n, _) in zip(outs, shards, strict=True)])  # (N, T)
        return log_probs, entropy

    def update(self, batch: PolicyBatch) -> dict[str, float]:
        shards = shard_for_update(batch, self.cfg.trainer.ppo_mini_batch_size, self.world_size)
        metrics = self._get([a.handle.update.remote(s) for s, a in zip(shards, self.actors, strict=True)], self.actors)
        return metrics[0]  # every rank returns the same all-reduced metrics

    def sft_step(self, batch: PolicyBatch) -> dict[str, float]:
        shards = shard_rows(batch, self.world_size)
        refs = [a.handle.sft_step.remote(s) for (s, _), a in zip(shards, self.actors, strict=True)]
        return self._get(refs, self.actors)[0]

    def state_ref(self) -> Any:
        """ObjectRef of rank 0's weights (CPU tensors) in the object store, for the rollout workers to read."""
        return self.actors[0].handle.state_dict.remote()

    def save_checkpoint(self, root: str | Path, step: int, meta: dict[str, Any]) -> Path:
        return Path(self.call_rank0("save_checkpoint", str(root), step, meta))

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor.handle, no_restart=True)
