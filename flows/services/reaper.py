"""No process a `dapo` command starts outlives it, however the command ends (SIGKILL included).

A `dapo train` killed with SIGKILL runs no cleanup: its temporary Prefect API server (a uvicorn subprocess that
Prefect stops at exit), Ray's local cluster and engine processes would run on as orphans. `start_reaper()` starts a
small watcher in its own session (so a Ctrl-C or a kill of the command's process group does not take it first). It
records the command's descendants every ``interval`` seconds while the command lives; once the command is gone it
sends SIGTERM to each recorded descendant still running (matched by pid *and* start time, so a recycled pid is never
hit), SIGKILL after ``grace`` seconds, and exits. A process started less than ``interval`` before the kill can escape
the record; Prefect's server and Ray start long before any kill that matters.

Enabled for the commands that run flows (`flows/cli/__init__.py`); not for `dapo ui start`, whose servers are meant to
outlive it. ``DAPO_NO_REAPER=1`` turns it off.

Run as ``python -m flows.services.reaper PID START_TIME`` (only `start_reaper` does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

NO_REAPER_ENV = "DAPO_NO_REAPER"
INTERVAL_S = 0.25
GRACE_S = 3.0

_started: subprocess.Popen[bytes] | None = None


def start_reaper() -> subprocess.Popen[bytes] | None:
    """Start the watcher of this process (once per process); None when ``DAPO_NO_REAPER`` is set."""
    global _started
    if os.environ.get(NO_REAPER_ENV, "").strip() not in ("", "0") or _started is not None:
        return _started
    me = psutil.Process()
    _started = subprocess.Popen(
        [sys.executable, "-m", "flows.services.reaper", str(me.pid), repr(me.create_time())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return _started


def _same(proc: psutil.Process, create_time: float) -> bool:
    try:
        return abs(proc.create_time() - create_time) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(pid: int, create_time: float, *, interval: float = INTERVAL_S, grace: float = GRACE_S) -> list[int]:
    """Record ``pid``'s descendants until it is gone, then end those still running; returns the pids signalled."""
    me = os.getpid()
    known: dict[int, float] = {}
    try:
        parent = psutil.Process(pid)
    except psutil.Error:
        return []
    while _same(parent, create_time):
        try:
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass
        known = {p: t for p, t in known.items() if psutil.pid_exists(p)}
        time.sleep(interval)
    return reap(known, grace=grace)


def reap(known: dict[int, float], *, grace: float = GRACE_S) -> list[int]:
    """SIGTERM every live process of ``known`` (pid -> start time), SIGKILL those left after ``grace`` seconds."""
    live = []
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        if _same(proc, started):
            live.append(proc)
    for proc in live:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(live, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)
    return [p.pid for p in live]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the command must not stop its reaper
    watch(int(sys.argv[1]), float(sys.argv[2]))
