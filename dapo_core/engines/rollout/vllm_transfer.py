"""How a weight sync reaches the vLLM workers: ``rollout.weight_sync`` = ``bytes`` | ``cuda_ipc`` | ``nccl``.

Each is a ``WeightTransport`` with ``begin`` (once per sync), ``load`` (once per bucket of HF-named tensors, already
in the shipping dtype), ``finish`` (once) and ``abort`` (after a failure part-way: leave the engine runnable).

- ``bytes`` (default; tested on vLLM's CPU build): every bucket is serialised to raw bytes (``vllm_worker.
  encode_bucket``) and sent through ``LLM.collective_rpc`` to ``vllm_worker.WeightSyncWorkerExtension``, which
  loads it into one layerwise reload per sync. Works wherever vLLM runs, including a Ray actor that holds no GPU.
- ``cuda_ipc`` (colocated trainer and engine on the same GPUs) and ``nccl`` (engine on other GPUs or nodes): vLLM
  0.32's own weight-transfer engines (``vllm/distributed/weight_transfer/``), as verl and vLLM's RL examples use
  them, so the weights never leave the GPU. Facts relied on:

  * ``LLM(weight_transfer_config={"backend": "ipc" | "nccl"})`` (an ``EngineArgs`` field; a dict becomes a
    ``vllm.config.WeightTransferConfig``) makes every ``Worker`` create ``IPCWeightTransferEngine`` /
    ``NCCLWeightTransferEngine`` after loading the model (``gpu_worker.Worker.load_model``).
  * The worker methods, reached with ``collective_rpc``: ``init_weight_transfer_engine(init_info: dict)`` (once),
    ``start_weight_update()`` (initialises the layerwise reload), ``update_weights(update_info: dict)`` (one chunk:
    ``model.load_weights`` on what arrives, then ``torch.accelerator.synchronize()``), ``finish_weight_update()``
    (finalises the reload, resets the LoRA state), ``shutdown_weight_transfer_engine()``. Each runs inside
    ``set_current_vllm_config``. A failing ``update_weights`` ends the worker's session without finalising.
  * IPC: init info ``{"packed": False}`` (``IPCWeightTransferInitInfo``); update info ``names``, ``dtype_names``
    (``"bfloat16"``), ``shapes`` and one ``{gpu_uuid: args}`` per tensor, ``args`` from ``torch.multiprocessing.
    reductions.reduce_tensor`` (the worker rebuilds it with ``rebuild_cuda_tensor`` on its device, found by the
    physical GPU's UUID). The handles are not msgpack values, so they travel pickled and base64-encoded in
    ``ipc_handles_pickled``, which the worker only accepts with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set before
    the engine starts, ``prepare_environment``). The sender keeps its tensors alive until ``finish`` (the layerwise
    reload may hold views of them until then) and calls ``torch.cuda.ipc_collect()`` afterwards.
  * NCCL: the sender is NCCL rank 0 of a group with the engine's workers at ``rank_offset`` 1
    (``world_size`` = 1 + tensor-parallel size); the workers join in ``init_weight_transfer_engine`` (init info
    ``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``packed``: ``NCCLWeightTransferInitInfo``)
    while the sender opens its end with ``nccl_common.trainer_init(info, rank=0)`` (a ``PyNcclCommunicator``); both
    block until the other arrives, so one runs on a thread. Per bucket, the workers' ``update_weights`` (update
    info ``names``, ``dtype_names``, ``shapes``: ``NCCLWeightTransferUpdateInfo``; ``packed`` False: one
    ``broadcast`` per tensor, in order) runs on a thread while the sender broadcasts each tensor from rank 0.

  NOT YET VERIFIED ON A GPU by this project: the ``cuda_ipc`` and ``nccl`` transports (``IpcTransport``,
  ``NcclTransport``) are written against vLLM 0.32's source; their argument plumbing is checked against the real
  classes on CPU (tests/test_vllm_cpu.py), the transfers themselves need CUDA. Both need the tensors handed to
  ``load_weight_bucket`` on (or movable to) a CUDA device of this process: the sender is the process that holds
  the ``VllmRollout``. On another platform they are refused with the knob's name (``check_weight_sync_platform``).
"""

from __future__ import annotations

import abc
import base64
import logging
import os
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from torch import Tensor

from dapo_core.engines.rollout.vllm_worker import bucket_nbytes, encode_bucket

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MODES = ("bytes", "cuda_ipc", "nccl")
# rollout.weight_sync -> vLLM's WeightTransferConfig.backend (the WeightTransferEngineFactory registry key)
TRANSFER_BACKENDS: dict[str, str] = {"cuda_ipc": "ipc", "nccl": "nccl"}
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # vllm.envs: lets workers unpickle IPC handles


