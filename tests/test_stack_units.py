"""The team stack's pieces that need no running stack: the crash-detection automation on a real Prefect server (the
session's test server), and `dapo stack start` on a partly running stack (components stood in for by a sleeping
process: only the decisions are tested here; tests/test_stack.py restarts real components)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import httpx
import psutil
import pytest

from flows.services import prefect_crash, stack, stack_parts
from flows.services.procs import pid_file


def _automations(api: str) -> list[dict]:
    found = httpx.post(f"{api}/automations/filter", json={}, timeout=30).json()
    return [a for a in found if a["name"] == prefect_crash.NAME]


def test_the_crash_automation_is_made_once_and_replaced_when_its_wait_changes(prefect_api):
    first = prefect_crash.ensure(prefect_api, 45)
    assert prefect_crash.ensure(prefect_api, 45) == first  # again: nothing new
    (made,) = _automations(prefect_api)
    trigger, (action,) = made["trigger"], made["actions"]
    assert trigger["posture"] == "Proactive" and trigger["within"] == 45.0 and trigger["threshold"] == 1
    assert trigger["after"] == ["prefect.flow-run.heartbeat"] and trigger["for_each"] == ["prefect.resource.id"]
    assert "prefect.flow-run.heartbeat" in trigger["expect"] and "prefect.flow-run.Completed" in trigger["expect"]
    assert action["type"] == "change-flow-run-state" and action["state"] == "CRASHED"
    assert "45 s" in action["message"] and "resume" in action["message"]

    second = prefect_crash.ensure(prefect_api, 60)  # another wait: the old one is replaced, not kept beside it
    (made,) = _automations(prefect_api)
    assert second != first and made["id"] == second and made["trigger"]["within"] == 60.0


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _record(state: Path, name: str, proc: subprocess.Popen) -> None:
    pid_file(state, name).write_text(f"{proc.pid}\n")


def test_a_partly_running_stack_without_its_settings_is_not_guessed_at(tmp_path, sleeper):
    s = stack.StackSettings(state_dir=str(tmp_path))
    _record(tmp_path, "postgres", sleeper)
    with pytest.raises(stack.StackError, match=r"partly running \(PostgreSQL \(pid \d+\)\) with no stack.json"):
        stack.start(s, say=lambda _: None)


def test_a_restart_refuses_a_missing_components_port_taken_by_another_program(tmp_path, sleeper):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = stack.StackSettings(state_dir=str(tmp_path), mlflow_port=port)
        (tmp_path / stack.STATE_FILE).write_text(json.dumps(asdict(s)))
        for name in ("postgres", "prefect", "ray", "ray-node", "worker"):  # everything but the MLflow server
            _record(tmp_path, name, sleeper)
        said: list[str] = []
        with pytest.raises(stack.StackError, match=f"MLflow server is not running but port {port} .* is taken"):
            stack.start(stack.StackSettings(state_dir=str(tmp_path)), say=said.append)
    assert said == ["partly running: starting MLflow server again (the rest runs on)"]
    assert not pid_file(tmp_path, "mlflow").exists()  # nothing was started


def test_a_new_ray_head_gets_a_new_worker_node(tmp_path, sleeper):
    """A worker node of a dead head is stopped and restarted with the new head (here the head's port is taken, so
    the restart stops after that decision)."""
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = stack.StackSettings(state_dir=str(tmp_path), ray_port=taken.getsockname()[1])
        (tmp_path / stack.STATE_FILE).write_text(json.dumps(asdict(s)))
        for name in ("postgres", "mlflow", "prefect", "worker"):
            _record(tmp_path, name, sleeper)
        _record(tmp_path, "ray-node", node)
        said: list[str] = []
        with pytest.raises(stack.StackError, match="Ray head is not running but port"):
            stack.start(s, say=said.append)
    assert node.wait(timeout=30) is not None and not pid_file(tmp_path, "ray-node").exists()
    assert said == ["the Ray head is gone: its worker node is restarted with it",
                    "partly running: starting Ray head, Ray worker node again (the rest runs on)"]  # fmt: skip


def test_the_new_worker_is_awaited_by_the_name_it_was_given(tmp_path, sleeper, prefect_api, monkeypatch):
    """Readiness is the worker of that start (by its --name) being ONLINE, not any worker of the pool; the name comes
    from the command built, since /proc can show an empty command line for a process just past exec()."""
    url = httpx.URL(prefect_api)
    s = stack.StackSettings(state_dir=str(tmp_path), host=url.host, prefect_port=url.port, pool="units-pool",
                            timeout_s=3.0)  # fmt: skip
    assert httpx.post(f"{prefect_api}/work_pools/", json={"name": s.pool, "type": "process"}, timeout=30).is_success
    beat = httpx.post(f"{prefect_api}/work_pools/{s.pool}/workers/heartbeat", json={"name": "old-one"}, timeout=30)
    assert beat.is_success
    proc = psutil.Process(sleeper.pid)
    monkeypatch.setattr(proc, "cmdline", lambda: [])  # what psutil reads in that window
    cmd = ["prefect", "worker", "start", "--pool", s.pool, "--name", "new-one"]
    with pytest.raises(stack.StackError, match=r"Prefect worker .*answering at pool units-pool"):
        stack_parts.wait_answering(s, "worker", {"worker": proc}, cmd)  # another worker online is not this one
    beat = httpx.post(f"{prefect_api}/work_pools/{s.pool}/workers/heartbeat", json={"name": "new-one"}, timeout=30)
    assert beat.is_success
    stack_parts.wait_answering(s, "worker", {"worker": proc}, cmd)  # returns: it is online
