"""SIGKILL a real `dapo train` at each fault point (dapo_core/faults.py) in turn, resuming after each kill: the
run ends with the weights, the optimizer state and the MLflow metric history of the uninterrupted run, bit for bit on
the CPU; no step is missing or doubled; a half-written checkpoint is never loaded (and its leftovers are cleaned up).
The same with the Ray executor: test_crash_points_ray.py.

One chain of kills instead of a kill and a resume per point keeps this to 7 commands (11 before): each resume is
the next kill's run, so it starts from what the previous kill left (the checkpoints, half-logged metrics, a
half-written checkpoint folder)::

    rollout@3 -> update@3 -> between-steps@3 -> checkpoint@4 (mid-write) -> logging@4 (step 4's checkpoint complete,
    its held metrics half flushed) -> the resume that finishes (no step left: it flushes the held metrics again,
    writes the final model and ends the MLflow run)
"""

from __future__ import annotations

import signal

import pytest
from crash_harness import STEPS, assert_same_run, final_state, history, train

from dapo_core.engines.checkpoint import list_checkpoints
from dapo_core.faults import POINTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# (the fault, the complete checkpoints after it); the tiny setup saves every 2 steps and keeps the newest 2
CHAIN = [
    ("rollout@3", [2]),  # samples generated, not scored
    ("update@3", [2]),  # the policy moved, nothing saved or logged
    ("between-steps@3", [2]),  # step 3 done, its metrics held for the step-4 checkpoint
    ("checkpoint@4", [2]),  # mid-write: never listed among the complete ones
    ("logging@4", [2, 4]),  # step 4's checkpoint complete, the metrics held for it (steps 3 and 4) half flushed
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("straight")
    done = train(root, prefect_api)
    assert done.returncode == 0, done.stdout + done.stderr
    return history(root), final_state(root)


def test_killed_at_every_point_in_turn_then_resumed_equals_the_uninterrupted_run(straight, tmp_path, prefect_api):
    assert {fault.partition("@")[0] for fault, _ in CHAIN} == set(POINTS)
    ckpts = tmp_path / "outputs" / "t" / "checkpoints"
    for i, (fault, complete) in enumerate(CHAIN):
        killed = train(tmp_path, prefect_api, *(("--resume",) if i else ()), fault=fault)
        assert killed.returncode == -signal.SIGKILL, f"{fault} did not strike:\n{killed.stdout}{killed.stderr}"
        assert [s for s, _ in list_checkpoints(ckpts)] == complete, fault  # never a half-written one among them
        if fault.startswith("checkpoint"):
            assert any(p.name.startswith(".tmp-step_4-") for p in ckpts.iterdir())  # it was mid-write

    resumed = train(tmp_path, prefect_api, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_run(tmp_path, straight, STEPS)
    assert not any(p.name.startswith(".tmp-step_") for p in ckpts.iterdir())  # the killed write's leftovers went
