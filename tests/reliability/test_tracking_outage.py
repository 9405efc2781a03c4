"""A tracking-server outage mid-run: the HTTP MLflow server (``mlflow server`` on loopback) is stopped for 60 s
while `dapo train` runs. Training goes on (checkpoints keep coming), its MLflow writes wait in the outbox
(tasks/spool.py) and are delivered when the server is back; at the end every step is present exactly once, the
checkpoints logged during the outage are there, the run is FINISHED and its model registered."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_server import free_port, start_server, stop_server
from train_fixtures import make_train_cfg

from dapo_core.algorithm import metric_names as mn
from dapo_core.config import dump_yaml
from dapo_core.engines.checkpoint import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
DAPO = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import train_fixtures; from flows.cli import app; app()"]  # fmt: skip
OUTAGE_S = 60
STEPS = 40


def _latest_step(ckpts: Path) -> int:
    found = list_checkpoints(ckpts)
    return found[-1][0] if found else 0


def test_training_survives_a_60s_tracking_outage_and_loses_no_metric(tmp_path):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    cfg = make_train_cfg(
        tmp_path, f"trainer.total_steps={STEPS}", "trainer.save_freq=5", "trainer.test_freq=10",
        "trainer.val_before_train=false", "algorithm.reward_fn=test_slow_even_length", f"tracking.uri={uri}",
        "trainer.max_ckpt_to_keep=2", "algorithm.dynamic_sampling.enable=false",  # every metric, every step
    )  # fmt: skip
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(dump_yaml(cfg))
    ckpts = Path(cfg.trainer.output_dir) / "t" / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri, "DAPO_TRACKING_OUTAGE_WAIT_S": "600"}
    env.pop("PREFECT_API_URL", None)
    log = (tmp_path / "train.out").open("w")
    train = subprocess.Popen([*DAPO, "train", "--config", str(cfg_file)], cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while _latest_step(ckpts) < 5:
            assert train.poll() is None, (tmp_path / "train.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step-5 checkpoint within 300 s"
            time.sleep(0.2)
        stop_server(server)  # the outage
        down_at = _latest_step(ckpts)
        time.sleep(OUTAGE_S)
        during = _latest_step(ckpts)
        server = start_server(tmp_path, port)  # back, same store, same address
        assert train.wait(timeout=600) == 0, (tmp_path / "train.out").read_text()[-3000:]
    finally:
        if train.poll() is None:
            train.kill()
        log.close()
        stop_server(server)
    server = start_server(tmp_path, port)  # a fresh server to read what was delivered

    try:
        out = (tmp_path / "train.out").read_text()
        assert during >= down_at + 5, f"training stalled during the outage ({down_at} -> {during})"
        assert "tracking server unreachable" in out  # the user was told
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        (run,) = client.search_runs([exp.experiment_id], "attributes.run_name = 't'")
        every_step = list(range(1, STEPS + 1))
        for key in mn.training_metric_names():  # every metric of every step, exactly once, outage included
            want = {"timing_s/save_checkpoint": every_step[4::5], "timing_s/testing": every_step[9::10]}.get(
                key, every_step
            )
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == want, key
        val = client.get_metric_history(run.info.run_id, "val/synthetic/acc/mean_at_2")
        assert sorted(m.step for m in val) == [10, 20, 30, 40]
        logged = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
        # the checkpoints saved while the server was down (and pruned locally since) arrived
        assert {f"checkpoints/step_{s}" for s in range(5, STEPS + 1, 5)} <= logged, logged
        assert run.info.status == "FINISHED" or client.get_run(run.info.run_id).info.status == "FINISHED"
        assert client.get_latest_versions("t")  # the final model was registered
        assert not list((Path(cfg.trainer.output_dir) / ".mlflow-outbox").glob("outbox-*.jsonl"))  # all delivered
    finally:
        stop_server(server)
