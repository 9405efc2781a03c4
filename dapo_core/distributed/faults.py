"""Fault handling shared by the actor groups: who an actor is, where it runs, and when to give up on it.

Ray restarts a dead actor (``max_restarts``); the groups retry the dead actor's share of the step once on the
restarted process. Each ``ManagedActor`` counts its failures; the ``max_failures``-th raises
``ActorFailureError``, whose message names the actor (role, index, Ray actor id), its node (IP and node id), the
process and the cause, and says what to do.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

logger = logging.getLogger(__name__)

_CAUSE_CHARS = 600


class ActorFailureError(RuntimeError):
    """An actor failed too often (or never came back); the message names actor, node and cause."""

    def __init__(self, message: str, *, role: str, index: int, node: str, cause: str) -> None:
        super().__init__(message)
        self.role = role
        self.index = index
        self.node = node
        self.cause = cause


def this_node() -> dict[str, Any]:
    """Called inside an actor: its node id, node IP and process id."""
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (unwrapping Ray's task-error wrapper), on one line, bounded in length."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    if isinstance(cause, BaseException):
        exc = cause
    text = " ".join(str(exc).split())
    if len(text) > _CAUSE_CHARS:
        text = text[:_CAUSE_CHARS] + " ..."
    return f"{type(exc).__name__}: {text}"


@dataclass
class ManagedActor:
    """A Ray actor handle plus what the controller knows about it (node, failures)."""

    role: str  # "rollout worker", "trainer rank", "reward worker"
    index: int
    handle: Any
    node: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    last_cause: str = ""

    @property
    def actor_id(self) -> str:
        return self.handle._actor_id.hex()

    @property
    def node_label(self) -> str:
        if not self.node:
            return "node unknown"
        return f"node {self.node.get('ip')} (id {str(self.node.get('node_id'))[:12]}, pid {self.node.get('pid')})"

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (actor {self.actor_id[:12]}) on {self.node_label}"

    def refresh_node(self, timeout_s: float) -> None:
        self.node = ray.get(self.handle.node_info.remote(), timeout=timeout_s)

    def error(self, reason: str, fix: str) -> ActorFailureError:
        message = f"{self.label}: {reason}; last cause: {self.last_cause or 'unknown'}. {fix}"
        return ActorFailureError(
            message, role=self.role, index=self.index, node=self.node_label, cause=self.last_cause or "unknown"
        )

    def record_failure(self, exc: BaseException, max_failures: int) -> None:
        """Count a failure; raise ``ActorFailureError`` once ``max_failures`` are reached."""
        self.failures += 1
        self.last_cause = describe(exc)
        logger.warning("%s failed (%d/%d): %s", self.label, self.failures, max_failures, self.last_cause)
        if self.failures >= max_failures:
            raise self.error(
                f"failed {self.failures} time(s), the limit (max_actor_failures={max_failures})",
                "Its log is under the Ray session's logs/ directory (worker-*.err); fix the cause or raise the limit",
            ) from exc

    def wait_alive(self, timeout_s: float) -> None:
        """Block until the (restarting) actor answers, refreshing its node; raise if it does not in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.refresh_node(max(0.1, remaining))
                return
            except (RayActorError, GetTimeoutError) as exc:
                if time.monotonic() >= deadline:
                    self.last_cause = self.last_cause or describe(exc)
                    raise self.error(
                        f"did not come back within {timeout_s:.0f} s after a restart ({describe(exc)})",
                        "Ray's max_restarts may be exhausted or the node lost; check the node and the actor's log",
                    ) from exc
                time.sleep(0.2)


def wait_ready(actors: list[ManagedActor], timeout_s: float) -> None:
    """Wait for freshly created actors (their constructors run in parallel) and record their nodes.

    An actor whose constructor raised, or that is not up in ``timeout_s``, becomes an ``ActorFailureError``.
    """
    refs = [a.handle.node_info.remote() for a in actors]
    for actor, ref in zip(actors, refs, strict=True):
        try:
            actor.node = ray.get(ref, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            actor.failures += 1
            actor.last_cause = describe(exc)
            raise actor.error(
                f"did not start within {timeout_s:.0f} s" if isinstance(exc, GetTimeoutError) else "failed to start",
                "Check that the model path is readable from every node and that the cluster has the resources",
            ) from exc
