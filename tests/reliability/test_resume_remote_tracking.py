"""Resume against a remote tracking server, as teams run MLflow: `mlflow server` on loopback, the training flow
logging to it over HTTP. A crash mid-run, then `--resume`: every training metric has exactly one point per step,
read back through the server's REST API, with no write to MLflow's tables other than through its API. A kill while
a checkpoint's held metrics were being flushed is made good by the resume (it flushes them again; the server adds
nothing it holds)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_server import free_port, start_server, stop_server
from train_fixtures import make_train_cfg
from train_fixtures import run_train as run

import flows.train as ft
import tasks.train_logging as tl
from dapo_core.algorithm import metric_names as mn
from dapo_core.engines.checkpoint import WRITE_S, read_meta
from tasks import tracking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = ("trainer.total_steps=4", "trainer.save_freq=2")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = start_server(root, port)
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture(scope="module", autouse=True)
def prefect_harness(prefect_api):
    return prefect_api


def _points(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(tracking_uri=uri)
    keys = [k for k in mn.training_metric_names() if not k.startswith(("timing_s/", "perf/"))]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _cfg(root, uri: str, name: str, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the flow reloads its config with the environment on top
    return make_train_cfg(root, *STEPS, f"tracking.uri={uri}", f"tracking.run_name={name}")


def test_crash_then_resume_logs_each_step_once_on_a_remote_server(server, tmp_path, monkeypatch):
    straight = run(_cfg(tmp_path / "a", server, "straight", monkeypatch), tmp_path / "a")
    assert MlflowClient(tracking_uri=server).get_run(straight["run_id"]).info.status == "FINISHED"  # on the server
    want = _points(server, straight["run_id"])
    assert all([s for s, _ in v] == [1, 2, 3, 4] for v in want.values()), want

    # a crash in step 4: step 3 ran (its metrics held for the step-4 checkpoint), the step-2 checkpoint is the last
    cfg = _cfg(tmp_path / "b", server, "crashy", monkeypatch)
    real_step = ft._train_step

    def crash_at_4(run_state, step):
        if step == 4:
            raise RuntimeError("simulated crash in step 4")
        return real_step(run_state, step)

    monkeypatch.setattr(ft, "_train_step", crash_at_4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, tmp_path / "b")
    monkeypatch.setattr(ft, "_train_step", real_step)
    resumed = run(cfg, tmp_path / "b", resume=True)
    assert resumed["run_id"] != straight["run_id"]
    assert _points(server, resumed["run_id"]) == want  # one point per step, the uninterrupted run's values


def test_a_kill_mid_flush_is_made_good_by_the_resume(server, tmp_path, monkeypatch):
    """The step-2 checkpoint is written, then the flush of its held steps dies after step 1: the resume flushes
    both again from the checkpoint; the server keeps one point of step 1 (the same time and value) and gets step 2."""
    cfg = _cfg(tmp_path, server, "midflush", monkeypatch)
    real_log_step = tl.log_step
    sent: list[int] = []

    def dies_after_one_step(metrics, step, timestamp_ms=None):
        if len(sent) == 1 and step == 2:
            raise RuntimeError("simulated kill while flushing")
        sent.append(step)
        return real_log_step(metrics, step, timestamp_ms)

    monkeypatch.setattr(tl, "log_step", dies_after_one_step)
    with pytest.raises(RuntimeError, match="while flushing"):
        run(cfg, tmp_path)
    assert sent == [1]  # step 1 reached the server, step 2 did not
    monkeypatch.setattr(tl, "log_step", real_log_step)
    resumed = run(cfg, tmp_path, resume=True)
    points = _points(server, resumed["run_id"])
    assert all([s for s, _ in v] == [1, 2, 3, 4] for v in points.values()), points


@pytest.mark.parametrize("struck", ["before its save time is logged", "during its upload"])
def test_a_kill_after_a_complete_checkpoint_loses_neither_its_save_time_nor_its_files(
    struck, server, tmp_path, monkeypatch
):
    """Step 2's checkpoint is complete when the process dies, before its save time went out or while its files
    were uploading (one file sent). The resume logs the step-2 save time once, the value the checkpoint records,
    and the server ends up with the whole checkpoint."""
    cfg = _cfg(tmp_path, server, "after-save", monkeypatch)
    if struck.startswith("before"):
        real_save = ft.T.save_checkpoint

        def dies_after_saving(executor, root, step, meta):
            path = real_save(executor, root, step, meta)
            if step == 2:
                raise RuntimeError("simulated kill after the checkpoint")
            return path

        monkeypatch.setattr(ft.T, "save_checkpoint", dies_after_saving)
    else:
        real_upload = tracking.log_artifacts

        def dies_mid_upload(local_dir, artifact_path=None, *, run_id=None):
            if artifact_path == "checkpoints/step_2":
                tracking.log_artifact(Path(local_dir) / "config.json", artifact_path)
                raise RuntimeError("simulated kill after the checkpoint")
            return real_upload(local_dir, artifact_path, run_id=run_id)

        monkeypatch.setattr(tracking, "log_artifacts", dies_mid_upload)
    with pytest.raises(RuntimeError, match="after the checkpoint"):
        run(cfg, tmp_path)
    monkeypatch.undo()
    resumed = run(_cfg(tmp_path, server, "after-save", monkeypatch), tmp_path, resume=True)

    client = MlflowClient(tracking_uri=server)
    saves = sorted((m.step, m.value) for m in client.get_metric_history(resumed["run_id"], "timing_s/save_checkpoint"))
    step_2 = tmp_path / "outputs" / "after-save" / "checkpoints" / "step_2"
    assert saves[0] == (2, read_meta(step_2)[WRITE_S]) and [s for s, _ in saves] == [2, 4], saves
    points = _points(server, resumed["run_id"])
    assert all([s for s, _ in v] == [1, 2, 3, 4] for v in points.values()), points
    sent = {f.path for f in client.list_artifacts(resumed["run_id"], "checkpoints/step_2")}
    local = {f"checkpoints/step_2/{p.name}" for p in step_2.iterdir()}
    assert sent == local, sent ^ local
