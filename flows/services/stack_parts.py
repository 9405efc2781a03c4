"""The team stack's parts: its settings, each component's command and readiness check, and the set-up steps
(the work pool and prefect.yaml's deployments, the DVC remote). flows/services/stack.py starts and stops them."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from flows.services.postgres import Cluster
from flows.services.procs import log_file, log_tail, wait_ready
from flows.services.ui import free_port, http_request

STATE_FILE = "stack.json"
START_ORDER = ("postgres", "mlflow", "prefect", "ray", "ray-node", "worker")
STOP_ORDER = tuple(reversed(START_ORDER))
LABELS = {"postgres": "PostgreSQL", "mlflow": "MLflow server", "prefect": "Prefect server", "ray": "Ray head",
          "ray-node": "Ray worker node", "worker": "Prefect worker"}  # fmt: skip
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
    heartbeat_s: int = 30
    crash_after_s: int = 90
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


def component_commands(s: StackSettings) -> dict[str, tuple[list[str], dict[str, str], str | None]]:
    """Per component: (command, environment, working directory)."""
    base, pg = _base_env(), s.cluster
    mlflow = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", pg.url("mlflow", "postgresql+psycopg2"),
              "--artifacts-destination", str(s.state / "mlflow-artifacts"), "--serve-artifacts",
              "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1"]  # fmt: skip
    prefect_env = {**base, **pg.client_env(), "PREFECT_HOME": str(s.state / "prefect-server"),
                   "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("prefect", "postgresql+asyncpg"),
                   "PREFECT_UI_API_URL": s.prefect_api, "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}  # fmt: skip
    ray_common = ["--block", "--node-ip-address", s.host, "--temp-dir", f"/tmp/dapo-ray-{s.ray_port}",
                  "--disable-usage-stats"]  # fmt: skip
    ray = [_bin("ray"), "start", "--head", "--port", str(s.ray_port), "--num-cpus", "0", "--num-gpus", "0",
           "--include-dashboard=True", "--dashboard-host", s.host, "--dashboard-port", str(s.dashboard_port),
           *ray_common]  # fmt: skip
    # a second node on the same host: its agents on ports of its own (the head's take the defaults)
    node = [_bin("ray"), "start", "--address", s.ray_address, *ray_common,
            *(arg for opt in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                              "--runtime-env-agent-port", "--metrics-export-port")
              for arg in (opt, str(free_port(s.host))))]  # fmt: skip
    if s.ray_cpus:
        node += ["--num-cpus", str(s.ray_cpus)]
    # a name of its own each start: a killed worker's record stays ONLINE in Prefect for a while
    worker = [sys.executable, "-m", "prefect", "worker", "start", "--pool", s.pool, "--type", "process", "--name",
              f"{s.pool}-worker-{uuid.uuid4().hex[:8]}"]  # fmt: skip
    project = str(Path(s.project_dir).resolve())
    worker_env = {**base, **s.env(), "PREFECT_HOME": str(s.state / "prefect-worker"), "PWD": project,
                  "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(s.heartbeat_s)}  # fmt: skip
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", s.host, "--port", str(s.prefect_port)]
    return {
        "postgres": (pg.server_command(), base, None),
        "mlflow": (mlflow, {**base, **pg.client_env()}, None),
        "prefect": (prefect, prefect_env, None),
        "ray": (ray, base, None),
        "ray-node": (node, base, None),
        "worker": (worker, worker_env, project),
    }


# ---------------------------------------------------------------- readiness


def _ray_answers(s: StackSettings) -> bool:
    return http_request(f"{s.dashboard_url}/api/version")[0] == 200


def ray_worker_nodes(s: StackSettings, started_after: float = 0.0) -> int:
    """How many worker nodes (not the head) the Ray cluster has alive, started after ``started_after`` (epoch
    seconds), by its state API; 0 if it does not answer. (A node killed a moment ago may still be listed alive.)"""
    code, text = http_request(f"{s.dashboard_url}/api/v0/nodes?limit=1000&detail=1", timeout=10)
    if code != 200:
        return 0
    nodes = json.loads(text)["data"]["result"]["result"]
    return sum(
        1 for n in nodes
        if not n.get("is_head_node") and n.get("state") == "ALIVE" and n.get("start_time_ms", 0) >= started_after * 1e3
    )  # fmt: skip


def _worker_online(s: StackSettings, named: str | None = None) -> bool:
    """Whether a worker of the pool (the one ``named``, if given) is ONLINE in Prefect."""
    code, text = http_request(f"{s.prefect_api}/work_pools/{s.pool}/workers/filter", {})
    found = json.loads(text) if code == 200 else []
    return any(w.get("status") == "ONLINE" and named in (None, w.get("name")) for w in found)


def checks(s: StackSettings) -> dict[str, tuple[Callable[[], bool], str]]:
    """Per component: (does it answer, where)."""
    return {
        "postgres": (s.cluster.answers, f"{s.host}:{s.postgres_port}"),
        "mlflow": (lambda: http_request(f"{s.mlflow_url}/health")[0] == 200, s.mlflow_url),
        "prefect": (lambda: http_request(f"{s.prefect_api}/health")[0] == 200, s.prefect_api),
        "ray": (lambda: _ray_answers(s), f"{s.ray_address} (dashboard {s.dashboard_url})"),
        "ray-node": (lambda: ray_worker_nodes(s) > 0, f"the head {s.ray_address}"),
        "worker": (lambda: _worker_online(s), f"pool {s.pool}"),
    }


def wait_answering(s: StackSettings, name: str, started: dict[str, psutil.Process], cmd: Sequence[str]) -> None:
    """Wait until component ``name``, just started with ``cmd``, answers (any started process dying is an error)."""
    ready, where = checks(s)[name]
    if name == "worker":  # the one just started, by the name on the command it was given: not read back from /proc,
        # where a process just past exec() can still show an empty command line
        ready = functools.partial(_worker_online, s, cmd[list(cmd).index("--name") + 1])
    elif name == "ray-node":  # a node that joined after this launch (1 s: clock granularity)
        since = started[name].create_time() - 1.0
        ready = lambda: ray_worker_nodes(s, since) > 0  # noqa: E731
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


def deploy_flows(s: StackSettings) -> None:
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


def configure_dvc_remote(s: StackSettings, say: Callable[[str], None]) -> None:
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
