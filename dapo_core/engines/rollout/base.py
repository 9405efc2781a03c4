"""The rollout-backend interface: token ids in, one ``RolloutResult`` per (prompt, sample) out.

Backends (``hf`` = transformers on CPU, ``vllm`` on GPU) sit behind one small interface so the flow and the Ray
actors never care which engine produced a response. Step 1 of DAPO's Algorithm 1 ("sample G outputs for each
question") is ``backend.generate(prompts, SamplingConfig(n=G, temperature=1.0, top_p=1.0, ...))``.

Backends register themselves by name; ``get_rollout_backend_cls("hf")`` returns the class. ``"vllm"`` is looked
up lazily so that importing this package never imports vLLM (a GPU-only, CUDA-wheel dependency).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import Tensor

if TYPE_CHECKING:
    from dapo_core.config import DapoConfig

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"  # the response ended with an EOS token
FINISH_LENGTH = "length"  # max_new_tokens reached without EOS (truncated)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: ``n`` responses per prompt (the paper's G), temperature, nucleus/top-k, length, seed.

    DAPO samples training rollouts at temperature 1.0, top_p 1.0 (Sec. 4.1) and evaluates AIME at top_p 0.7.
    ``temperature == 0`` means greedy decoding. ``top_k = -1`` (or 0) disables top-k, as in vLLM.
    ``return_log_probs`` asks for the per-token log-probs of the sampled tokens under the raw model.
    ``seed`` fixes the samples: sample j of prompt i depends only on (seed, i, j), the prompt and the weights,
    so derive it per rollout (e.g. from trainer.seed, step and generation batch) to get fresh samples.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
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


class RolloutBackend(abc.ABC):
    """A generation engine that the trainer keeps in sync with the policy weights.

    ``shares_policy_model``: True when the backend generates with an ``nn.Module`` handed to it (``hf``: the
    trainer's own module in-process, so a sync is only ``mark_in_sync``); False when it owns its engine and its
    own copy of the weights (``vllm``), so every sync must ship them through ``update_weights``.
    """

    shares_policy_model: ClassVar[bool] = True
    _weight_version: int = 0

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
    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Load the policy's weights (step 6 of Algorithm 1) and record them as ``version``."""

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
