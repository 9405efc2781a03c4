"""The team topology on one machine (``make stack`` = ``dapo stack start``; ``make stack-stop`` = ``dapo stack stop``).

Each component is the real one, started as its own docs say, on loopback, its log and PID under ``outputs/stack/``:

- ``postgres``: a PostgreSQL cluster of the project's own (flows/services/postgres.py), databases ``mlflow`` and
  ``prefect``;
- ``mlflow``: ``mlflow server`` on PostgreSQL, artifacts on disk served through the server (``--serve-artifacts``);
- ``prefect``: ``prefect server start`` on PostgreSQL; then the process work pool (concurrency 1) and
  ``prefect deploy --all`` from prefect.yaml;
- ``ray``: a Ray head (``ray start --head --block``) the flows join through ``RAY_ADDRESS``, with its dashboard (the
  state API); the worker's runs use the Ray executor (``DAPO_EXECUTOR=ray``), so they never start a Ray of their own;
- ``worker``: ``prefect worker start --pool dapo-process`` in the project folder, with the stack's addresses;
- a DVC remote: a folder, ``<state_dir>/dvc-remote``, made the default in ``.dvc/config.local``.

The databases, artifacts and the remote stay in ``outputs/stack/`` between starts. ``dapo stack env`` prints the
variables that point a shell at the stack. Stopping stops the worker first (its flow runs go with it), then Ray,
the servers, and PostgreSQL (a fast shutdown).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from flows.services.postgres import Cluster, PostgresError
from flows.services.procs import launch, log_file, log_tail, pid_file, recorded_process, stop_process, wait_ready
from flows.services.ui import http_request, port_in_use

STATE_FILE = "stack.json"
START_ORDER = ("postgres", "mlflow", "prefect", "ray", "worker")
STOP_ORDER = tuple(reversed(START_ORDER))
LABELS = {"postgres": "PostgreSQL", "mlflow": "MLflow server", "prefect": "Prefect server", "ray": "Ray head",
          "worker": "Prefect worker"}  # fmt: skip
DATABASES = ("mlflow", "prefect")


class StackError(RuntimeError):
    """The stack cannot do what was asked; the message says what, where and how to fix it."""


@dataclass(frozen=True)
class StackSettings:
    """Ports (loopback by default: the stack has no authentication beyond PostgreSQL's password) and folders."""

    host: str = "127.0.0.1"
    postgres_port: int = 5433
    mlflow_port: int = 5001
    prefect_port: int = 4201
    ray_port: int = 6380
    dashboard_port: int = 8266
    state_dir: str = "outputs/stack"
    project_dir: str = "."
    pool: str = "dapo-process"
    ray_cpus: int | None = None
    timeout_s: float = 240.0

    @property
    def state(self) -> Path:
        return Path(self.state_dir).resolve()

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.state / "postgres", self.host, self.postgres_port)

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def prefect_api(self) -> str:
        return f"http://{self.host}:{self.prefect_port}/api"

    @property
    def ray_address(self) -> str:
        return f"{self.host}:{self.ray_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.host}:{self.dashboard_port}"

    @property
    def dvc_remote(self) -> Path:
        return self.state / "dvc-remote"

    def env(self) -> dict[str, str]:
        """What points a shell (and the worker) at the stack."""
        return {
            "PREFECT_API_URL": self.prefect_api,
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "DAPO_MLFLOW_UI_URL": self.mlflow_url,
            "RAY_ADDRESS": self.ray_address,
            "DAPO_EXECUTOR": "ray",
        }


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _base_env() -> dict[str, str]:
    drop = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_DATABASE_CONNECTION_URL", "MLFLOW_TRACKING_URI",
            "RAY_ADDRESS", "PREFECT_PROFILE")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true",
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", RAY_USAGE_STATS_ENABLED="0", DO_NOT_TRACK="1")  # fmt: skip
    return env


def _client_env(s: StackSettings) -> dict[str, str]:
    """The Prefect CLI's environment: the stack's API, a home of its own (profiles), no database of its own."""
    return {**_base_env(), "PREFECT_API_URL": s.prefect_api, "PREFECT_HOME": str(s.state / "prefect-client")}


