"""What the crash-point tests share (test_crash_points.py: the local executor; test_crash_points_ray.py: Ray): a
real `dapo train` subprocess with an optional fault (dapo_core/faults.py), and the run's final state and metric
history read back for bit-for-bit comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from train_fixtures import make_train_cfg

from dapo_core.algorithm import metric_names as mn
from dapo_core.config import dump_yaml
from dapo_core.engines.checkpoint import list_checkpoints
from dapo_core.faults import FAULT_ENV

REPO = Path(__file__).resolve().parents[2]
DAPO = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import train_fixtures; from flows.cli import app; app()"]  # fmt: skip
STEPS, SAVE_FREQ = 4, 2
COMPARED = [k for k in mn.training_metric_names() if not k.startswith(("timing_s/", "perf/"))]


def command(
    root: Path,
    prefect_api: str,
    *args: str,
    fault: str | None = None,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """`dapo train` on the tests' tiny setup (``STEPS`` steps, a checkpoint every ``SAVE_FREQ``; ``extra`` overrides
    after those), with ``DAPO_FAULT=fault`` when given: the command line and its environment."""
    sets = (f"trainer.total_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}", "trainer.test_freq=2", *extra)
    cfg = make_train_cfg(root, *sets)
    (root / "cfg.yaml").write_text(dump_yaml(cfg))
    full = {**os.environ, "PREFECT_API_URL": prefect_api, "MLFLOW_TRACKING_URI": cfg.tracking.uri, "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    full.pop(FAULT_ENV, None)
    if fault:
        full[FAULT_ENV] = fault
    return [*DAPO, "train", "--config", str(root / "cfg.yaml"), *args], full


def train(root: Path, prefect_api: str, *args: str, **options) -> subprocess.CompletedProcess:
    """Run ``command(root, prefect_api, *args, **options)`` to its end."""
    cmd, env = command(root, prefect_api, *args, **options)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def history(root: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """The run's status and, per compared metric (and the step/checkpoint timings), its (step, value) points."""
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("dapo-flow")
    (run,) = client.search_runs([exp.experiment_id], "attributes.run_name = 't'")
    hist = {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
        for k in [*COMPARED, "timing_s/step", "timing_s/save_checkpoint"]
    }
    return run.info.status, hist


def final_state(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The final weights and the last checkpoint's optimizer/trainer state."""
    last = list_checkpoints(root / "outputs" / "t" / "checkpoints")[-1][1]
    weights = load_file(str(root / "outputs" / "t" / "final" / "model.safetensors"))
    optim = torch.load(last / "trainer_state.pt", map_location="cpu", weights_only=True)
    return weights, optim


def assert_same_tree(a, b, where="optimizer"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_run(root: Path, want: tuple, steps: int) -> None:
    """The run under ``root`` finished with ``want``'s (history, final state): every compared metric at the same
    steps (none missing or twice) with the same values, each step timed once, weights and optimizer equal."""
    (_, want_hist), (want_w, want_opt) = want
    status, hist = history(root)
    assert status == "FINISHED"
    for key in COMPARED:
        assert [s for s, _ in hist[key]] == [s for s, _ in want_hist[key]], f"{key} steps"
        assert hist[key] == want_hist[key], f"{key} values"
    assert [s for s, _ in hist["timing_s/step"]] == list(range(1, steps + 1))
    weights, optim = final_state(root)
    assert weights.keys() == want_w.keys() and all(torch.equal(weights[k], want_w[k]) for k in weights)
    assert_same_tree(want_opt, optim)
