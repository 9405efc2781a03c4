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
    the limit travels alone, over the limit): vLLM processes a layer once per reload call, so a layer split across
    two calls would be processed half-loaded. Without, a tensor larger than the limit travels alone.
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


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker, which owns ``self.model_runner``.

    Names carry a ``dapo_`` prefix so they never shadow a method of vLLM's own worker.
    """

    model_runner: Any  # provided by vLLM's worker

    def _dapo_model(self) -> torch.nn.Module:
        runner = self.model_runner
        # get_model() unwraps CUDA-graph / compile wrappers; .model is the attribute of older runners
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else runner.model
        return model  # type: ignore[no-any-return]

    def dapo_load_weights(self, bucket: Sequence[Sequence[Any]]) -> list[str] | None:
        """Load one bucket of HF-named weights into the loaded engine, in place.

        vLLM 0.32: ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (it maps HF
        names onto the fused parameters, keeps this rank's shard and re-runs the post-load processing; it reports
        no names: None is returned). Older runners without it: the model's own ``load_weights``, which returns the
        vLLM parameter names it wrote.
        """
        model = self._dapo_model()
        device = next(model.parameters()).device
        weights = [(name, tensor.to(device)) for name, tensor in decode_bucket(bucket)]
        reload = getattr(self.model_runner, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=weights, is_checkpoint_format=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return None
        loaded = model.load_weights(weights=weights)  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies are done before the RPC answers
        return sorted(str(n) for n in loaded) if loaded is not None else None

    def dapo_param_names(self) -> list[str]:
        """Names of the model's parameters on this rank (what a full sync must write)."""
        return sorted(name for name, _ in self._dapo_model().named_parameters())
