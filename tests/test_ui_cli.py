"""`dapo ui start|status|stop` (make ui / make ui-stop): real servers on free ports, PID files, exact stopping.

Every run uses its own PREFECT_HOME, MLflow store and outputs folder (tmp_path), never the user's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from flows.services import ui


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "PREFECT_UI_"))}
    env.update(PREFECT_HOME=str(tmp_path / ".prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    return env


def dapo_ui(tmp_path: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "ui", *args],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _get(url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read().decode()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # reaped by nobody, but not running
    except psutil.NoSuchProcess:
        return True


def _pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in state.glob("*.pid")}


@pytest.mark.slow
def test_start_status_stop_real_servers(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.cli.pipeline import _running_ui_api

    # an experiment in the store beforehand: the MLflow server must show this store, not another one
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db").create_experiment("ui-test-store")
    pp, mp = ui.free_port(), ui.free_port()
    state = tmp_path / "outputs" / "ui"
    try:
        started = dapo_ui(tmp_path, "start", "--prefect-port", str(pp), "--mlflow-port", str(mp), "--timeout", "300")
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"Prefect UI: http://127.0.0.1:{pp}" in started.stdout
        assert f"MLflow UI:  http://127.0.0.1:{mp}" in started.stdout
        pids = _pids(state)
        assert set(pids) == {"prefect", "mlflow", "serve"}
        assert all(not _gone(pid) for pid in pids.values())

        assert _get(f"http://127.0.0.1:{pp}/api/health")[0] == 200
        # the UI's pages call this server's API, not the default port 4200
        assert json.loads(_get(f"http://127.0.0.1:{pp}/ui-settings")[1])["api_url"] == f"http://127.0.0.1:{pp}/api"
        assert _get(f"http://127.0.0.1:{mp}/health")[0] == 200
        _, text = _get(f"http://127.0.0.1:{mp}/api/2.0/mlflow/experiments/search", {"max_results": 50})
        assert "ui-test-store" in {e["name"] for e in json.loads(text)["experiments"]}
        _, text = _get(f"http://127.0.0.1:{pp}/api/deployments/filter", {"limit": 50})
        assert {"pipeline", "train", "curate"} <= {d["name"] for d in json.loads(text)}
        # the server's database is in the PREFECT_HOME given, and `dapo serve` was pointed at these servers
        assert (tmp_path / ".prefect" / "prefect.db").is_file()
        serve_env = psutil.Process(pids["serve"]).environ()
        assert serve_env["PREFECT_API_URL"] == f"http://127.0.0.1:{pp}/api"
        assert serve_env["DAPO_MLFLOW_UI_URL"] == f"http://127.0.0.1:{mp}"
        assert serve_env["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow.db"

        status = dapo_ui(tmp_path, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("running (pid") == 3 and status.stdout.count(" answers at ") == 2

        # `dapo pipeline` here sends its flow runs to this server, but only for the same PREFECT_HOME
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
        assert _running_ui_api() == f"http://127.0.0.1:{pp}/api"
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "another-home"))
        assert _running_ui_api() is None
    finally:
        stopped = dapo_ui(tmp_path, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert all(_gone(pid) for pid in pids.values())
    for name in ("prefect", "mlflow", "serve"):
        assert f"{ui.LABELS[name]}: stopped (pid {pids[name]})" in stopped.stdout
    assert not list(state.glob("*.pid"))
    assert not ui.port_in_use("127.0.0.1", pp) and not ui.port_in_use("127.0.0.1", mp)
    assert (state / "prefect.log").is_file() and (state / "serve.log").is_file()  # the logs stay
    after = dapo_ui(tmp_path, "status")
    assert after.returncode == 1 and after.stdout.count("not running") == 3


def test_port_in_use_is_a_clear_error_and_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        mlflow_port = ui.free_port()
        result = dapo_ui(tmp_path, "start", "--prefect-port", str(port), "--mlflow-port", str(mlflow_port))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert f"PREFECT_PORT={port + 1}" in result.stderr and f"--prefect-port {port + 1}" in result.stderr
    assert not (tmp_path / "outputs" / "ui").exists()  # checked before anything started
    assert not ui.port_in_use("127.0.0.1", mlflow_port)


def test_a_server_that_fails_to_start_is_reported_with_its_log_and_nothing_is_left_running(tmp_path):
    pp, mp = ui.free_port(), ui.free_port()
    result = dapo_ui(tmp_path, "start", "--no-serve", "--store", "bogus://nowhere", "--prefect-port", str(pp),
                     "--mlflow-port", str(mp), "--timeout", "120")  # fmt: skip
    assert result.returncode == 2
    assert "MLflow server exited while starting; last lines of outputs/ui/mlflow.log:" in result.stderr
    assert "'bogus://nowhere'" in result.stderr  # the tail of MLflow's own log names the cause
    state = tmp_path / "outputs" / "ui"
    assert not list(state.glob("*.pid")) and not (state / "ui.json").exists()
    # the Prefect server that did start was stopped again
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(pp) in (p.info["cmdline"] or [])]
    assert not [p for p in leftovers if not _gone(p.pid)]
    assert not ui.port_in_use("127.0.0.1", pp)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_stop_handles_stale_pid_files_and_never_kills_a_recycled_pid(tmp_path):
    state = tmp_path / "outputs" / "ui"
    state.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (state / "prefect.pid").write_text(f"{dead.pid}\n")
    # a PID file older than the live process it names: the PID was reused, that process is not ours
    stranger = _sleeper()
    (state / "mlflow.pid").write_text(f"{stranger.pid}\n")
    old = time.time() - 3600
    os.utime(state / "mlflow.pid", (old, old))
    # and one we did start (the file written after the process began): it is stopped
    ours = _sleeper()
    time.sleep(0.1)
    (state / "serve.pid").write_text(f"{ours.pid}\n")
    try:
        status = dapo_ui(tmp_path, "status")
        assert status.returncode == 1
        assert "Prefect server  not running (stale PID file)" in status.stdout
        assert f"dapo serve      running (pid {ours.pid}" in status.stdout

        stopped = dapo_ui(tmp_path, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert (
            f"Prefect server: not running (stale PID file {Path('outputs/ui/prefect.pid')} removed)" in stopped.stdout
        )
        assert "MLflow server: not running (stale PID file" in stopped.stdout
        assert f"dapo serve: stopped (pid {ours.pid})" in stopped.stdout
        assert ours.wait(timeout=20) is not None  # terminated
        assert stranger.poll() is None  # untouched
        assert not list(state.glob("*.pid"))
    finally:
        for p in (stranger, ours):
            p.kill()
            p.wait()
