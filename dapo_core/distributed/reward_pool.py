"""Reward pool: rule-based scoring spread over worker processes, every item bounded in time, without signals.

Each reward worker is a Ray actor that streams its results (a Ray streaming generator); the controller waits for
the *next* message of each worker with a deadline of ``item_timeout_s``. An item that overruns it is scored as a
failure (score -1, acc False, pred ``[TIMEOUT]``), its worker process is killed and restarted by Ray, and the
worker resumes after that item. An item whose reward function raises is a failure too (pred ``[ERROR]``), and so
is one that kills its worker twice (``[CRASH]``): a worker that dies on an item (killed from outside: the OOM
killer, an operator, a lost node) is restarted and the item scored again once, so the step's result is the one an
undisturbed pool gives. Failures are counted in ``ScoredBatch.num_failed``; none of them stalls the step. No
SIGALRM: that only works on a main thread (and breaks inside Ray workers); a process boundary bounds even code
that never returns to the interpreter (a C-level regex, a huge integer parse).

Streaming every item on its own cost ~1 ms of Ray round trip per item (0.2-0.4 s for a 384-response batch that
scores in 10 ms), so a worker streams its results in chunks: whatever it scored since its last message, once
``flush_s`` has passed (and at the end). When a chunked stream overruns its deadline or its worker dies, the
controller cannot tell which of the unreported items was at fault; it restarts the worker on them one item per
message (the mode above), which finds the item, scores the others again (same results) and goes back to chunks
after it. An item that hangs therefore costs two deadlines.

This module imports no torch (its workers restart in about a second).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from dapo_core.distributed.faults import ManagedActor, this_node, wait_ready
from dapo_core.distributed.ranges import split_evenly
from dapo_core.rewards import ScoredBatch, get_reward_fn
from dapo_core.rewards.registry import ERROR_PRED, RewardFn

logger = logging.getLogger(__name__)

ROLE = "reward worker"
TIMEOUT_PRED = "[TIMEOUT]"
CRASH_PRED = "[CRASH]"


def _failure(pred: str) -> dict[str, Any]:
    return {"score": -1.0, "acc": False, "pred": pred}


FLUSH_S = 0.02  # a chunked stream reports what it scored at least this often while items keep finishing


class RewardWorker:
    """Ray actor body: scores items in order and streams the results in chunks (see the module docstring)."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    def node_info(self) -> dict[str, Any]:
        return this_node()

    def score_stream(
        self, completions: Sequence[str], ground_truths: Sequence[str], flush_s: float = 0.0
    ) -> Iterator[list[tuple[dict, bool]]]:
        """Yield lists of ``(result, failed)``, in item order: the items scored since the last yield, once
        ``flush_s`` has passed since it (0: one item per yield), and the rest at the end. An exception becomes a
        failure, never a stop."""
        chunk: list[tuple[dict, bool]] = []
        last = time.monotonic()
        for completion, ground_truth in zip(completions, ground_truths, strict=True):
            try:
                chunk.append((self.reward_fn(completion, ground_truth), False))
            except Exception as exc:  # one bad item must not end the stream
                logger.warning("reward function raised %s: %s", type(exc).__name__, exc)
                chunk.append((_failure(ERROR_PRED), True))
            if time.monotonic() - last >= flush_s:
                yield chunk
                chunk, last = [], time.monotonic()
        if chunk:
            yield chunk


@dataclass
class _Stream:
    actor: ManagedActor
    indices: list[int]  # global item indices this stream scores, in order
    gen: Any  # ray ObjectRefGenerator
    pos: int = 0  # next item of ``indices`` to arrive
    deadline: float = 0.0
    retried: int | None = None  # the item this stream already retried after its worker died on it
    broken: bool = False  # the worker died: restart it and go on from ``pos``
    single: bool = False  # one item per message: a failure is the item at ``pos``
    overran: bool = False  # a chunked stream missed its deadline: redo its unreported items one by one


