"""The vLLM worker extension that loads the trainer's weights, and the bucket format it receives.

vLLM mixes the class named by ``LLM(worker_extension_cls="dapo_core.engines.rollout.vllm_worker.
WeightSyncWorkerExtension")`` into every worker (one per tensor-parallel rank); ``llm.collective_rpc(name, args=...)``
calls a method of it on all of them and returns their answers in rank order. The methods run inside vLLM's
worker process, so this module imports nothing from vLLM (it stays importable, and testable, without it).

Bucket format: a list of ``(name, dtype, shape, data)`` with ``data`` the tensor's raw bytes. Only plain
Python types cross the process boundary: vLLM's engine-core IPC (msgpack) rebuilds tensors only where a message
field is typed as a tensor, which ``collective_rpc``'s free-form arguments are not, so raw tensors there would
arrive as undecoded lists. Bytes travel intact over msgpack and pickle alike.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# Dotted path that vllm.LLM(worker_extension_cls=...) imports in each worker process.
WORKER_EXTENSION_CLS = f"{__name__}.WeightSyncWorkerExtension"

# One entry of a bucket: (HF parameter name, dtype name without "torch.", shape, raw little-endian bytes).
BucketEntry = tuple[str, str, list[int], bytes]


def encode_bucket(named: Iterable[tuple[str, Tensor]]) -> list[BucketEntry]:
    """Serialise ``(name, tensor)`` pairs (any device, any dtype) into a bucket of plain Python values."""
    out: list[BucketEntry] = []
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,)
        data = flat.view(torch.uint8).numpy().tobytes()  # copies: the bucket owns its bytes
        out.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data))
    return out


def decode_bucket(bucket: Sequence[Sequence[Any]]) -> list[tuple[str, Tensor]]:
    """Rebuild ``(name, tensor)`` pairs from ``encode_bucket``'s output (tuples may arrive as lists)."""
    out: list[tuple[str, Tensor]] = []
    for name, dtype_name, shape, data in bucket:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {name!r}: unknown dtype {dtype_name!r} in the sync bucket")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        out.append((str(name), raw.view(dtype).reshape([int(s) for s in shape])))
    return out


_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_group(name: str) -> str:
    """The unit a bucket must not split: ``model.layers.3`` for a decoder layer's tensors, ``""`` for the rest
    (embeddings, final norm, lm_head: small, and lm_head is tied to the embeddings)."""
    m = _LAYER.match(name)
    return m.group(1) if m else ""


def plan_buckets(
    sizes: Sequence[tuple[str, int]], limit_bytes: int, *, group: Callable[[str], str] | None = None
) -> list[list[str]]:
    """Cut ``(name, nbytes)`` pairs, in order, into buckets of at most ``limit_bytes``.

    With ``group``, names with the same group key that follow each other stay in one bucket (a group larger than
    the limit travels alone, over the limit): vLLM's layerwise reload buffers a layer's tensors until all of them
    have arrived, so a whole layer per bucket frees each bucket as it loads, and the per-bucket fallback (vLLM
    without the layerwise API) would process a split layer half-loaded. Without, a tensor larger than the limit
    travels alone.
    Concatenating the buckets gives the names back in order.
    """
    if limit_bytes < 1:
        raise ValueError(f"limit_bytes ({limit_bytes}) must be >= 1: use rollout.weight_sync_bucket_mb * 2**20")
    units: list[tuple[str | None, list[str], int]] = []  # (group key, names, bytes): consecutive runs of a group
    for name, size in sizes:
        key = group(name) if group is not None else None
        if units and key is not None and units[-1][0] == key:
            units[-1] = (key, [*units[-1][1], name], units[-1][2] + size)
        else:
            units.append((key, [name], size))
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for _, names, size in units:
        if current and used + size > limit_bytes:
            buckets.append(current)
            current, used = [], 0
        current.extend(names)
        used += size
    if current:
        buckets.append(current)
    return buckets


def bucket_nbytes(bucket: Sequence[Sequence[Any]]) -> int:
    """Payload size of a bucket in bytes (the data only)."""
    return sum(len(entry[3]) for entry in bucket)


