"""SIGKILL a real `dapo train` at each fault point (dapo_core/faults.py), then `--resume`: the final weights, the
optimizer state and the MLflow metric history equal the uninterrupted run's, bit for bit on the CPU; no step is
missing or doubled; a half-written checkpoint is never loaded (and its leftovers are cleaned up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.settings import get_current_settings
from prefect.testing.utilities import prefect_test_harness
from safetensors.torch import load_file
from train_fixtures import make_train_cfg

from dapo_core.algorithm import metric_names as mn
from dapo_core.config import dump_yaml
from dapo_core.engines.checkpoint import list_checkpoints
from dapo_core.faults import FAULT_ENV, POINTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
DAPO = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import train_fixtures; from flows.cli import app; app()"]  # fmt: skip
STEPS, SAVE_FREQ = 4, 2
# where each point strikes: step 3 (after the step-2 checkpoint); logging and checkpoint in step 4, a checkpointed step
# (half its metrics logged: a checkpoint written before them would make resume skip the rest)
FAULT_STEP = {"rollout": 3, "update": 3, "logging": 4, "checkpoint": 4, "between-steps": 3}
COMPARED = [k for k in mn.training_metric_names() if not k.startswith(("timing_s/", "perf/"))]


@pytest.fixture(scope="module")
def prefect_api():
    """One Prefect server for all the `dapo` subprocesses of this module (else each starts its own)."""
    with prefect_test_harness(server_startup_timeout=120):
        yield get_current_settings().api.url


def _train(root: Path, prefect_api: str, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    cfg = make_train_cfg(root, f"trainer.total_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}", "trainer.test_freq=2")
    (root / "cfg.yaml").write_text(dump_yaml(cfg))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "MLFLOW_TRACKING_URI": cfg.tracking.uri, "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([*DAPO, "train", "--config", str(root / "cfg.yaml"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _history(root: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("dapo-flow")
    (run,) = client.search_runs([exp.experiment_id], "attributes.run_name = 't'")
    hist = {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
        for k in [*COMPARED, "timing_s/step", "timing_s/save_checkpoint"]
    }
    return run.info.status, hist


def _final_state(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    last = list_checkpoints(root / "outputs" / "t" / "checkpoints")[-1][1]
    weights = load_file(str(root / "outputs" / "t" / "final" / "model.safetensors"))
    optim = torch.load(last / "trainer_state.pt", map_location="cpu", weights_only=True)
    return weights, optim


def _assert_same_tree(a, b, where="optimizer"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("straight")
    done = _train(root, prefect_api)
    assert done.returncode == 0, done.stdout + done.stderr
    return root, _history(root), _final_state(root)


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_each_point_then_resume_equals_the_uninterrupted_run(point, straight, tmp_path, prefect_api):
    _, (_, want_hist), (want_w, want_opt) = straight
    killed = _train(tmp_path, prefect_api, fault=f"{point}@{FAULT_STEP[point]}")
    assert killed.returncode == -signal.SIGKILL, f"the fault did not strike:\n{killed.stdout}{killed.stderr}"
    ckpts = tmp_path / "outputs" / "t" / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]  # never a half-written step 4 among the complete ones
    if point == "checkpoint":
        assert any(p.name.startswith(".tmp-step_4-") for p in ckpts.iterdir())  # it was mid-write

    resumed = _train(tmp_path, prefect_api, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    status, hist = _history(tmp_path)
    assert status == "FINISHED"
    for key in COMPARED:
        assert [s for s, _ in hist[key]] == [s for s, _ in want_hist[key]], f"{point}: {key} steps"  # none twice
        assert hist[key] == want_hist[key], f"{point}: {key} values"
    assert [s for s, _ in hist["timing_s/step"]] == [1, 2, 3, 4]
    weights, optim = _final_state(tmp_path)
    assert weights.keys() == want_w.keys() and all(torch.equal(weights[k], want_w[k]) for k in weights)
    _assert_same_tree(want_opt, optim)
    assert not any(p.name.startswith(".tmp-step_") for p in ckpts.iterdir())  # the killed write's leftovers went