def _commands(s: StackSettings) -> dict[str, tuple[list[str], dict[str, str], str | None]]:
    """Per component: (command, environment, working directory)."""
    base, pg = _base_env(), s.cluster
    mlflow = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", pg.url("mlflow", "postgresql+psycopg2"),
              "--artifacts-destination", str(s.state / "mlflow-artifacts"), "--serve-artifacts",
              "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1"]  # fmt: skip
    prefect_env = {**base, **pg.client_env(), "PREFECT_HOME": str(s.state / "prefect-server"),
                   "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("prefect", "postgresql+asyncpg"),
                   "PREFECT_UI_API_URL": s.prefect_api, "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}  # fmt: skip
    ray = [_bin("ray"), "start", "--head", "--block", "--node-ip-address", s.host, "--port", str(s.ray_port),
           "--include-dashboard=True", "--dashboard-host", s.host, "--dashboard-port", str(s.dashboard_port),
           "--temp-dir", f"/tmp/dapo-ray-{s.ray_port}", "--disable-usage-stats"]  # fmt: skip
    if s.ray_cpus:
        ray += ["--num-cpus", str(s.ray_cpus)]
    worker = [sys.executable, "-m", "prefect", "worker", "start", "--pool", s.pool, "--type", "process"]
    project = str(Path(s.project_dir).resolve())
    worker_env = {**base, **s.env(), "PREFECT_HOME": str(s.state / "prefect-worker"), "PWD": project}
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", s.host, "--port", str(s.prefect_port)]
    return {
        "postgres": (pg.server_command(), base, None),
        "mlflow": (mlflow, {**base, **pg.client_env()}, None),
        "prefect": (prefect, prefect_env, None),
        "ray": (ray, base, None),
        "worker": (worker, worker_env, project),
    }


# ---------------------------------------------------------------- readiness


def _ray_answers(s: StackSettings) -> bool:
    return http_request(f"{s.dashboard_url}/api/version")[0] == 200


def _worker_online(s: StackSettings) -> bool:
    code, text = http_request(f"{s.prefect_api}/work_pools/{s.pool}/workers/filter", {})
    return code == 200 and any(w.get("status") == "ONLINE" for w in json.loads(text))


def checks(s: StackSettings) -> dict[str, tuple[Callable[[], bool], str]]:
    """Per component: (does it answer, where)."""
    return {
        "postgres": (s.cluster.answers, f"{s.host}:{s.postgres_port}"),
        "mlflow": (lambda: http_request(f"{s.mlflow_url}/health")[0] == 200, s.mlflow_url),
        "prefect": (lambda: http_request(f"{s.prefect_api}/health")[0] == 200, s.prefect_api),
        "ray": (lambda: _ray_answers(s), f"{s.ray_address} (dashboard {s.dashboard_url})"),
        "worker": (lambda: _worker_online(s), f"pool {s.pool}"),
    }


def _wait(s: StackSettings, name: str, started: dict[str, psutil.Process]) -> None:
    ready, where = checks(s)[name]
    wait_ready(ready, name, started, state_dir=s.state, labels=LABELS, what=f"answering at {where}",
               timeout_s=s.timeout_s, command="dapo stack start", error=StackError)  # fmt: skip


# ---------------------------------------------------------------- set-up steps


def _run_step(what: str, cmd: list[str], env: dict[str, str], cwd: str | None, log: Path) -> None:
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              timeout=600, check=False)  # fmt: skip
    if done.returncode != 0:
        raise StackError(f"{what} failed (exit {done.returncode}); last lines of {log}:\n{log_tail(log)}")


def _deploy(s: StackSettings) -> None:
    """The work pool (process type, one flow run at a time) and every deployment of prefect.yaml on it."""
    project = str(Path(s.project_dir).resolve())
    # prefect.yaml's pull step names the folder as {{ $PWD }}, which `prefect deploy` fills in from its environment
    env, log = {**_client_env(s), "PWD": project}, log_file(s.state, "deploy")
    log.unlink(missing_ok=True)
    prefect = [sys.executable, "-m", "prefect"]
    _run_step("creating the work pool", [*prefect, "work-pool", "create", s.pool, "--type", "process",
                                         "--overwrite"], env, project, log)  # fmt: skip
    _run_step("its concurrency limit", [*prefect, "work-pool", "set-concurrency-limit", s.pool, "1"], env, project, log)
    if not (Path(project) / "prefect.yaml").is_file():
        raise StackError(f"no prefect.yaml in {project}: start the stack from the project folder (--project-dir)")
    # prefect.yaml names the pool dapo-process; another pool name is passed to every deployment
    pool = [] if s.pool == "dapo-process" else ["--pool", s.pool]
    _run_step("prefect deploy --all", [*prefect, "--no-prompt", "deploy", "--all", *pool], env, project, log)


