"""The rollout-backend interface: token ids in, one ``RolloutResult`` per (prompt, sample) out.

Backends (``hf`` = transformers on CPU, ``vllm`` on GPU) sit behind one small interface so the flow and the Ray
actors never care which engine produced a response. Step 1 of DAPO's Algorithm 1 ("sample G outputs for each
question") is ``backend.generate(prompts, SamplingConfig.from_config(cfg.rollout, max_new_tokens=L, seed=s))``
(the section's n = G, temperature 1.0, top_p 1.0).

Backends register themselves by name; ``get_rollout_backend_cls("hf")`` returns the class. ``"vllm"`` is looked
up lazily so that importing this package never imports vLLM (a GPU-only, CUDA-wheel dependency).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dapo_core.config import DapoConfig, RolloutConfig

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"  # the response ended with an EOS token
FINISH_LENGTH = "length"  # max_new_tokens reached without EOS (truncated)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: ``n`` responses per prompt (the paper's G), temperature, nucleus/top-k, length, seed.

    DAPO samples training rollouts at temperature 1.0, top_p 1.0 (Sec. 4.1) and evaluates AIME at top_p 0.7:
    those values, and their defaults, are the config's ``rollout:`` section; ``from_config`` reads them, so the
    knobs that section sets have no default here. ``temperature == 0`` means greedy decoding. ``top_k = -1`` (or
    0) disables top-k, as in vLLM. ``return_log_probs`` asks for the per-token log-probs of the sampled tokens
    under the raw model. ``seed`` fixes the samples: sample j of prompt i depends only on (seed, i, j), the prompt
    and the weights, so derive it per rollout (e.g. from trainer.seed, step and generation batch) to get fresh
    samples. The two have defaults: no config key sets them.
    """

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int = 0
    return_log_probs: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n ({self.n}) must be >= 1 responses per prompt: DAPO uses n = 16")
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0: use 0 for greedy, 1.0 for rollouts")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]: use 1.0 to disable nucleus sampling")
        if self.top_k < -1:
            raise ValueError(f"top_k ({self.top_k}) must be -1 (off), 0 (off) or a positive count")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be >= 1")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0

    @classmethod
    def from_config(
        cls,
        rollout: RolloutConfig,
        *,
        max_new_tokens: int,
        seed: int,
        validation: bool = False,
        log_probs: bool = False,
    ) -> SamplingConfig:
        """The ``rollout:`` section's training sampling (``n``, ``temperature``, ``top_p``, ``top_k``) or, with
        ``validation``, its validation sampling (``val_n``, ``val_temperature``, ...). ``max_new_tokens``: the
        resolved generation cap (``dapo_core.config.resolved_max_new_tokens``)."""
        r = rollout
        if validation:
            return cls(
                n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k,
                max_new_tokens=max_new_tokens, seed=seed, return_log_probs=log_probs,
            )  # fmt: skip
        return cls(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=max_new_tokens, seed=seed, return_log_probs=log_probs,
        )  # fmt: skip


@dataclass
class RolloutResult:
    """One sampled response. ``response_ids`` has no padding and ends with EOS when one was generated."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_length: int
    truncated: bool  # max_new_tokens reached without EOS
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH
    log_probs: list[float] | None  # raw-model log-probs of response_ids (same length), if asked for
    text: str  # decoded response, special tokens skipped


@dataclass(frozen=True)
class WeightSyncStats:
    """What one weight sync shipped: ``tensors`` in ``buckets``, ``bytes`` of payload (as shipped, after the cast
    to ``sync_dtype``), in ``seconds`` from ``begin_weight_update`` to the end of ``finish_weight_update``."""

    version: int
    tensors: int
    buckets: int
    bytes: int
    seconds: float


def cast_for_sync(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` detached, floating tensors cast to ``dtype`` (None: as they are); a copy only when it casts."""
    t = tensor.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t


@dataclass
class _PendingUpdate:
    """A weight update between ``begin_weight_update`` and ``finish_weight_update``."""

    version: int
    started: float = field(default_factory=time.perf_counter)
    names: set[str] = field(default_factory=set)
    buckets: int = 0
    bytes: int = 0
    tensors: dict[str, Tensor] = field(default_factory=dict)  # the default implementation's collected buckets


