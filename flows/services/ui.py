"""The project's UIs as background processes: a Prefect server, an MLflow server and ``dapo serve`` (``make ui``).

    make ui                                   # = dapo ui start: Prefect http://127.0.0.1:4200, MLflow :5000
    make ui UI_HOST=0.0.0.0 PREFECT_PORT=4300 MLFLOW_PORT=5300
    dapo ui status                            # what runs, and whether it answers
    make ui-stop                              # = dapo ui stop: exactly the processes `make ui` started

Each process runs in its own session (process group), logs to ``outputs/ui/<name>.log`` and has its PID in
``outputs/ui/<name>.pid`` (the PID alone, for ``kill``); ``outputs/ui/ui.json`` records the URLs and stores for
``dapo ui status``. Stopping signals each recorded process group (SIGTERM, then SIGKILL after a grace period) and
removes the PID files; a PID file whose process is gone (or whose PID now belongs to a younger process) is stale
and only removed (``flows.services.procs``). ``dapo serve`` gets ``PREFECT_API_URL`` of this server,
``MLFLOW_TRACKING_URI`` = the store the MLflow server shows, and ``DAPO_MLFLOW_UI_URL``, so the runs it starts link
to the MLflow UI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dapo_core.config.schema import DEFAULT_ARTIFACT_LOCATION, DEFAULT_TRACKING_URI
from flows.services.procs import (
    launch,
    pid_file,
    recorded_process,
    running_processes,
    stop_process,
    stop_recorded,
    wait_ready,
)

STATE_FILE = "ui.json"
STOP_ORDER = ("serve", "prefect", "mlflow")  # serve first, while the API it deregisters from still answers
LABELS = {"prefect": "Prefect server", "mlflow": "MLflow server", "serve": "dapo serve"}
# the deployments `dapo serve` registers (flows.serve.DEPLOYMENTS; kept here so this module never imports Prefect):
# `start` returns only once every one of them is on the server, not after the first
SERVED_STAGES = ("curate", "base-model", "train", "evaluate", "pipeline", "ablation")
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class UiError(RuntimeError):
    """`dapo ui` cannot do what was asked; the message says what, where and how to fix it."""


@dataclass(frozen=True)
class UiSettings:
    """Where the UIs listen and what they show. ``backend_store_uri``/``artifacts`` are the project's MLflow store."""

    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    prefect_home: str = ".prefect"
    backend_store_uri: str = DEFAULT_TRACKING_URI
    artifacts: str = DEFAULT_ARTIFACT_LOCATION
    state_dir: str = "outputs/ui"
    timeout_s: float = 240.0

    @property
    def client_host(self) -> str:
        """The address to call: a wildcard bind (0.0.0.0) is reached on loopback."""
        host = WILDCARD_HOSTS.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host

    @property
    def prefect_url(self) -> str:
        return f"http://{self.client_host}:{self.prefect_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.client_host}:{self.mlflow_port}"


