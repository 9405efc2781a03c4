"""The executor interface: what flows call to run Algorithm 1's heavy phases, wherever the models live.

``LocalExecutor`` runs everything in this process (the CPU default); the Ray issue adds ``RayExecutor`` with the
same methods, so flows never care which they get. Executors own the models: flows and tasks pass prompts, texts,
small dataclasses and paths, never model objects.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dapo_core.config import DapoConfig, resolved_max_new_tokens
from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from dapo_core.engines.memory import release_cached_memory
from dapo_core.engines.models import load_model, resolve_device, save_hf_dir
from dapo_core.engines.rollout import RolloutResult, SamplingConfig, get_rollout_backend_cls
from dapo_core.engines.rollout.base import WeightSyncStats
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer
from dapo_core.rewards import ScoredBatch, score_batch

logger = logging.getLogger(__name__)


def loss_config_from(cfg: DapoConfig) -> LossConfig:
    """``LossConfig.from_config`` of ``cfg.algorithm``, with L_max (``data.max_response_length``) for Dr. GRPO."""
    return LossConfig.from_config(cfg.algorithm, max_response_length=cfg.data.max_response_length)


def sampling_from(cfg: DapoConfig, *, seed: int, validation: bool = False, log_probs: bool = False) -> SamplingConfig:
    """Training (paper: T=1.0, top_p=1.0, G=n) or validation (T=1.0, top_p=0.7, k=val_n) sampling:
    ``SamplingConfig.from_config`` of ``cfg.rollout`` with the resolved generation cap."""
    return SamplingConfig.from_config(
        cfg.rollout, max_new_tokens=resolved_max_new_tokens(cfg), seed=seed, validation=validation, log_probs=log_probs
    )


class PendingRollout:
    """A submitted ``generate``: ``result()`` waits for the samples (in-process executors hand back finished ones).

    ``version`` is the weight version the samples are generated with (the behaviour policy's)."""

    def __init__(self, fetch: Callable[[], list[RolloutResult]], version: int) -> None:
        self._fetch: Callable[[], list[RolloutResult]] | None = fetch
        self._results: list[RolloutResult] | None = None
        self.version = version

    def result(self) -> list[RolloutResult]:
        if self._results is None:
            assert self._fetch is not None
            self._results, self._fetch = self._fetch(), None
        return self._results


class Executor(abc.ABC):
    """Generate, score, compute log-probs, update, sync, checkpoint — the operations a training flow needs."""

    cfg: DapoConfig
    last_sync: WeightSyncStats | None = None  # the figures of the latest ``sync_weights`` (bytes, seconds)

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights the rollout engines hold (bumped by every ``sync_weights``)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> list[RolloutResult]: ...

    def submit_generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> PendingRollout:
        """Start ``generate`` with the rollout's current weights and return at once where the rollout runs apart
        from the trainer (Ray), so an update can run meanwhile; in-process it generates before returning."""
        results = self.generate(prompts, sampling)
        return PendingRollout(lambda: results, self.weight_version)

    @abc.abstractmethod
    def score(self, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch:
        """Reward dicts (score, acc, pred) per response; failed items count as wrong (num_failed)."""

    @abc.abstractmethod
    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """(N, T) log-probs (and entropy) under the current policy; used for pi_old before the update."""

    @abc.abstractmethod
    def update(self, batch: PolicyBatch) -> dict[str, float]:
        """One rollout step's policy update (ppo_epochs x mini-batches); bare metric names."""

    @abc.abstractmethod
    def sft_step(self, batch: PolicyBatch) -> dict[str, float]: ...

    @abc.abstractmethod
    def sync_weights(self) -> int:
        """Push the trainer's weights to the rollout engines; returns the new weight version."""

    @abc.abstractmethod
    def save_checkpoint(self, root: str | Path, step: int, meta: dict[str, Any]) -> Path: ...

    @abc.abstractmethod
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler and RNG; returns the checkpoint's JSON meta."""

    @abc.abstractmethod
    def export_model(self, path: str | Path) -> Path:
        """Write the current policy as an HF directory (model + tokenizer)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources (actors, processes). No-op for in-process executors."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def load_policy_model(cfg: DapoConfig, path: str, device: torch.device) -> Any:
    """The policy model named by ``path`` with the config's dtype / revision / remote-code settings."""
    return load_model(
        path,
        dtype=cfg.model.dtype,
        revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        device=device,
    )


def policy_trainer_from(cfg: DapoConfig, model: Any, device: torch.device) -> PolicyTrainer:
    """A ``PolicyTrainer`` over ``model`` with the config's optimizer, micro-batch and checkpointing settings; its
    log-probs are at ``rollout.temperature``, the distribution the training rollouts were sampled from."""
    return PolicyTrainer(
        model,
        OptimConfig.from_config(cfg.trainer),
        micro_batch_size=cfg.trainer.micro_batch_size,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        device=device,
        fsdp_defer_grad_sync=cfg.trainer.fsdp.defer_grad_sync,
        temperature=cfg.rollout.temperature,
    )


class LocalExecutor(Executor):
    """Everything in this process. With the ``hf`` backend rollout and training share one model object (a hybrid
    engine, as verl's colocated mode), so ``sync_weights`` only bumps the version. A backend that owns its engine
    (``vllm``, ``shares_policy_model`` False) gets the trainer's weights pushed by every ``sync_weights``, and, with
    ``rollout.free_cache_engine``, is put to sleep before each training phase so the trainer has the GPU memory."""

    def __init__(self, cfg: DapoConfig, *, model_path: str | None = None) -> None:
        self.cfg = cfg
        path = model_path or cfg.model.path
        self.device = resolve_device(cfg.trainer.device)
        self.model = load_policy_model(cfg, path, self.device)
        self._tokenizer = load_tokenizer(
            cfg.model.tokenizer_path or path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
        self.trainer = policy_trainer_from(cfg, self.model, self.device)
        backend_cls = get_rollout_backend_cls(cfg.rollout.backend)
        self.rollout = backend_cls.from_config(
            cfg,
            model=self.model if backend_cls.shares_policy_model else None,  # vllm loads its own copy of `path`
            tokenizer=self._tokenizer,
            model_path=path,
        )
        self.loss_cfg = loss_config_from(cfg)
        self._version = 0
        self._trainer_dirty = False  # the trainer ran since its memory was last released

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> list[RolloutResult]:
        self._release_trainer_memory()  # the engine wakes its KV cache in generate
        return self.rollout.generate(prompts, sampling)

    def score(self, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch:
        return score_batch(self.cfg.algorithm.reward_fn, completions, ground_truths)

    def _free_rollout_memory(self) -> None:
        """Training phase next: release the rollout engine's memory (vLLM sleep; no-op for hf)."""
        if self.cfg.rollout.free_cache_engine:
            self.rollout.sleep()
        self._trainer_dirty = True

    def _release_trainer_memory(self) -> None:
        """Before the engine wakes (weight sync, generate): give the trainer's cached GPU memory back, once after
        each training phase (``engines.memory``). Only for a backend with an engine of its own (vLLM): hf
        generates with the trainer's own module and allocates nothing apart."""
        if self._trainer_dirty and not self.rollout.shares_policy_model:
            release_cached_memory("trainer")
        self._trainer_dirty = False

    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        self._free_rollout_memory()
        return self.trainer.compute_log_probs(batch, with_entropy=with_entropy)

    def update(self, batch: PolicyBatch) -> dict[str, float]:
        self._free_rollout_memory()
        return self.trainer.update(
            batch,
            self.loss_cfg,
            ppo_epochs=self.cfg.trainer.ppo_epochs,
            mini_batch_groups=self.cfg.trainer.ppo_mini_batch_size,
        )

    def sft_step(self, batch: PolicyBatch) -> dict[str, float]:
        self._free_rollout_memory()
        return self.trainer.sft_step(batch)

    def _sync_rollout(self, version: int) -> None:
        """Make the rollout hold the trainer's current weights as ``version``; ``last_sync`` gets the figures."""
        t0 = time.perf_counter()
        if self.rollout.shares_policy_model:
            # shared model object: the rollout already sees the weights; record the version it now holds
            self.rollout.mark_in_sync(version)
            self.last_sync = WeightSyncStats(version, 0, 0, 0, time.perf_counter() - t0)
        else:
            self._release_trainer_memory()  # after the update, before the engine wakes its weights
            # the backend copies bucket by bucket (in its dtype), so no full host copy of the weights is made here
            weights = {k: v.detach() for k, v in self.model.state_dict().items()}
            self.last_sync = self.rollout.update_weights(weights, version)

    def sync_weights(self) -> int:
        self._sync_rollout(self._version + 1)
        self._version += 1
        return self._version

    def save_checkpoint(self, root: str | Path, step: int, meta: dict[str, Any]) -> Path:
        return save_checkpoint(
            root,
            step,
            model=self.model,
            tokenizer=self._tokenizer,
            trainer_state=self.trainer.state_dict(),
            meta={**meta, "weight_version": self._version},
            max_to_keep=self.cfg.trainer.max_ckpt_to_keep,
        )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        loaded: LoadedCheckpoint = load_checkpoint(path, model=self.model)
        self.trainer.load_state_dict(loaded.trainer_state)
        self._version = int(loaded.meta.get("weight_version", self._version))
        self._sync_rollout(self._version)
        return loaded.meta

    def export_model(self, path: str | Path) -> Path:
        return save_hf_dir(self.model, self._tokenizer, path)

    def shutdown(self) -> None:
        """Release the rollout engine (a vLLM engine's processes and GPU memory; no-op for hf)."""
        self.rollout.shutdown()


def policy_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Detached CPU copy of a model's weights (what a weight sync ships)."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