class RolloutBackend(abc.ABC):
    """A generation engine that the trainer keeps in sync with the policy weights.

    ``shares_policy_model``: True when the backend generates with an ``nn.Module`` handed to it (``hf``: the
    trainer's own module in-process, so a sync is only ``mark_in_sync``); False when it owns its engine and its
    own copy of the weights (``vllm``), so every sync must ship them through ``update_weights``.
    """

    shares_policy_model: ClassVar[bool] = True
    _weight_version: int = 0
    _pending_update: _PendingUpdate | None = None
    last_sync: WeightSyncStats | None = None  # the last completed weight sync (None: none yet)

    @classmethod
    def from_config(
        cls,
        cfg: DapoConfig,
        *,
        model: Any,
        tokenizer: Any,
        model_path: str,
        engine_overrides: Mapping[str, Any] | None = None,
    ) -> RolloutBackend:
        """Build the backend the run config asks for.

        ``model``: the policy module to generate with (None for backends with ``shares_policy_model`` False,
        which load ``model_path`` themselves); ``tokenizer``: the run's tokenizer; ``engine_overrides``: engine
        arguments set by the placement (e.g. vLLM's ``distributed_executor_backend`` inside a Ray actor), ignored
        by in-process backends. The default suits backends constructed as ``cls(model, tokenizer, *,
        micro_batch_size)``.
        """
        if model is None:
            raise ValueError(f"rollout backend {cls.__name__} generates with the policy module: pass model= (got None)")
        return cls(model, tokenizer, **cls.config_kwargs(cfg))  # type: ignore[call-arg]

    @classmethod
    def config_kwargs(cls, cfg: DapoConfig) -> dict[str, Any]:
        """The constructor keywords the default ``from_config`` takes from the run config."""
        return {"micro_batch_size": cfg.rollout.micro_batch_size}

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, *, prompt_index_offset: int = 0
    ) -> list[RolloutResult]:
        """Sample ``sampling.n`` responses for every prompt (token ids, unpadded).

        Results are ordered by prompt then sample: ``results[i * n + j]`` is sample ``j`` of prompt ``i``.
        ``prompt_index_offset`` is the position of ``prompts[0]`` in a batch split across workers: seeds and
        ``RolloutResult.prompt_index`` use the global position, so shards reproduce the unsplit call.
        """

    @abc.abstractmethod
    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> WeightSyncStats | None:
        """Load the policy's weights (step 6 of Algorithm 1) and record them as ``version``.

        Backends that stream (``vllm``) return the sync's ``WeightSyncStats``; in-place ones may return None.
        """

    # ------------------------------------------------------------------ streamed weight updates
    # A trainer that gathers its weights piece by piece (FSDP: one decoder layer at a time) ships them as
    #     backend.begin_weight_update(v); backend.load_weight_bucket(bucket) ...; stats = backend.finish_weight_update(v)
    # with buckets in the order of vllm_worker.plan_buckets(..., group=layer_group). The defaults below collect the
    # buckets and hand them to update_weights at finish; backends that can load a bucket at a time override all three.

    @property
    def sync_dtype(self) -> torch.dtype | None:
        """The dtype this backend wants floating weights shipped in (None: as the trainer holds them)."""
        return None

    @property
    def weight_update_in_progress(self) -> bool:
        """True between ``begin_weight_update`` and ``finish_weight_update`` / ``abort_weight_update``."""
        return self._pending_update is not None

    def begin_weight_update(self, version: int) -> None:
        """Start a streamed weight update to ``version`` (refused if older than the loaded version or while
        another update is in progress)."""
        if self._pending_update is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a weight update to version {self._pending_update.version} is in progress: "
                "call finish_weight_update (or abort_weight_update) before beginning another"
            )
        self._check_weight_version(version)
        self._pending_update = _PendingUpdate(version)

    def _require_update(self, what: str) -> _PendingUpdate:
        pending = self._pending_update
        if pending is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: no weight update in progress: call begin_weight_update")
        return pending

    def _end_update(self, version: int) -> _PendingUpdate:
        """The update ``finish_weight_update(version)`` completes, taken out of progress (versions must match)."""
        pending = self._require_update("finish_weight_update")
        if version != pending.version:
            raise ValueError(
                f"finish_weight_update({version}) does not match begin_weight_update({pending.version}): pass the "
                "same version to both"
            )
        self._pending_update = None
        return pending

    def _note_bucket(self, pending: _PendingUpdate, named: Sequence[tuple[str, Tensor]]) -> None:
        """Refuse an empty bucket or a name shipped twice in one update; record the names."""
        if not named:
            raise ValueError(f"{type(self).__name__}.load_weight_bucket: empty bucket (plan_buckets never makes one)")
        names = [n for n, _ in named]
        repeated = sorted({n for n in names if n in pending.names} | {n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{type(self).__name__}.load_weight_bucket: {repeated[:5]} already shipped in this update: ship each "
                "tensor once per update (buckets from plan_buckets over the state dict's names)"
            )
        pending.names.update(names)
        pending.buckets += 1

    def load_weight_bucket(self, named: Sequence[tuple[str, Tensor]]) -> int:
        """Take one bucket of HF-named tensors (cast to ``sync_dtype`` if needed); returns its payload bytes.

        Default: collects the bucket (no copy unless it casts) for ``finish_weight_update``.
        """
        pending = self._require_update("load_weight_bucket")
        self._note_bucket(pending, named)
        nbytes = 0
        for name, tensor in named:
            t = cast_for_sync(tensor, self.sync_dtype)
            pending.tensors[name] = t
            nbytes += t.numel() * t.element_size()
        pending.bytes += nbytes
        return nbytes

    def finish_weight_update(self, version: int) -> WeightSyncStats:
        """Complete the update begun with ``begin_weight_update(version)``: load, record ``version``, return stats.

        Default: ``update_weights`` with the collected buckets.
        """
        pending = self._end_update(version)
        self.update_weights(pending.tensors, version)
        return self._record_sync(pending)

    def abort_weight_update(self) -> None:
        """Drop an update in progress (after a failure part-way); the loaded version stays. No-op without one."""
        self._pending_update = None

    def _record_sync(self, pending: _PendingUpdate) -> WeightSyncStats:
        stats = WeightSyncStats(
            version=pending.version, tensors=len(pending.names), buckets=pending.buckets, bytes=pending.bytes,
            seconds=time.perf_counter() - pending.started,
        )  # fmt: skip
        self.last_sync = stats
        return stats

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded (0 = as constructed)."""
        return self._weight_version

    def _check_weight_version(self, version: int) -> None:
        """Raise unless ``version`` >= the loaded version (call before loading; then set ``_weight_version``)."""
        if version < self._weight_version:
            raise ValueError(
                f"weight version {version} is older than the loaded version {self._weight_version}: versions must "
                "not decrease (pass the trainer's step counter); create a new backend to roll back"
            )

    def mark_in_sync(self, version: int) -> None:
        """Record ``version`` without copying: the backend shares the trainer's model object (hybrid engine)."""
        self._check_weight_version(version)
        self._weight_version = version

    def sleep(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release accelerator memory between rollouts (vLLM sleep mode); no-op by default."""

    def wake_up(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Re-acquire what ``sleep`` released; no-op by default."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release the engine (processes, accelerator memory); the backend is unusable afterwards. No-op by default."""


_BackendT = TypeVar("_BackendT", bound=type[RolloutBackend])

_ROLLOUT_BACKENDS: dict[str, type[RolloutBackend]] = {}

# Backends whose module is imported only when asked for: name -> (module, required third-party package).
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {"vllm": ("dapo_core.engines.rollout.vllm", "vllm")}


def register_rollout_backend(name: str) -> Callable[[_BackendT], _BackendT]:
    """Class decorator: make a ``RolloutBackend`` subclass available as ``get_rollout_backend_cls(name)``."""

    def deco(cls: _BackendT) -> _BackendT:
        if name in _ROLLOUT_BACKENDS and _ROLLOUT_BACKENDS[name] is not cls:
            raise ValueError(f"rollout backend {name!r} is already registered ({_ROLLOUT_BACKENDS[name].__name__})")
        _ROLLOUT_BACKENDS[name] = cls
        return cls

    return deco


def available_rollout_backends() -> list[str]:
    """Names accepted by ``get_rollout_backend_cls`` (registered plus lazily importable)."""
    return sorted(set(_ROLLOUT_BACKENDS) | set(_LAZY_BACKENDS))


def backend_shares_policy_model(name: str) -> bool:
    """``shares_policy_model`` of backend ``name`` without importing a lazy backend's package (a Ray driver may not
    have vLLM installed; its workers do): the lazy ones (vllm) own their engines."""
    cls = _ROLLOUT_BACKENDS.get(name)
    return bool(cls.shares_policy_model) if cls is not None else False


def _import_lazy_backend(name: str) -> None:
    module, package = _LAZY_BACKENDS[name]
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"rollout backend {name!r} needs the {package!r} package, which is not installed. It runs on a CUDA "
            "GPU only: install the GPU extra with `pip install .[gpu]` on a machine with an NVIDIA GPU, or use "
            "rollout.backend=hf on CPU."
        )
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ImportError(
            f"rollout backend {name!r}: {package} is installed but {module} is not available in this version "
            "of dapo-flow; use rollout.backend=hf"
        ) from e


def get_rollout_backend_cls(name: str) -> type[RolloutBackend]:
    """The backend class registered as ``name``; unknown names raise ``ValueError`` listing the valid ones."""
    if name not in _ROLLOUT_BACKENDS and name in _LAZY_BACKENDS:
        _import_lazy_backend(name)
    try:
        return _ROLLOUT_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout backend {name!r}; valid names: {available_rollout_backends()} "
            "(set rollout.backend to one of them)"
        ) from None
