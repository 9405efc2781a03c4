"""A trainer rank killed mid-run (the Ray executor, 2 gloo ranks): the run stops with an error naming the rank and
saying how to resume; `dapo train --resume` continues from the last checkpoint and finishes every step once."""

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
from dapo_core.engines.checkpoint import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
DAPO = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import train_fixtures; from flows.cli import app; app()"]  # fmt: skip
STEPS = 6


def _rank_pids(root: psutil.Process) -> list[int]:
    """The trainer-rank actor processes under the command (Ray names them ray::TrainerRank...)."""
    pids = []
    for p in root.children(recursive=True):
        try:
            if "TrainerRank" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def test_a_killed_trainer_rank_stops_the_run_naming_it_and_resume_finishes(tmp_path):
    cfg = make_train_cfg(
        tmp_path, f"trainer.total_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "resources.executor=ray", "resources.num_cpus=2",
        "resources.trainer_world_size=2", "resources.rollout_workers=1", "resources.reward_workers=1",
        "algorithm.reward_fn=test_slow_even_length",
    )  # fmt: skip
    (tmp_path / "cfg.yaml").write_text(dump_yaml(cfg))
    ckpts = Path(cfg.trainer.output_dir) / "t" / "checkpoints"
    # PYTHONPATH: Ray's worker processes import the test reward (train_fixtures) by name
    paths = [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "MLFLOW_TRACKING_URI": cfg.tracking.uri, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in paths if p)}  # fmt: skip
    env.pop("PREFECT_API_URL", None)
    cmd = [*DAPO, "train", "--config", str(tmp_path / "cfg.yaml")]
    out = (tmp_path / "killed.out").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not list_checkpoints(ckpts):
            assert proc.poll() is None, (tmp_path / "killed.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.2)
        ranks = _rank_pids(psutil.Process(proc.pid))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    text = (tmp_path / "killed.out").read_text()
    assert code != 0
    assert "trainer rank" in text and "died" in text and "dapo train --resume" in text, text[-3000:]
    done = [s for s, _ in list_checkpoints(ckpts)]
    assert done and done[-1] < STEPS

    resumed = subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], "attributes.run_name = 't'")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/step")) == list(range(1, STEPS + 1))