class RewardPool:
    """``reward_workers`` scoring processes with a per-item deadline (see the module docstring)."""

    def __init__(
        self,
        reward: str | RewardFn,
        *,
        num_workers: int,
        item_timeout_s: float,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers ({num_workers}) must be >= 1: set resources.reward_workers")
        if item_timeout_s <= 0:
            raise ValueError(f"item_timeout_s ({item_timeout_s}) must be > 0 seconds: use e.g. 10")
        fn = get_reward_fn(reward) if isinstance(reward, str) else reward
        remote_cls = ray.remote(RewardWorker)
        self.item_timeout_s = item_timeout_s
        self.start_timeout_s = start_timeout_s
        self.actors = [
            ManagedActor(
                ROLE,
                k,
                remote_cls.options(  # type: ignore[attr-defined]
                    num_cpus=0,  # light; never competes with the placement groups' reservations
                    max_restarts=-1,  # a worker killed for a hanging item always comes back
                    max_task_retries=0,
                ).remote(fn),
            )
            for k in range(num_workers)
        ]
        self._ready = False

    def ready(self) -> None:
        """Wait for every worker to start (``score`` does it on first use: startup is no item's time)."""
        if not self._ready:
            wait_ready(self.actors, self.start_timeout_s)
            self._ready = True

    def _start(
        self,
        actor: ManagedActor,
        indices: list[int],
        completions: Sequence[str],
        truths: Sequence[str],
        *,
        single: bool = False,
    ) -> _Stream:
        gen = actor.handle.score_stream.options(num_returns="streaming").remote(
            [completions[i] for i in indices], [truths[i] for i in indices], 0.0 if single else FLUSH_S
        )
        return _Stream(actor, indices, gen, deadline=time.monotonic() + self.item_timeout_s, single=single)

    def score(self, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch:
        """Score ``completions[i]`` against ``ground_truths[i]``; failures (raised, hung, crashed) are counted."""
        if len(completions) != len(ground_truths):
            raise ValueError(
                f"completions ({len(completions)}) and ground_truths ({len(ground_truths)}) must have the same "
                "length: pass one ground truth per completion"
            )
        self.ready()
        results: list[dict[str, Any] | None] = [None] * len(completions)
        num_failed = 0
        streams: list[_Stream] = []
        for actor, (a, b) in zip(self.actors, split_evenly(len(completions), len(self.actors)), strict=True):
            if b > a:
                streams.append(self._start(actor, list(range(a, b)), completions, ground_truths))
        while streams:
            wait_s = max(0.0, min(s.deadline for s in streams) - time.monotonic())
            ready, _ = ray.wait([s.gen for s in streams], num_returns=1, timeout=wait_s)
            now = time.monotonic()
            for stream in list(streams):
                if ready and stream.gen is ready[0]:
                    failed, done = self._advance(stream, results)
                elif now >= stream.deadline:
                    failed, done = self._expire(stream, results)
                else:
                    continue
                num_failed += failed
                if done:
                    streams.remove(stream)
                    rest = stream.indices[stream.pos :]
                    if rest and (failed or stream.broken or stream.overran):  # killed or died: go on
                        stream.actor.wait_alive(self.start_timeout_s)
                        if not stream.single:  # which unreported item was at fault? one by one finds it
                            restarted = self._start(stream.actor, rest, completions, ground_truths, single=True)
                        elif failed:  # the bad item is behind us: chunks again
                            restarted = self._start(stream.actor, rest, completions, ground_truths)
                        else:  # the item it died on is scored again, once, on its own
                            restarted = self._start(stream.actor, rest, completions, ground_truths, single=True)
                            restarted.retried = rest[0]
                        streams.append(restarted)
                        for other in streams:  # the restart wait is not the other items' time
                            other.deadline = max(other.deadline, time.monotonic() + self.item_timeout_s)
        return ScoredBatch([r if r is not None else _failure(ERROR_PRED) for r in results], num_failed)

    def _advance(self, stream: _Stream, results: list[dict[str, Any] | None]) -> tuple[int, bool]:
        """Take the next message of a ready stream. Returns (failures, stream finished or broken)."""
        try:
            chunk = ray.get(next(stream.gen))
        except StopIteration:
            return 0, True
        except RayActorError as exc:  # the worker died: killed from outside, or by an item
            index = stream.indices[stream.pos]
            stream.actor.last_cause = f"{type(exc).__name__}"
            stream.broken = True
            if not stream.single:  # the unreported items go again one by one, none counted as retried yet
                logger.warning(
                    "%s died while scoring from item %d: scoring on again item by item", stream.actor.label, index
                )
                return 0, True
            if stream.retried != index:
                logger.warning(
                    "%s died while scoring item %d (%s): scoring it again on the restarted worker",
                    stream.actor.label, index, type(exc).__name__,
                )  # fmt: skip
                return 0, True
            logger.warning("%s died twice on item %d: scored as a failure", stream.actor.label, index)
            results[index] = _failure(CRASH_PRED)
            stream.pos += 1
            return 1, True
        failures = 0
        for value, item_failed in chunk:
            results[stream.indices[stream.pos]] = value
            stream.pos += 1
            failures += int(item_failed)
        stream.deadline = time.monotonic() + self.item_timeout_s
        return failures, stream.pos >= len(stream.indices)

    def _expire(self, stream: _Stream, results: list[dict[str, Any] | None]) -> tuple[int, bool]:
        """The stream missed its deadline: kill the worker (Ray restarts it). One item per message: that item
        overran, and is failed; chunked: one of the unreported items did, and they are redone one by one."""
        index = stream.indices[stream.pos]
        ray.kill(stream.actor.handle, no_restart=False)
        if not stream.single:
            logger.warning(
                "%s sent nothing for %.1f s from item %d: worker restarted, its unreported items scored one by one",
                stream.actor.label, self.item_timeout_s, index,
            )  # fmt: skip
            stream.overran = True
            return 0, True
        logger.warning(
            "reward item %d took over %.1f s on %s: scored as a failure, worker restarted",
            index,
            self.item_timeout_s,
            stream.actor.label,
        )
        results[index] = _failure(TIMEOUT_PRED)
        stream.pos += 1
        return 1, True

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor.handle, no_restart=True)