def _dvc_remote(s: StackSettings, say: Callable[[str], None]) -> None:
    """The stack's folder remote as the default, in .dvc/config.local (git-ignored): `dvc push` / `dvc pull` use it."""
    project = Path(s.project_dir).resolve()
    if not (project / ".dvc").is_dir():
        say(f"note: {project} is not a DVC repository: no DVC remote configured")
        return
    s.dvc_remote.mkdir(parents=True, exist_ok=True)
    env, log, dvc = _base_env(), log_file(s.state, "dvc"), _bin("dvc")
    _run_step("dvc remote add", [dvc, "remote", "add", "--local", "--force", "stack", str(s.dvc_remote)], env,
              str(project), log)  # fmt: skip
    _run_step("dvc remote default", [dvc, "remote", "default", "--local", "stack"], env, str(project), log)


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


def _running(s: StackSettings) -> dict[str, psutil.Process]:
    found = {}
    for name in START_ORDER:
        proc = recorded_process(s.state, name)
        if proc is not None:
            found[name] = proc
        else:
            pid_file(s.state, name).unlink(missing_ok=True)
    return found


def start(s: StackSettings, say: Callable[[str], None] = print) -> StackSettings:
    """Bring the stack up and wait until each component answers; returns the settings in effect.

    Already running: says so and returns the settings it runs with. On a failure (a StackError saying what and how
    to fix it) stops what it started; the data folders stay."""
    running = _running(s)
    if running:
        if set(running) == set(START_ORDER):
            say("the stack is already running (`dapo stack status`; `make stack-stop` stops it)")
            return saved_settings(s.state_dir) or s
        names = ", ".join(f"{LABELS[n]} (pid {p.pid})" for n, p in running.items())
        raise StackError(f"partly running: {names}. Stop it first with `make stack-stop`, then start again")
    _check_ports(s)
    s.state.mkdir(parents=True, exist_ok=True)
    started: dict[str, psutil.Process] = {}
    cmds: dict[str, tuple[list[str], dict[str, str], str | None]] = {}  # after initdb: they carry its password

    def up(*names: str) -> None:
        for name in names:  # side by side, then waited for in turn
            say(f"starting {LABELS[name]} ...")
            cmd, env, cwd = cmds[name]
            started[name] = launch(s.state, name, cmd, env, cwd=cwd)
        for name in names:
            _wait(s, name, started)

    try:
        s.cluster.init()
        cmds.update(_commands(s))
        up("postgres")
        for db in DATABASES:
            s.cluster.ensure_database(db)
        up("mlflow", "prefect")
        up("ray")
        say("deploying prefect.yaml to the work pool ...")
        _deploy(s)
        up("worker")
        _dvc_remote(s, say)
    except (PostgresError, subprocess.SubprocessError) as exc:
        _stop_started(s, started)
        raise StackError(str(exc)) from exc
    except BaseException:
        _stop_started(s, started)
        raise
    (s.state / STATE_FILE).write_text(json.dumps(asdict(s), indent=2) + "\n", encoding="utf-8")
    return s


RAY_GRACE_S = 2.0  # `ray start --block`, its GCS and raylet outlast a SIGTERM; the head keeps nothing to save


def _stop_one(s: StackSettings, name: str, proc: psutil.Process) -> None:
    if name == "postgres" and s.cluster.initialised():
        try:
            if s.cluster.stop_fast():
                return
        except PostgresError:
            pass
    stop_process(proc, **({"grace_s": RAY_GRACE_S} if name == "ray" else {}))


def _stop_started(s: StackSettings, started: dict[str, psutil.Process]) -> None:
    for name in STOP_ORDER:
        if name in started:
            _stop_one(s, name, started[name])
            pid_file(s.state, name).unlink(missing_ok=True)


def stop(s: StackSettings, say: Callable[[str], None] = print) -> list[str]:
    """Stop the recorded processes (worker, Ray, the servers, PostgreSQL), remove their PID files; returns what it
    stopped. The data folders stay."""
    stopped = []
    for name in STOP_ORDER:
        path = pid_file(s.state, name)
        if not path.exists():
            continue
        proc = recorded_process(s.state, name)
        if proc is None:
            say(f"{LABELS[name]}: not running (stale PID file {path} removed)")
        else:
            _stop_one(s, name, proc)
            stopped.append(name)
            say(f"{LABELS[name]}: stopped (pid {proc.pid})")
        path.unlink(missing_ok=True)
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
