"""What a SIGKILL leaves behind: no orphan process, and a flow run that does not stay RUNNING forever.

A real `dapo train` subprocess (its own temporary Prefect API server, as a user's command has; MLflow on SQLite) is
killed with SIGKILL right after its first checkpoint. Every process it had started must be gone within seconds (the
reaper, flows/services/reaper.py); `dapo train --resume` then finishes the run and marks the killed flow run CRASHED, naming
the flow run that resumed it (tasks/flow_runs.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient
from train_fixtures import make_train_cfg

from dapo_core.config import dump_yaml
from dapo_core.engines.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# `dapo` with the tests' rewards registered (the subprocess imports tests/train_fixtures.py first)
DAPO = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import train_fixtures; from flows.cli import app; app()"]  # fmt: skip
SERVER_MARK = "prefect.server.api.server:create_app"


def _env(tracking_uri: str) -> dict[str, str]:
    # no PREFECT_API_URL: each command starts its own temporary Prefect server, as a user's does (same database)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "DAPO_NO_REAPER")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MLFLOW_TRACKING_URI": tracking_uri}


def _descendants(proc: psutil.Process) -> dict[int, tuple[float, str]]:
    out = {}
    for child in proc.children(recursive=True):
        try:
            out[child.pid] = (child.create_time(), " ".join(child.cmdline()))
        except psutil.Error:
            continue
    return out


def _alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigkill_leaves_no_orphan_and_resume_marks_the_killed_flow_run_crashed(tmp_path):
    cfg = make_train_cfg(tmp_path, "trainer.total_steps=4", "trainer.save_freq=1", "trainer.test_freq=0",
                         "trainer.val_before_train=false")  # fmt: skip
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(dump_yaml(cfg))
    ckpts = Path(cfg.trainer.output_dir) / "t" / "checkpoints"
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen([*DAPO, "train", "--config", str(cfg_file)], cwd=REPO, env=_env(cfg.tracking.uri), stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    family: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + 300
    try:
        while latest_checkpoint(ckpts) is None:
            assert proc.poll() is None, f"dapo train ended ({proc.returncode}) before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            family.update(_descendants(psutil.Process(proc.pid)))
            time.sleep(0.05)
        family.update(_descendants(psutil.Process(proc.pid)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    servers = [pid for pid, (_, cmd) in family.items() if SERVER_MARK in cmd]
    assert servers, f"the killed command had no temporary Prefect server: {family}"  # else the test proves nothing
    assert any("flows.services.reaper" in cmd for _, cmd in family.values())
    end = time.monotonic() + 20
    while any(_alive(pid, t) for pid, (t, _) in family.items()) and time.monotonic() < end:
        time.sleep(0.2)
    left = {pid: cmd for pid, (t, cmd) in family.items() if _alive(pid, t)}
    assert not left, f"orphans outlived the killed `dapo train`: {left}"

    # resume: the run finishes, and the killed flow run is CRASHED with the resuming flow run named
    resumed = subprocess.run([*DAPO, "train", "--config", str(cfg_file), "--resume"], cwd=REPO, env=_env(cfg.tracking.uri),
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    run = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id], "attributes.run_name = 't'"
    )[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/step")] == list(range(1, 5))
    killed_id, new_id = run.data.tags["prefect.resumed_flow_run_id"], run.data.tags["prefect.flow_run_id"]
    assert killed_id != new_id

    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as prefect:
        killed = prefect.read_flow_run(UUID(killed_id))
        new = prefect.read_flow_run(UUID(new_id))
    assert killed.state is not None and killed.state.type.value == "CRASHED", killed.state
    assert new_id in (killed.state.message or "") and new.name in (killed.state.message or "")
    assert new.state is not None and new.state.type.value == "COMPLETED"