def _layerwise_reload_api() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """vLLM 0.32's layerwise reload (``vllm.model_executor.model_loader.reload``: ``initialize_layerwise_reload``,
    ``finalize_layerwise_reload``) and ``vllm.config.set_current_vllm_config``; None where they are missing."""
    try:
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]
        from vllm.model_executor.model_loader.reload import (  # type: ignore[import-not-found]
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload, set_current_vllm_config


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker (``self.model_runner``, ``self.vllm_config``).

    A weight sync is ``dapo_begin_reload`` once, ``dapo_load_weights`` per bucket, ``dapo_finish_reload`` once,
    then ``dapo_release_memory``. vLLM 0.32 (``model_loader/reload/layerwise.py``): ``initialize_layerwise_reload``
    moves every layer's parameters to the meta device and wraps their weight loaders so a layer is processed (and
    copied back into its original storage) as soon as all its elements have arrived; ``finalize_layerwise_reload``
    puts the old tensors back into any layer that received nothing (logging "<Layer>: Failed to load weights") and
    processes attention layers. ``Worker.reload_weights`` runs exactly initialise + ``model.load_weights`` +
    finalise per call, so one call per bucket would re-initialise every layer per bucket and warn for each layer
    outside it: hence one initialise and one finalise per sync, each inside ``set_current_vllm_config(self.
    vllm_config)`` as ``Worker.reload_weights`` does. Between begin and finish the model's parameters are on the
    meta device: the engine must not run (``VllmRollout`` refuses to generate then).
    Names carry a ``dapo_`` prefix so they never shadow a method of vLLM's own worker.
    """

    model_runner: Any  # provided by vLLM's worker
    vllm_config: Any  # provided by vLLM's worker
    _dapo_reload: dict[str, Any] | None = None  # the sync in progress on this worker

    def _dapo_model(self) -> torch.nn.Module:
        runner = self.model_runner
        # get_model() unwraps CUDA-graph / compile wrappers; .model is the attribute of older runners
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else runner.model
        return model  # type: ignore[no-any-return]

    def _dapo_param_names(self, model: torch.nn.Module) -> set[str]:
        lora = getattr(getattr(self, "vllm_config", None), "lora_config", None)
        names = {name for name, _ in model.named_parameters()}  # as vLLM's reload_weights counts them
        return {n.replace(".base_layer.", ".") for n in names} if lora else names

    def dapo_begin_reload(self) -> bool:
        """Initialise a layerwise reload for this sync; False where vLLM lacks the API (per-bucket reloads then)."""
        if self._dapo_reload is not None:
            raise RuntimeError("dapo_begin_reload: a weight sync is already in progress on this vLLM worker")
        model = self._dapo_model()
        state: dict[str, Any] = {
            "device": next(model.parameters()).device,  # read before the parameters move to the meta device
            "expected": self._dapo_param_names(model),
            "loaded": set(),
            "api": _layerwise_reload_api(),
        }
        if state["api"] is not None:
            initialize, _, current_config = state["api"]
            with current_config(self.vllm_config):
                initialize(model)
        self._dapo_reload = state
        return state["api"] is not None

    def dapo_load_weights(self, bucket: Sequence[Sequence[Any]]) -> int:
        """Load one bucket of HF-named weights (``encode_bucket``'s format) into the layerwise reload; returns the
        number of tensors. Without the layerwise API: the worker's own ``reload_weights`` (which sets the current
        vLLM config) on this bucket alone, or the model's ``load_weights`` for runners without it."""
        state = self._dapo_reload
        if state is None:
            raise RuntimeError("dapo_load_weights: no weight sync in progress: call dapo_begin_reload first")
        device = state["device"]
        weights = [(name, tensor.to(device)) for name, tensor in decode_bucket(bucket)]
        model = self._dapo_model()
        if state["api"] is not None:
            with state["api"][2](self.vllm_config):
                loaded = model.load_weights(weights)  # type: ignore[operator]
            state["loaded"].update(str(n) for n in loaded or ())
        else:
            state["expected"] = None  # the fallbacks report no names: nothing to check at finish
            reload = getattr(self, "reload_weights", None)
            if callable(reload):
                reload(weights_iterator=weights, is_checkpoint_format=True)
            else:
                model.load_weights(weights=weights)  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies are done before the RPC answers
        return len(weights)

    def dapo_finish_reload(self, force: bool = False) -> list[str]:
        """Finalise the layerwise reload (also after a failure: the engine is runnable again) and drop what the old
        weights left in the runner's caches; returns the vLLM parameter names no bucket wrote ([] when unknown).
        ``force``: finalise even without a sync of ours in progress (after vLLM's own ``update_weights`` failed,
        which ends its session without finalising; a no-op on layers that are not being reloaded)."""
        state, self._dapo_reload = self._dapo_reload, None
        if state is None:
            if not force or (api := _layerwise_reload_api()) is None:
                return []
            state = {"api": api, "expected": None}
        if state["api"] is not None:
            _, finalize, current_config = state["api"]
            with current_config(self.vllm_config):
                finalize(self._dapo_model(), self.vllm_config.model_config)
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights
                method = getattr(self.model_runner, reset, None)
                if callable(method):
                    method()
        expected = state["expected"]
        return sorted(expected - state["loaded"]) if expected is not None else []

    def dapo_release_memory(self) -> int:
        """Give this worker's cached accelerator memory back (the sync's staging copies) before the KV cache wakes;
        returns the bytes released (0 on CPU)."""
        from dapo_core.engines.memory import release_cached_memory

        return release_cached_memory("vllm worker").released

    def dapo_param_names(self) -> list[str]:
        """Names of the model's parameters on this rank (what a full sync must write)."""
        return sorted(self._dapo_param_names(self._dapo_model()))