def transfer_engine_kwargs(weight_sync: str) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments ``weight_sync`` needs: none for ``bytes``, else ``weight_transfer_config``."""
    if weight_sync not in WEIGHT_SYNC_MODES:
        raise ValueError(f"rollout.weight_sync ({weight_sync!r}) must be one of {list(WEIGHT_SYNC_MODES)}")
    backend = TRANSFER_BACKENDS.get(weight_sync)
    return {} if backend is None else {"weight_transfer_config": {"backend": backend}}


def check_weight_sync_platform(weight_sync: str, device_type: str, cuda_here: bool) -> None:
    """Refuse ``cuda_ipc`` / ``nccl`` unless vLLM runs on CUDA and this process (the sender) has a CUDA device."""
    if weight_sync == "bytes":
        return
    if device_type != "cuda" or not cuda_here:
        raise RuntimeError(
            f"rollout.weight_sync={weight_sync} ships the weights GPU to GPU with vLLM's weight-transfer engine, "
            f"which needs CUDA: vLLM's platform here is {device_type!r} and torch.cuda.is_available() is "
            f"{cuda_here} in this process. Set rollout.weight_sync=bytes (works on any platform), or run on NVIDIA "
            "GPUs with the VllmRollout in a process that holds a GPU."
        )


def prepare_environment(weight_sync: str) -> None:
    """Before the engine starts: ``cuda_ipc`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its processes."""
    if weight_sync != "cuda_ipc":
        return
    value = os.environ.setdefault(INSECURE_SERIALIZATION, "1")
    if value != "1":
        raise RuntimeError(
            f"rollout.weight_sync=cuda_ipc sends CUDA IPC handles pickled, which vLLM's workers accept only with "
            f"{INSECURE_SERIALIZATION}=1 (it is {value!r} here): unset it, or set rollout.weight_sync=bytes"
        )
    logger.info("rollout.weight_sync=cuda_ipc: %s=1 for the vLLM engine's processes", INSECURE_SERIALIZATION)


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def ipc_update_info(named: Sequence[tuple[str, Tensor]], handles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``update_weights``' argument for vLLM's IPC engine (``IPCWeightTransferUpdateInfo`` fields), the handles
    pickled so the dict stays a msgpack value."""
    return {
        "names": [n for n, _ in named],
        "dtype_names": [_dtype_name(t) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(list(handles))).decode("ascii"),
    }


def nccl_init_info(master_address: str, master_port: int, world_size: int) -> dict[str, Any]:
    """``init_weight_transfer_engine``'s argument for vLLM's NCCL engine (``NCCLWeightTransferInitInfo`` fields):
    the sender is rank 0, the workers follow it."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": 1,
        "world_size": int(world_size),
        "packed": False,
    }


def nccl_update_info(named: Sequence[tuple[str, Tensor]]) -> dict[str, Any]:
    """``update_weights``' argument for vLLM's NCCL engine (``NCCLWeightTransferUpdateInfo`` fields)."""
    return {
        "names": [n for n, _ in named],
        "dtype_names": [_dtype_name(t) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def _payload_bytes(named: Sequence[tuple[str, Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


class WeightTransport(abc.ABC):
    """One way of moving a sync's buckets into the engine ``llm`` (a ``vllm.LLM``)."""

    mode: ClassVar[str]

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    @abc.abstractmethod
    def begin(self) -> None:
        """Prepare the workers for a sync (once per sync)."""

    @abc.abstractmethod
    def load(self, named: Sequence[tuple[str, Tensor]]) -> int:
        """Ship one bucket; returns its payload bytes."""

    @abc.abstractmethod
    def finish(self) -> list[str] | None:
        """Complete the sync; the vLLM parameter names no bucket wrote, or None where that cannot be known."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End a failed sync so the engine can run again (its weights are then a mix: sync again)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the transport set up (communicators)."""


class BytesTransport(WeightTransport):
    """Raw bytes through ``collective_rpc`` to ``WeightSyncWorkerExtension`` (one layerwise reload per sync)."""

    mode = "bytes"

    def begin(self) -> None:
        self.llm.collective_rpc("dapo_begin_reload")

    def load(self, named: Sequence[tuple[str, Tensor]]) -> int:
        bucket = encode_bucket(named)
        self.llm.collective_rpc("dapo_load_weights", args=(bucket,))
        return bucket_nbytes(bucket)

    def finish(self) -> list[str] | None:
        answers = self.llm.collective_rpc("dapo_finish_reload")
        return sorted({str(n) for missing in answers for n in missing})

    def abort(self) -> None:
        self.llm.collective_rpc("dapo_finish_reload", kwargs={"force": True})


class _TransferEngineTransport(WeightTransport):
    """vLLM's own weight-transfer session: ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
    vLLM's engines report no loaded names: ``finish`` returns None (the sender checks the names it shipped)."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self._ready = False

    @abc.abstractmethod
    def _init(self) -> None:
        """Run ``init_weight_transfer_engine`` on the workers (once, before the first sync)."""

    def begin(self) -> None:
        if not self._ready:
            self._init()
            self._ready = True
        self.llm.collective_rpc("start_weight_update")

    def finish(self) -> list[str] | None:
        self.llm.collective_rpc("finish_weight_update")
        return None

    def abort(self) -> None:
        try:  # a session still open on the workers (the failure was on this side)
            self.llm.collective_rpc("finish_weight_update")
        except Exception as exc:  # the worker closed its session when update_weights failed
            logger.warning("vLLM finish_weight_update after a failed sync: %s; finalising the reload directly", exc)
            self.llm.collective_rpc("dapo_finish_reload", kwargs={"force": True})

    def shutdown(self) -> None:
        if self._ready:
            self.llm.collective_rpc("shutdown_weight_transfer_engine")
            self._ready = False


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


class IpcTransport(_TransferEngineTransport):
    """CUDA IPC (``rollout.weight_sync=cuda_ipc``): the workers map this process's GPU tensors. Unverified on a GPU."""

    mode = "cuda_ipc"

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self._refs: list[Tensor] = []  # the shared tensors, alive until finish

    def _init(self) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"packed": False}})

    def load(self, named: Sequence[tuple[str, Tensor]]) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        device = _cuda_device()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        shared = [(name, t.detach().to(device).contiguous()) for name, t in named]
        handles = [{uuid: reduce_tensor(t)[1]} for _, t in shared]
        torch.cuda.synchronize(device)  # the copies are written before another process reads them
        self._refs.extend(t for _, t in shared)
        self.llm.collective_rpc("update_weights", kwargs={"update_info": ipc_update_info(shared, handles)})
        return _payload_bytes(shared)

    def finish(self) -> list[str] | None:
        try:
            return super().finish()
        finally:
            self._release()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._release()

    def _release(self) -> None:
        self._refs.clear()
        torch.cuda.ipc_collect()


class NcclTransport(_TransferEngineTransport):
    """NCCL broadcast from this process (rank 0) to the workers (``rollout.weight_sync=nccl``). Unverified on a GPU."""

    mode = "nccl"

    def __init__(self, llm: Any, *, world_size: int) -> None:
        super().__init__(llm)
        self.world_size = int(world_size)
        self.group: Any = None  # vLLM's PyNcclCommunicator

    def _init(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import (  # type: ignore[import-not-found]
            trainer_init,
        )
        from vllm.utils.network_utils import get_ip, get_open_port  # type: ignore[import-not-found]

        info = nccl_init_info(get_ip(), get_open_port(), self.world_size)
        with ThreadPoolExecutor(max_workers=1) as pool:  # both ends block until the other joins
            joined = pool.submit(self.llm.collective_rpc, "init_weight_transfer_engine", kwargs={"init_info": info})
            self.group = trainer_init(info, rank=0)
            joined.result()

    def load(self, named: Sequence[tuple[str, Tensor]]) -> int:
        device = _cuda_device()
        sent = [(name, t.detach().to(device).contiguous()) for name, t in named]
        pool = ThreadPoolExecutor(max_workers=1)
        try:  # the workers receive inside update_weights while this thread broadcasts
            received = pool.submit(
                self.llm.collective_rpc, "update_weights", kwargs={"update_info": nccl_update_info(sent)}
            )
            stream = torch.cuda.current_stream(device)
            for _, t in sent:
                self.group.broadcast(t, src=0, stream=stream)
            stream.synchronize()
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the workers blocked: do not join them
        return _payload_bytes(sent)

    def shutdown(self) -> None:
        super().shutdown()
        if self.group is not None:
            self.group.destroy()
            self.group = None


def make_transport(weight_sync: str, llm: Any, *, tensor_parallel_size: int = 1) -> WeightTransport:
    """The transport for ``rollout.weight_sync`` on engine ``llm``."""
    if weight_sync == "bytes":
        return BytesTransport(llm)
    if weight_sync == "cuda_ipc":
        return IpcTransport(llm)
    if weight_sync == "nccl":
        return NcclTransport(llm, world_size=1 + int(tensor_parallel_size))
    raise ValueError(f"rollout.weight_sync ({weight_sync!r}) must be one of {list(WEIGHT_SYNC_MODES)}")
