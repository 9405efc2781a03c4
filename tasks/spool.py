"""The tracking outbox: MLflow writes that find the tracking server unreachable wait on disk, never lost.

Training must not stop because an HTTP tracking server is down for a minute, and no metric may be lost or doubled.
Every write of ``tasks.tracking`` (metrics, params, tags, artifacts, texts, model registration, a run's end) goes
through ``Outbox.submit``: while older items wait, a new one queues behind them (order is kept); otherwise it is sent
at once, and if the server cannot be reached (connection refused/reset, DNS, a timeout on connect) it is appended to
``<dir>/outbox-<pid>.jsonl`` (fsynced) and a warning says so once. Each later write first tries to deliver the
queue, oldest first. Artifacts are queued as a copy (hard links where the file system allows) taken at submit time,
so a checkpoint pruned meanwhile still arrives as it was. At the end of a run ``flush(wait_s)`` waits up to
``DAPO_TRACKING_OUTAGE_WAIT_S`` (default 600 s) for the server; what still cannot be delivered stays on disk and a
later command with the same ``trainer.output_dir`` delivers it (outboxes of processes no longer alive are adopted).

Only unreachability queues: an error the server answers (a bad request, a permission error) is raised as before.
A write that timed out *after* the server received it could be applied twice; connection-refused, the outage case,
cannot.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

QUEUED = "queued"  # what submit returns for an item that waits in the outbox
WAIT_ENV = "DAPO_TRACKING_OUTAGE_WAIT_S"
DEFAULT_WAIT_S = 600.0
_RETRY_EVERY_S = 2.0
_UNREACHABLE_TEXT = (
    "connection refused",
    "failed to establish a new connection",
    "max retries exceeded",
    "connection reset",
    "connection aborted",
    "remote end closed connection",
    "name or service not known",
    "temporary failure in name resolution",
    "connecttimeout",
    "read timed out",
)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything in its cause/context chain) says the server could not be reached."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError)):
            return True
        name = type(cur).__name__
        if name in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "MaxRetryError", "NewConnectionError"):
            return True
        if any(t in str(cur).lower() for t in _UNREACHABLE_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _pid_of(path: Path) -> int | None:
    try:
        return int(path.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


class Outbox:
    """The queue of undelivered tracking writes of this process (module doc)."""

    def __init__(self, root: str | Path, send: Callable[[dict[str, Any]], Any]) -> None:
        self.root = Path(root)
        self.path = self.root / f"outbox-{os.getpid()}.jsonl"
        self._send = send
        self._queue: list[dict[str, Any]] = []
        self._warned = False
        self._next_try = 0.0  # while the server is down, one delivery attempt per _RETRY_EVERY_S, not per write
        self._adopt()

    # ------------------------------------------------------------------ queue on disk
    def _adopt(self) -> None:
        """Take over the queues of dead processes (killed during an outage) that wrote to the same directory."""
        if not self.root.is_dir():
            return
        for other in sorted(self.root.glob("outbox-*.jsonl")):
            pid = _pid_of(other)
            if other == self.path or pid is None or psutil.pid_exists(pid):
                continue
            items = self._read(other)
            if items:
                logger.info("tracking outbox: adopting %d undelivered item(s) of process %d", len(items), pid)
                self._queue.extend(items)
            other.unlink(missing_ok=True)
        if self._queue:
            self._rewrite()

    @staticmethod
    def _read(path: Path) -> list[dict[str, Any]]:
        items = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: the rest is still good
                logger.warning("tracking outbox %s: a line cut by a kill is skipped", path)
        return items

    def _rewrite(self) -> None:
        if not self._queue:
            self.path.unlink(missing_ok=True)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(i, sort_keys=True) + "\n" for i in self._queue), encoding="utf-8")
        os.replace(tmp, self.path)

    def _append(self, item: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._queue.append(item)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(item, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def stash(self, local: str | Path) -> str:
        """A copy of an artifact file or directory as it is now, kept until delivered; returns its path."""
        src = Path(local)
        dst = self.root / "files" / f"{time.time_ns()}-{src.name}"
        dst.parent.mkdir(parents=True, exist_ok=True)

        def link_or_copy(a: str, b: str) -> None:
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)

        if src.is_dir():
            shutil.copytree(src, dst, copy_function=link_or_copy)
        else:
            link_or_copy(str(src), str(dst))
        return str(dst)

    # ------------------------------------------------------------------ sending
    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, item: dict[str, Any], stash: str | Path | None = None) -> Any:
        """Send ``item`` now (after the queue) and return what sending returned, or queue it when the server is
        unreachable and return ``QUEUED``.

        ``stash``: a local artifact the item refers to (as ``item["local"]``), copied only if the item is queued."""
        if self._queue and (time.monotonic() < self._next_try or not self.flush()):
            self._queue_item(item, stash)
            return QUEUED
        try:
            return self._send(item)
        except Exception as exc:
            if not unreachable(exc):
                raise
            self._next_try = time.monotonic() + _RETRY_EVERY_S
            self._queue_item(item, stash)
            return QUEUED

    def queue(self, item: dict[str, Any]) -> None:
        """Queue ``item`` without trying to send it (a write that just failed as unreachable elsewhere)."""
        self._queue_item(item, None)

    def _queue_item(self, item: dict[str, Any], stash: str | Path | None) -> None:
        if stash is not None:
            item = {**item, "local": self.stash(stash), "stashed": True}
        self._append(item)
        if not self._warned:
            self._warned = True
            logger.warning(
                "tracking server unreachable: training goes on, its MLflow writes wait in %s and are delivered "
                "when the server is back (up to %s s at the end of the run)", self.path,
                os.environ.get(WAIT_ENV, DEFAULT_WAIT_S),
            )  # fmt: skip

    def flush(self, wait_s: float = 0.0) -> bool:
        """Deliver the queue oldest first, retrying for up to ``wait_s`` seconds; True when it is empty."""
        deadline = time.monotonic() + wait_s
        while self._queue:
            item = self._queue[0]
            try:
                self._send(item)
            except Exception as exc:
                if not unreachable(exc):
                    logger.error("tracking outbox: the server refused an item (%s); dropped: %s", exc, item.get("kind"))
                else:
                    if time.monotonic() >= deadline:
                        self._rewrite()
                        self._next_try = time.monotonic() + _RETRY_EVERY_S
                        return False
                    time.sleep(_RETRY_EVERY_S)
                    continue
            self._queue.pop(0)
            if item.get("stashed"):
                p = Path(item["local"])
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        self._rewrite()
        if self._warned:
            logger.info("tracking server reachable again: every queued MLflow write delivered")
            self._warned = False
        return True


def wait_s() -> float:
    """How long the end of a run waits for an unreachable tracking server (``DAPO_TRACKING_OUTAGE_WAIT_S``)."""
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S
