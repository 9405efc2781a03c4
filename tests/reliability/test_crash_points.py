"""SIGKILL a real `dapo train` at each fault point (dapo_core/faults.py), then `--resume`: the final weights, the
optimizer state and the MLflow metric history equal the uninterrupted run's, bit for bit on the CPU; no step is
missing or doubled; a half-written checkpoint is never loaded (and its leftovers are cleaned up). The same with the
Ray executor: test_crash_points_ray.py."""

from __future__ import annotations

import signal

import pytest
from crash_harness import STEPS, assert_same_run, final_state, history, train

from dapo_core.engines.checkpoint import list_checkpoints
from dapo_core.faults import POINTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# where each point strikes: step 3 (after the step-2 checkpoint); checkpoint in step 4 (mid-write); logging at step 4's
# checkpoint, which is then complete: the metrics held for it (steps 3 and 4) are being flushed, and half of step 4's
# are out (the resume flushes both steps again; MLflow adds nothing it already holds)
FAULT_STEP = {"rollout": 3, "update": 3, "logging": 4, "checkpoint": 4, "between-steps": 3}
COMPLETE_AFTER = {"logging": [2, 4]}  # the complete checkpoints after the kill (else [2])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("straight")
    done = train(root, prefect_api)
    assert done.returncode == 0, done.stdout + done.stderr
    return history(root), final_state(root)


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_each_point_then_resume_equals_the_uninterrupted_run(point, straight, tmp_path, prefect_api):
    killed = train(tmp_path, prefect_api, fault=f"{point}@{FAULT_STEP[point]}")
    assert killed.returncode == -signal.SIGKILL, f"the fault did not strike:\n{killed.stdout}{killed.stderr}"
    ckpts = tmp_path / "outputs" / "t" / "checkpoints"
    # never a half-written step 4 among the complete ones
    assert [s for s, _ in list_checkpoints(ckpts)] == COMPLETE_AFTER.get(point, [2])
    if point == "checkpoint":
        assert any(p.name.startswith(".tmp-step_4-") for p in ckpts.iterdir())  # it was mid-write

    resumed = train(tmp_path, prefect_api, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_run(tmp_path, straight, STEPS)
    assert not any(p.name.startswith(".tmp-step_") for p in ckpts.iterdir())  # the killed write's leftovers went
