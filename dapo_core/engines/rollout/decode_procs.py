"""Decode each hf micro-batch in several CPU processes at once (``rollout.hf_procs``).

Why: on a small model the decode loop is mostly ~100 small ops per step, each paying Python and dispatcher
overhead on one core, while torch's threads only split the few large GEMMs; and two threads meet at a barrier in
every op, so a stalled core stalls both. Measured on 2 cores, two Python threads decoding half the rows each were
only 1.08x (they take turns on the GIL). Processes have no GIL to share and no barrier: each runs its own loop on
its own share of the rows with ``threads // procs`` torch threads (``benchmarks/results/rollout.md``).

How:
- ``procs`` worker processes are started (``spawn``) at the first call and live until ``close``; the caller only
  hands out work and waits. (When the caller decoded a share itself, it had to drop to one torch thread and back
  for it, and its next 2-thread work, the training step, ran ~8% slower: measured, so it does not.) The workers
  share one copy of the module (``copy.deepcopy``, its parameters and buffers moved to shared memory, handed over
  by pickling, which keeps tied weights tied and any module surgery the caller made).
- At the start of every ``generate`` call the caller copies the module's current state into that shared copy, so
  a worker always decodes with the weights the caller has now (in-place optimizer updates, ``update_weights``).
- A micro-batch's rows (sorted by prompt length) are dealt out round-robin, ``rows[k::procs]`` to process k, so
  each share has the same mix of lengths; results are put back in the micro-batch's order.
- Sampling is seeded per row (``row_seed``), so a row's tokens do not depend on which rows share its batch: the
  tokens are those of one process decoding the whole micro-batch (tested), log-probs equal up to float summation
  order.

Limits: CPU modules only; ``spawn`` re-imports the ``__main__`` module in each worker, so a script that trains
needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import queue
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from dapo_core.engines.rollout.base import SamplingConfig
    from dapo_core.engines.rollout.hf import HFRolloutBackend

# Rows of one process's share of a micro-batch -> (responses (b, t), chosen tokens (b, t'), log-probs (b, t') | None)
Decoded = tuple[Tensor, Tensor, "Tensor | None"]

_START_TIMEOUT_S = 300.0  # a worker imports torch and transformers and builds the module: seconds, not minutes
_POLL_S = 1.0  # how often a wait checks that the workers are still alive


class DecodeProcesses:
    """``procs`` processes decoding each micro-batch of ``backend`` together; see the module docstring."""

    def __init__(self, backend: HFRolloutBackend, procs: int) -> None:
        if procs < 2:
            raise ValueError(f"DecodeProcesses needs procs >= 2 (got {procs}); 1 decodes in the calling process")
        if backend.device.type != "cpu":
            raise ValueError(
                f"rollout.hf_procs={procs} decodes in CPU processes, but the model is on {backend.device}: "
                "set rollout.hf_procs: 1 on an accelerator"
            )
        self.backend = backend
        self.procs = procs
        self._workers: list[Any] = []  # mp.Process of the spawn context
        self._inboxes: list[Any] = []
        self._outboxes: list[Any] = []
        self._shared: nn.Module | None = None  # the workers' module, its tensors in shared memory

    @property
    def threads_each(self) -> int:
        """Torch threads per process: the caller's count split evenly, at least one."""
        return max(1, torch.get_num_threads() // self.procs)

    def prepare(self) -> None:
        """Before a ``generate`` call: start the workers if needed (so on the first call, after the caller has
        settled its thread count), and copy the module's current state into theirs. Weights cannot change during
        a call, so one copy serves all its micro-batches."""
        self.start()
        try:
            self._sync_weights()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        """Start the workers (no-op when running); waits until each has built its module."""
        if self._workers:
            return
        if mp.current_process().daemon:
            raise RuntimeError(
                f"rollout.hf_procs={self.procs} starts decode processes, but this is a daemonic multiprocessing "
                "process, which may not have children: set rollout.hf_procs: 1 here"
            )
        shared = copy.deepcopy(self.backend.model)
        for p in shared.parameters():
            p.grad = None
        shared.requires_grad_(False).eval().share_memory()
        self._shared = shared
        spec = {
            "model": shared,
            "tokenizer": self.backend.tokenizer,
            "backend_kwargs": {
                "micro_batch_size": self.backend.micro_batch_size,
                "eos_token_ids": self.backend.eos_token_ids,
                "decode": self.backend.decode,
            },
            "threads": self.threads_each,
        }
        ctx = mp.get_context("spawn")
        try:
            for k in range(self.procs):
                inbox, outbox = ctx.Queue(), ctx.Queue()
                worker = ctx.Process(target=_worker_main, args=(spec, inbox, outbox), name=f"dapo-decode-{k}")
                worker.daemon = True
                worker.start()
                self._workers.append(worker)
                self._inboxes.append(inbox)
                self._outboxes.append(outbox)
            for k in range(len(self._workers)):
                self._receive(k, _START_TIMEOUT_S)  # "ready"
        except BaseException:
            self.close()
            raise

    def decode(
        self, rows: list[tuple[int, int]], prompts: Sequence[list[int]], sampling: SamplingConfig, offset: int
    ) -> list[Decoded | None]:
        """Decode ``rows`` split round-robin over the processes: item k is ``rows[k::procs]``'s (None if empty).
        Call ``prepare`` first, once per ``generate`` call."""
        if not self._workers:
            raise RuntimeError("DecodeProcesses.decode before prepare(): the workers are not running")
        try:
            for k, inbox in enumerate(self._inboxes):
                inbox.put(("decode", rows[k :: self.procs], list(prompts), sampling, offset))
            return [self._receive(k) for k in range(self.procs)]
        except BaseException:
            self.close()  # e.g. Ctrl-C mid-call: a reply left queued would answer the next call
            raise

    def _sync_weights(self) -> None:
        """Copy the module's current parameters and buffers into the workers' shared tensors."""
        assert self._shared is not None  # set by start()
        current, shared = self.backend.model.state_dict(), self._shared.state_dict()
        if current.keys() != shared.keys():
            raise RuntimeError(
                "the rollout model's state-dict keys changed after the decode processes started; "
                "call shutdown() so the next call starts them with the new module"
            )
        with torch.no_grad():
            for name, tensor in shared.items():
                tensor.copy_(current[name])

    def _receive(self, k: int, timeout_s: float | None = None) -> Any:
        """Worker k's next reply; raises with the worker's traceback on an error, or when it died."""
        waited = 0.0
        while True:
            try:
                kind, payload = self._outboxes[k].get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                worker = self._workers[k]
                if not worker.is_alive():
                    self.close()
                    raise RuntimeError(
                        f"decode process {worker.name} exited with code {worker.exitcode} (killed, or out of memory?); "
                        "set rollout.hf_procs: 1 to decode in one process"
                    ) from None
                if timeout_s is not None and waited >= timeout_s:
                    self.close()
                    raise TimeoutError(
                        f"decode process {worker.name} did not answer within {timeout_s:.0f} s"
                    ) from None
        if kind == "error":
            self.close()
            raise RuntimeError(f"decode process dapo-decode-{k} failed (rollout.hf_procs):\n{payload}")
        return payload

    def close(self) -> None:
        """Stop the workers (idempotent); a later ``decode`` starts new ones."""
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        for q in [*self._inboxes, *self._outboxes]:
            q.cancel_join_thread()  # a message to a dead worker may never be read: do not wait to flush it
            q.close()
        self._workers, self._inboxes, self._outboxes = [], [], []
        self._shared = None


def _worker_main(spec: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """A decode process: build the module over the shared tensors, then decode shares until told to stop."""
    try:
        from dapo_core.engines.rollout.hf import HFRolloutBackend

        torch.set_num_threads(spec["threads"])
        backend = HFRolloutBackend(spec["model"], spec["tokenizer"], **spec["backend_kwargs"])
        outbox.put(("ready", None))
    except Exception:
        outbox.put(("error", traceback.format_exc()))
        return
    parent = mp.parent_process()
    while True:
        try:
            message = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # the caller died without close(): do not linger as an orphan
            continue
        if message is None:
            return
        _, rows, prompts, sampling, offset = message
        try:
            with torch.inference_mode():
                decoded = backend._decode_micro_batch(rows, prompts, sampling, offset) if rows else None
            outbox.put(("decoded", decoded))
        except Exception:
            outbox.put(("error", traceback.format_exc()))