def absolute_store_uri(uri: str) -> str:
    """``sqlite:///mlflow.db`` -> ``sqlite:////abs/mlflow.db``: the servers and ``dapo serve`` agree on one file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and uri != "sqlite:///:memory:":
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def default_store_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` when it names a database (the store runs log to), else the project's SQLite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    return env if env and not env.startswith(("http://", "https://", "databricks")) else DEFAULT_TRACKING_URI


def serve_available() -> bool:
    """Whether this checkout has ``dapo serve`` (flows/cli/serve.py)."""
    return importlib.util.find_spec("flows.cli.serve") is not None


# ---------------------------------------------------------------- readiness


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our servers: never through an http_proxy


def http_request(
    url: str, body: dict | None = None, timeout: float = 3.0, method: str | None = None
) -> tuple[int, str]:
    """(status, body) of a GET (or a JSON POST with ``body``; or ``method``) to one of our servers; (0, "") if it
    does not answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    try:
        with _DIRECT.open(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def prefect_answers(s: UiSettings) -> bool:
    return http_request(f"{s.prefect_url}/api/health")[0] == 200


def mlflow_answers(s: UiSettings) -> bool:
    return http_request(f"{s.mlflow_url}/health")[0] == 200


def served_deployments(s: UiSettings, since: float = 0.0) -> list[str]:
    """Names of the deployments a runner polled for work (or that were updated) after ``since`` (epoch seconds)."""
    from datetime import datetime

    code, text = http_request(f"{s.prefect_url}/api/deployments/filter", {"limit": 200})
    if code != 200:
        return []
    names = []
    for dep in json.loads(text):
        stamps = [dep.get(k) for k in ("last_polled", "updated")]
        times = [datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() for t in stamps if t]
        if any(t >= since for t in times):
            names.append(dep["name"])
    return names


def _wait(s: UiSettings, name: str, started: dict[str, psutil.Process], ready: Callable[[], bool], what: str) -> None:
    wait_ready(ready, name, started, state_dir=s.state_dir, labels=LABELS, what=what, timeout_s=s.timeout_s,
               command="dapo ui start", error=UiError)  # fmt: skip


# ---------------------------------------------------------------- start / stop / status


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now (the OS picks it), for servers started on free ports (tests, screenshots)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails (SO_REUSEADDR as the servers use it: TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(s: UiSettings) -> None:
    for port, option, var in (
        (s.prefect_port, "--prefect-port", "PREFECT_PORT"),
        (s.mlflow_port, "--mlflow-port", "MLFLOW_PORT"),
    ):
        if port_in_use(s.host, port):
            raise UiError(
                f"port {port} on {s.host} is already in use (by another program, or a `make ui` of another "
                f"checkout): stop it, or use another port: make ui {var}={port + 1}  (dapo ui start {option} "
                f"{port + 1})"
            )


def clear_stale(s: UiSettings) -> dict[str, psutil.Process]:
    """The recorded processes still running; PID files of the others are removed."""
    return running_processes(s.state_dir, STOP_ORDER)


def _envs(s: UiSettings) -> dict[str, dict[str, str]]:
    """Each process's environment: the caller's, minus a Prefect API it may point elsewhere, plus ours."""
    base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    base.update(
        PREFECT_HOME=str(Path(s.prefect_home).resolve()), PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )  # fmt: skip
    # The UI's pages call the API at PREFECT_UI_API_URL; `prefect server start --port N` does not set it (the UI
    # would call the default :4200), so point it at this server unless the user chose another address (a proxy).
    # The UI's promotional banners (Prefect Cloud offers) stay off unless asked for.
    prefect = {
        **base,
        "PREFECT_UI_API_URL": os.environ.get("PREFECT_UI_API_URL") or f"{s.prefect_url}/api",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": os.environ.get("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT")
        or "false",
    }
    serve = {
        **base,
        "PREFECT_API_URL": f"{s.prefect_url}/api",
        "MLFLOW_TRACKING_URI": s.backend_store_uri,
        "DAPO_MLFLOW_UI_URL": os.environ.get("DAPO_MLFLOW_UI_URL") or s.mlflow_url,  # the user's wins (a proxy)
    }
    return {"prefect": prefect, "mlflow": base, "serve": serve}


def _commands(s: UiSettings) -> dict[str, list[str]]:
    py = sys.executable
    store = ["--backend-store-uri", s.backend_store_uri, "--artifacts-destination", str(Path(s.artifacts).resolve())]
    bind = ["--host", s.host, "--port", str(s.mlflow_port), "--workers", "1"]  # 1 worker: ~0.5 GB instead of ~1.9
    mlflow = [py, "-m", "mlflow", "server", *store, *bind]
    if s.host not in WILDCARD_HOSTS and s.host not in ("127.0.0.1", "localhost", "::1"):
        # the MLflow server answers 403 to Host headers other than localhost/private IPs unless told otherwise
        mlflow += ["--allowed-hosts", f"{s.host},{s.host}:{s.mlflow_port},localhost:{s.mlflow_port}"]
    return {
        "prefect": [py, "-m", "prefect", "server", "start", "--host", s.host, "--port", str(s.prefect_port)],
        "mlflow": mlflow,
        "serve": [py, "-m", "flows.cli", "serve"],
    }


def start(s: UiSettings, *, serve: bool = True, say: Callable[[str], None] = print) -> UiSettings:
    """Start the servers (and ``dapo serve``) and wait until each answers; returns the settings in effect.

    Already running (all of them): says so and returns the settings they were started with. On a failure (a
    UiError saying what and how to fix it) stops what it started."""
    serve = serve and serve_available()
    wanted = ["prefect", "mlflow", *(["serve"] if serve else [])]
    running = clear_stale(s)
    if running:
        if set(wanted) <= set(running):
            say("already running (`dapo ui status` shows more; `make ui-stop` stops it)")
            return saved_settings(s.state_dir) or s
        names = ", ".join(f"{LABELS[n]} (pid {p.pid})" for n, p in running.items())
        raise UiError(f"partly running: {names}. Stop it first with `make ui-stop` (dapo ui stop), then start again")
    check_ports(s)
    say(f"starting the Prefect server, the MLflow server{' and dapo serve' * serve} (logs in {s.state_dir}/) ...")
    Path(s.state_dir).mkdir(parents=True, exist_ok=True)
    Path(s.prefect_home).mkdir(parents=True, exist_ok=True)
    envs, cmds = _envs(s), _commands(s)
    started: dict[str, psutil.Process] = {}
    try:
        for name in ("prefect", "mlflow"):  # both at once: each takes 5-15 s on a busy machine
            started[name] = launch(s.state_dir, name, cmds[name], envs[name])
        _wait(s, "prefect", started, lambda: prefect_answers(s), f"GET {s.prefect_url}/api/health")
        _wait(s, "mlflow", started, lambda: mlflow_answers(s), f"GET {s.mlflow_url}/health")
        if serve:
            since = time.time() - 1.0
            started["serve"] = launch(s.state_dir, "serve", cmds["serve"], envs["serve"])
            registered = f"deployments {', '.join(SERVED_STAGES)} registered on {s.prefect_url}/api"
            every = set(SERVED_STAGES)
            _wait(s, "serve", started, lambda: every <= set(served_deployments(s, since)), registered)
    except BaseException:
        for name in STOP_ORDER:
            if name in started:
                stop_process(started[name], grace_s=5.0)
                pid_file(s.state_dir, name).unlink(missing_ok=True)
        raise
    state = {**asdict(s), "prefect_url": s.prefect_url, "mlflow_url": s.mlflow_url, "serve": serve}
    (Path(s.state_dir) / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    return s


def stop(s: UiSettings, say: Callable[[str], None] = print) -> list[str]:
    """Stop the recorded processes (serve, then the servers) and remove their PID files; returns what it stopped."""
    stopped = stop_recorded(s.state_dir, STOP_ORDER, LABELS, say, lambda _, proc: stop_process(proc))
    (Path(s.state_dir) / STATE_FILE).unlink(missing_ok=True)
    return stopped


def _saved_state(state_dir: str) -> dict:
    try:
        return json.loads((Path(state_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def saved_settings(state_dir: str) -> UiSettings | None:
    """The settings the running UIs were started with (``ui.json``), if any."""
    state = _saved_state(state_dir)
    if not state:
        return None
    fields = UiSettings.__dataclass_fields__
    return UiSettings(**{k: v for k, v in state.items() if k in fields})


def status(s: UiSettings) -> dict[str, str]:
    """Per process: ``running (pid N, answers URL)``, ``running (pid N, not answering URL)``, ``not running``."""
    checks = {"prefect": (prefect_answers, s.prefect_url), "mlflow": (mlflow_answers, s.mlflow_url)}
    out = {}
    with_serve = _saved_state(s.state_dir).get("serve", True)  # False: started with --no-serve
    for name in ("prefect", "mlflow", *(["serve"] if with_serve else [])):
        proc = recorded_process(s.state_dir, name)
        if proc is None:
            stale = " (stale PID file)" if pid_file(s.state_dir, name).exists() else ""
            out[name] = f"not running{stale}"
        elif name in checks:
            answers, url = checks[name]
            out[name] = f"running (pid {proc.pid}, {'answers' if answers(s) else 'NOT answering'} at {url})"
        else:
            deps = served_deployments(s)
            out[name] = f"running (pid {proc.pid}, {len(deps)} deployments on the Prefect server)"
    return out
