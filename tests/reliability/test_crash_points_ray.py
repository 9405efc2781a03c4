"""The five fault points (dapo_core/faults.py) and a trainer rank killed from outside, with the Ray executor (2 gloo
trainer ranks): one run killed at each in turn and resumed after each kill ends bit for bit where an uninterrupted
Ray run ends (weights, optimizer state, every non-timing metric, each step logged once), and no process of a killed
command (Ray's GCS, raylet, workers, actors) outlives it.

Under Ray the checkpoint is written by trainer rank 0 (an actor): the ``checkpoint`` fault kills that rank mid-write,
and a SIGKILL from outside kills a rank while its peer waits for it; either way the command stops with one error
line naming the dead rank and saying to resume (exit 2). The other four faults kill the command itself (the driver):
``rollout``, ``update`` and ``between-steps`` strike in the same driver process as on the local executor, at other
points of its step, and tests/reliability/test_crash_points.py resumes from each of them; here the driver is killed
once (``logging``, the point that leaves the most to make good: held metrics half flushed), which is what Ray adds to
check: its processes go with the driver and a resume starts both ranks from the checkpoint. One chain instead of
separate runs keeps this to four Ray commands:

    checkpoint@4 (rank 0 mid-write) -> a rank SIGKILLed in step 5 -> logging@6 -> the resume that finishes (no step
    left: it flushes the held metrics again, writes the final model and ends the MLflow run)

A step's metrics are held until the checkpoint covering it is written and logged right after it
(tasks/train_logging.py HeldMetrics), so the ``logging`` fault strikes after the step-6 checkpoint is complete,
while steps 5 and 6 are being flushed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from crash_harness import REPO, assert_same_run, command, final_state, history, train
from test_crash_points import CHAIN as LOCAL_CHAIN

from dapo_core.engines.checkpoint import COMPLETE_MARKER, list_checkpoints
from dapo_core.faults import POINTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 6
RAY = (
    "resources.executor=ray", "resources.num_cpus=2", "resources.trainer_world_size=2",
    "resources.rollout_workers=1", "resources.reward_workers=1", f"trainer.total_steps={STEPS}",
)  # fmt: skip
KILL_RANK = "a trainer rank SIGKILLed from outside"
# (what strikes, the command's exit code, the complete checkpoints after it; the tiny recipe keeps the newest 2)
CHAIN = [
    ("checkpoint@4", 2, [2]),  # rank 0 dies mid-write: the driver reports it and stops
    (KILL_RANK, 2, [2, 4]),  # once step 4 is saved, mid-step 5: its peer is left waiting for it
    ("logging@6", -signal.SIGKILL, [4, 6]),  # the driver: the last step saved, its held metrics half flushed
]
# the points that kill the driver at other places in its step: the same process as on the local executor
DRIVER_ONLY = ("rollout", "update", "between-steps")
MARK = "DAPO_TEST_RAY_CHAIN"  # set in each command's environment: every process it starts inherits it


def _ray_env(mark: str) -> dict[str, str]:
    # Ray's worker processes import the tests' rewards (train_fixtures) by name
    paths = [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p), MARK: mark}


def _marked(mark: str) -> dict[int, str]:
    """The live processes started under ``mark``: pid -> command line."""
    found = {}
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                found[p.info["pid"]] = " ".join(p.cmdline())[:120]
        except psutil.Error:
            continue
    return found


def _no_orphans(mark: str, within_s: float = 30.0) -> None:
    """Every process started under ``mark`` is gone in time (the reaper, flows/services/reaper.py, or Ray's shutdown)."""
    deadline = time.monotonic() + within_s
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not left, f"still running after the command ended: {left}"


def _run_watched(
    cmd: list[str], env: dict[str, str], mark: str, kill_a_rank_after: Path | None = None
) -> tuple[int, str, set[str]]:
    """Run the command, noting what runs under ``mark`` meanwhile; with ``kill_a_rank_after`` (a checkpoint
    directory), SIGKILL a trainer rank as soon as that checkpoint is complete. Returns (exit code, output, the kinds
    of process seen)."""
    seen: set[str] = set()
    kinds = ("raylet", "gcs_server", "TrainerRank", "flows.services.reaper")
    pending = kill_a_rank_after
    with (
        tempfile.TemporaryFile("w+") as log,  # not a pipe: nobody reads it while the run goes on
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                running = _marked(mark)
                seen |= {kind for kind in kinds if any(kind in c for c in running.values())}
                if pending is not None and (pending / COMPLETE_MARKER).is_file():
                    ranks = [pid for pid, c in running.items() if "TrainerRank" in c]
                    assert len(ranks) == 2, running
                    os.kill(ranks[-1], signal.SIGKILL)
                    pending = None
                time.sleep(0.05)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        out = log.read()
    assert pending is None, f"the run ended before {pending} was written:\n{out[-3000:]}"
    return proc.returncode, out, seen


@pytest.fixture(scope="module")
def straight_ray(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("straight_ray")
    mark = uuid.uuid4().hex
    code, out, seen = _run_watched(*command(root, prefect_api, extra=RAY, env=_ray_env(mark)), mark)
    assert code == 0, out[-3000:]
    # else the orphan checks below prove nothing: the marker does reach Ray's processes
    assert seen == {"raylet", "gcs_server", "TrainerRank", "flows.services.reaper"}, seen
    _no_orphans(mark)
    return history(root), final_state(root)


def test_ray_run_killed_by_a_rank_and_a_driver_fault_in_turn_resumes_to_the_uninterrupted_result(
    straight_ray, tmp_path, prefect_api
):
    assert {f.partition("@")[0] for f, _, _ in CHAIN if f != KILL_RANK} | set(DRIVER_ONLY) == set(POINTS)
    # ... which holds while those strike in the driver's code (flows/) only, and the local chain kills at each
    for point in DRIVER_ONLY:
        sources = [p for pkg in ("dapo_core", "tasks", "flows") for p in (REPO / pkg).rglob("*.py")]
        calls = [p for p in sources if f'fault_point("{point}"' in p.read_text()]
        assert calls and all(p.relative_to(REPO).parts[0] == "flows" for p in calls), (point, calls)
        assert any(f.startswith(f"{point}@") for f, _ in LOCAL_CHAIN), point
    ckpts = tmp_path / "outputs" / "t" / "checkpoints"
    for i, (what, code, complete) in enumerate(CHAIN):
        mark = uuid.uuid4().hex
        args = ("--resume",) if i else ()
        fault = None if what == KILL_RANK else what
        cmd, env = command(tmp_path, prefect_api, *args, fault=fault, extra=RAY, env=_ray_env(mark))
        got, out, _ = _run_watched(cmd, env, mark, ckpts / "step_4" if what == KILL_RANK else None)
        assert got == code, f"{what}: exit {got}, expected {code}\n{out[-3000:]}"
        if code == 2:  # one error line naming the rank, its node and process, and what to do
            err = out[out.rfind("error: ") :]
            assert "trainer rank" in err and "died" in err and "dapo train --resume" in err, out[-3000:]
        if what.startswith("checkpoint"):
            assert "trainer rank 0" in out
            assert any(p.name.startswith(".tmp-step_4-") for p in ckpts.iterdir())  # it was mid-write
        assert [s for s, _ in list_checkpoints(ckpts)] == complete, what  # never a half-written one among them
        _no_orphans(mark)

    mark = uuid.uuid4().hex
    resumed = train(tmp_path, prefect_api, "--resume", extra=RAY, env=_ray_env(mark))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    _no_orphans(mark)
    assert_same_run(tmp_path, straight_ray, STEPS)
    assert not any(p.name.startswith(".tmp-step_") for p in ckpts.iterdir())  # the killed write's leftovers went
