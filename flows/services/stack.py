"""The team topology on one machine (``make stack`` = ``dapo stack start``; ``make stack-stop`` = ``dapo stack stop``).

Each component is the real one, started as its own docs say, on loopback, its log and PID under ``outputs/stack/``:

- ``postgres``: a PostgreSQL cluster of the project's own (flows/services/postgres.py), databases ``mlflow`` and
  ``prefect``;
- ``mlflow``: ``mlflow server`` on PostgreSQL, artifacts on disk served through the server (``--serve-artifacts``);
- ``prefect``: ``prefect server start`` on PostgreSQL; then the process work pool (concurrency 1) and
  ``prefect deploy --all`` from prefect.yaml;
- ``ray``: a Ray head (``ray start --head --block``) the flows join through ``RAY_ADDRESS``, with its dashboard (the
  state API); it offers no CPU or GPU, so the work runs on the worker nodes; the worker's runs use the Ray executor
  (``DAPO_EXECUTOR=ray``), so they never start a Ray of their own;
- ``ray-node``: a Ray worker node joined to the head by its address (``ray start --address``), as another machine
  joins; ``--ray-cpus`` sets what it offers;
- ``worker``: ``prefect worker start --pool dapo-process`` in the project folder, with the stack's addresses; its
  flow runs send a heartbeat every ``heartbeat_s``, and an automation on the Prefect server marks a run CRASHED when
  they stop for ``crash_after_s`` (flows/services/prefect_crash.py);
- a DVC remote: a folder, ``<state_dir>/dvc-remote``, made the default in ``.dvc/config.local``.

The databases, artifacts and the remote stay in ``outputs/stack/`` between starts. ``dapo stack env`` prints the
variables that point a shell at the stack. Started again while partly running (a component died), it starts what is
missing with the settings the stack was started with. Stopping stops the worker first (its flow runs go with it), then Ray,
the servers, and PostgreSQL (a fast shutdown).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import psutil

from flows.services import prefect_crash
from flows.services.postgres import PostgresError
from flows.services.procs import (
    launch,
    log_file,
    pid_file,
    recorded_process,
    running_processes,
    stop_process,
    stop_recorded,
)
from flows.services.stack_parts import (
    DATABASES,
    LABELS,
    START_ORDER,
    STATE_FILE,
    STOP_ORDER,
    StackError,
    StackSettings,
    checks,
    component_commands,
    configure_dvc_remote,
    deploy_flows,
    ray_worker_nodes,
    wait_answering,
)
from flows.services.ui import port_in_use

__all__ = ["LABELS", "START_ORDER", "StackError", "StackSettings", "checks", "ray_worker_nodes", "saved_settings",
           "start", "status", "stop"]  # fmt: skip


# ---------------------------------------------------------------- start / stop / status


def _check_ports(s: StackSettings) -> None:
    ports = {"--postgres-port": s.postgres_port, "--mlflow-port": s.mlflow_port, "--prefect-port": s.prefect_port,
             "--ray-port": s.ray_port, "--dashboard-port": s.dashboard_port}  # fmt: skip
    if len(set(ports.values())) < len(ports):
        raise StackError(f"two components on one port ({ports}): give each its own")
    for option, port in ports.items():
        if port_in_use(s.host, port):
            raise StackError(
                f"port {port} on {s.host} is already in use (another program, or the stack of another checkout): "
                f"stop it, or use another: dapo stack start {option} {port + 1}"
            )


def start(s: StackSettings, say: Callable[[str], None] = print) -> StackSettings:
    """Bring the stack up and wait until each component answers; returns the settings in effect.

    Already running: says so and returns the settings it runs with. Partly running (a component died): starts what
    is missing, with the settings it was started with. On a failure (a StackError saying what and how to fix it)
    stops what it started; the data folders stay."""
    running = running_processes(s.state, START_ORDER)
    if running:
        saved = saved_settings(s.state_dir)
        if set(running) == set(START_ORDER):
            say("the stack is already running (`dapo stack status`; `make stack-stop` stops it)")
            return saved or s
        if saved is None:
            names = ", ".join(f"{LABELS[n]} (pid {p.pid})" for n, p in running.items())
            raise StackError(f"partly running ({names}) with no {STATE_FILE} in {s.state}: stop it first with "
                             "`make stack-stop`, then start again")  # fmt: skip
        return _restart_missing(saved, running, say)
    _check_ports(s)
    s.state.mkdir(parents=True, exist_ok=True)
    with _Starter(s, say) as starter:
        s.cluster.init()
        starter.up("postgres")
        for db in DATABASES:
            s.cluster.ensure_database(db)
        starter.up("mlflow", "prefect")
        starter.up("ray")
        starter.up("ray-node")
        say("deploying prefect.yaml to the work pool ...")
        deploy_flows(s)
        _crash_automation(s)
        starter.up("worker")
        configure_dvc_remote(s, say)
    (s.state / STATE_FILE).write_text(json.dumps(asdict(s), indent=2) + "\n", encoding="utf-8")
    return s


class _Starter:
    """Starts components side by side and waits for each in turn. As a context: on any failure inside, stops what
    it started (the data folders stay), a PostgreSQL or subprocess failure raised as a StackError."""

    def __init__(self, s: StackSettings, say: Callable[[str], None]) -> None:
        self.s, self.say = s, say
        self.started: dict[str, psutil.Process] = {}
        self.cmds: dict[str, tuple[list[str], dict[str, str], str | None]] = {}  # built after initdb (its password)

    def up(self, *names: str) -> None:
        if not self.cmds:
            self.cmds = component_commands(self.s)
        for name in names:
            self.say(f"starting {LABELS[name]} ...")
            cmd, env, cwd = self.cmds[name]
            self.started[name] = launch(self.s.state, name, cmd, env, cwd=cwd)
        for name in names:
            wait_answering(self.s, name, self.started, self.cmds[name][0])

    def __enter__(self) -> _Starter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            return
        _stop_started(self.s, self.started)
        if isinstance(exc, (PostgresError, subprocess.SubprocessError)):
            raise StackError(str(exc)) from exc


def _restart_missing(s: StackSettings, running: dict[str, psutil.Process], say: Callable[[str], None]) -> StackSettings:
    """Start the components that are not running, in the start order, with the stack's saved settings ``s``. A
    worker node outlives its head only to leave the cluster: it is restarted with a new head."""
    if "ray" not in running and "ray-node" in running:
        say("the Ray head is gone: its worker node is restarted with it")
        _stop_one(s, "ray-node", running.pop("ray-node"))
        pid_file(s.state, "ray-node").unlink(missing_ok=True)
    missing = [name for name in START_ORDER if name not in running]
    say(f"partly running: starting {', '.join(LABELS[n] for n in missing)} again (the rest runs on)")
    ports = {"postgres": s.postgres_port, "mlflow": s.mlflow_port, "prefect": s.prefect_port, "ray": s.ray_port}
    for name in missing:
        if name in ports and port_in_use(s.host, ports[name]):
            raise StackError(f"{LABELS[name]} is not running but port {ports[name]} on {s.host} is taken (another "
                             "program?): free it, or stop the stack (`make stack-stop`) and start it on other ports")  # fmt: skip
    with _Starter(s, say) as starter:
        for name in missing:
            starter.up(name)
            if name == "prefect":  # its deployments and automation are in PostgreSQL; the automation is checked
                _crash_automation(s)
    return s


def _crash_automation(s: StackSettings) -> None:
    try:
        prefect_crash.ensure(s.prefect_api, s.crash_after_s)
    except RuntimeError as exc:
        raise StackError(f"{exc}; see {log_file(s.state, 'prefect')}") from exc


RAY_GRACE_S = 2.0  # `ray start --block`, its GCS and raylet outlast a SIGTERM; the head keeps nothing to save


def _stop_one(s: StackSettings, name: str, proc: psutil.Process) -> None:
    if name == "postgres" and s.cluster.initialised():
        try:
            if s.cluster.stop_fast():
                return
        except PostgresError:
            pass
    stop_process(proc, **({"grace_s": RAY_GRACE_S} if name in ("ray", "ray-node") else {}))


def _stop_started(s: StackSettings, started: dict[str, psutil.Process]) -> None:
    for name in STOP_ORDER:
        if name in started:
            _stop_one(s, name, started[name])
            pid_file(s.state, name).unlink(missing_ok=True)


def stop(s: StackSettings, say: Callable[[str], None] = print) -> list[str]:
    """Stop the recorded processes (worker, Ray, the servers, PostgreSQL), remove their PID files; returns what it
    stopped. The data folders stay."""
    stopped = stop_recorded(s.state, STOP_ORDER, LABELS, say, lambda name, proc: _stop_one(s, name, proc))
    (s.state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def saved_settings(state_dir: str) -> StackSettings | None:
    """The settings the running stack was started with (``stack.json``), if any."""
    try:
        state = json.loads((Path(state_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fields = StackSettings.__dataclass_fields__
    return StackSettings(**{k: v for k, v in state.items() if k in fields})


def status(s: StackSettings) -> dict[str, str]:
    """Per component: ``running (pid N, answers at WHERE)``, ``running (pid N, NOT answering at WHERE)``, or
    ``not running``."""
    out = {}
    for name, (answers, where) in checks(s).items():
        proc = recorded_process(s.state, name)
        if proc is None:
            stale = " (stale PID file)" if pid_file(s.state, name).exists() else ""
            out[name] = f"not running{stale}"
        else:
            out[name] = f"running (pid {proc.pid}, {'answers' if answers() else 'NOT answering'} at {where})"
    return out
