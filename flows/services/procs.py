"""Background processes of ``dapo ui`` and ``dapo stack``: PID and log files, waiting until they answer, and
stopping a process group.

Each process runs in its own session (process group), logs to ``<state_dir>/<name>.log`` and has its PID in
``<state_dir>/<name>.pid``. A PID file whose process is gone, or whose PID now belongs to a process younger than
the file, is stale. Stopping signals the whole group (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

GRACE_S = 15.0


def pid_file(state_dir: str | Path, name: str) -> Path:
    """``<state_dir>/<name>.pid``: the PID alone, for ``kill``."""
    return Path(state_dir) / f"{name}.pid"


def log_file(state_dir: str | Path, name: str) -> Path:
    """``<state_dir>/<name>.log``: the process's stdout and stderr."""
    return Path(state_dir) / f"{name}.log"


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def recorded_process(state_dir: str | Path, name: str) -> psutil.Process | None:
    """The live process a PID file names, or None (no file, process gone, or the PID reused by a younger one).

    A process we started is older than its PID file (written right after the start); a recycled PID is not."""
    path = pid_file(state_dir, name)
    try:
        pid = int(path.read_text().split()[0])
        proc = psutil.Process(pid)
        if proc.create_time() > path.stat().st_mtime + 1.0 or not alive(proc):
            return None
        return proc
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def running_processes(state_dir: str | Path, names: Sequence[str]) -> dict[str, psutil.Process]:
    """Of ``names``, the recorded processes still running (by their PID files); stale PID files are removed."""
    running = {}
    for name in names:
        proc = recorded_process(state_dir, name)
        if proc is not None:
            running[name] = proc
        else:
            pid_file(state_dir, name).unlink(missing_ok=True)
    return running


def stop_recorded(
    state_dir: str | Path,
    names: Sequence[str],
    labels: Mapping[str, str],
    say: Callable[[str], None],
    stop_one: Callable[[str, psutil.Process], None],
) -> list[str]:
    """Stop the recorded processes of ``names`` in that order (``stop_one(name, proc)``), removing their PID files
    (stale ones too, said so); returns the names it stopped."""
    stopped = []
    for name in names:
        path = pid_file(state_dir, name)
        if not path.exists():
            continue
        proc = recorded_process(state_dir, name)
        if proc is None:
            say(f"{labels[name]}: not running (stale PID file {path} removed)")
        else:
            stop_one(name, proc)
            stopped.append(name)
            say(f"{labels[name]}: stopped (pid {proc.pid})")
        path.unlink(missing_ok=True)
    return stopped


def launch(
    state_dir: str | Path, name: str, cmd: Sequence[str], env: dict[str, str], cwd: str | None = None
) -> psutil.Process:
    """Start ``cmd`` (in ``cwd``) in its own session, logging to ``log_file`` and recording its PID in ``pid_file``."""
    log = log_file(state_dir, name).open("w", encoding="utf-8")
    with log:
        popen = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: `dapo ui stop` signals exactly it and its children
        )
    pid_file(state_dir, name).write_text(f"{popen.pid}\n")
    return psutil.Process(popen.pid)


def stop_process(proc: psutil.Process, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the process group ``proc`` leads (and to its descendants), SIGKILL whatever is left after
    ``grace_s``."""
    try:
        family = [proc, *proc.children(recursive=True)]
        group = os.getpgid(proc.pid) if os.getpgid(proc.pid) == proc.pid else None
    except (psutil.Error, ProcessLookupError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(alive(p) for p in family):
            return


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log, indented, for an error message."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(f"    {line}" for line in text[-lines:]) or "    (empty log)"


def wait_ready(
    ready: Callable[[], bool],
    name: str,
    started: Mapping[str, psutil.Process],
    *,
    state_dir: str | Path,
    labels: Mapping[str, str],
    what: str,
    timeout_s: float,
    command: str,
    error: type[Exception],
) -> None:
    """Poll ``ready()`` until it holds. A started process that exits meanwhile, or the timeout, raises ``error``
    with the last lines of the log concerned and what to do (``command``: how the user starts it again)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for other, proc in started.items():
            if not alive(proc):
                log = log_file(state_dir, other)
                raise error(
                    f"{labels[other]} exited while starting; last lines of {log}:\n{log_tail(log)}\n"
                    f"Fix the cause above, then `{command}` again (what was started has been stopped)"
                )
        if time.monotonic() > deadline:
            log = log_file(state_dir, name)
            raise error(
                f"{labels[name]} did not become ready within {timeout_s:.0f}s ({what}); last lines of {log}:\n"
                f"{log_tail(log)}\nFix the cause above, or wait longer: {command} --timeout {2 * timeout_s:.0f}"
            )
        time.sleep(0.5)
