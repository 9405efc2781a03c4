"""The team stack end to end: `dapo stack start` brings up PostgreSQL, an MLflow server on it, a Prefect server with
the process work pool, prefect.yaml's deployments and a worker, a Ray head and a DVC remote; the `pipeline`
deployment, triggered through Prefect's REST API, is run by the worker; its runs, metrics, params, artifacts and
registered model are read back through MLflow's REST API and found in PostgreSQL; its actors ran on the Ray head
started beforehand (Ray's state API), which is still up afterwards; `dvc push`, then in a fresh clone `dvc pull`,
and `dvc repro` there is a no-op; `dapo stack stop` leaves no process behind and every port free.

The project folder is a throwaway git + DVC repository holding the project's files (dvc.yaml, prefect.yaml, the
code the stages depend on) and a tiny params.yaml: the worker runs its flows there, as it would in a checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest_data import REPO

from dapo_core.config import dump_yaml, load_config
from flows.services import postgres, stack
from flows.services.ui import free_port, port_in_use

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

BIN = Path(sys.executable).parent
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
TINY = [
    "curation.synthetic.n=400", "curation.val_size=12", "base_model.steps=4", "base_model.batch_size=8",
    "base_model.micro_batch_size=8", "base_model.heldout_size=6", "base_model.heldout_k=2",
    "base_model.warmup_steps=0", "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64", "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=0",
    "trainer.val_before_train=false", "data.train_batch_size=4", "data.gen_batch_size=4",
    "trainer.ppo_mini_batch_size=2", "rollout.n=4", "rollout.val_n=2", "data.max_response_length=24",
    "algorithm.overlong.buffer_length=6", "algorithm.dynamic_sampling.enable=false", "control.pipeline=[]",
    "tracking.log_system_metrics=false", "resources.num_cpus=2",
]  # fmt: skip
PROJECT_FILES = ["dvc.yaml", ".dvcignore", ".gitignore", "prefect.yaml", "dapo_core", "tasks", "flows"]


def _run(cwd: Path, env: dict[str, str], *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


def _wait_for(check: Any, timeout: float, what: str, logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(1.0)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log")))
    raise AssertionError(f"{what}: not within {timeout:.0f}s\n{tails}")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A git + DVC repo with the project's files, a tiny params.yaml and the raw data added to DVC."""
    root = tmp_path_factory.mktemp("team") / "project"
    root.mkdir()
    for rel in PROJECT_FILES:
        src, dst = REPO / rel, root / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    cfg = load_config(recipe="tiny-dapo", overrides=TINY, env={})
    (root / "params.yaml").write_text(dump_yaml(cfg))
    env = _env()
    for cmd in (
        ["git", "init", "-q"],
        ["dvc", "init", "-q"],
        ["dapo", "data", "generate"],
        ["dvc", "add", "-q", "data"],
    ):
        _run(root, env, *cmd)
    _run(root, env, "git", "add", "-A")
    _run(root, env, "git", "commit", "-qm", "the project")
    return root


def _descendants(pids: list[int]) -> set[int]:
    found = set(pids)
    for pid in pids:
        try:
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def team(project) -> Iterator[stack.StackSettings]:
    """`dapo stack start` (the CLI, as `make stack` runs it) on free ports; on the way out `dapo stack stop`, and
    nothing it started may be left running."""
    try:
        postgres.bin_dir()
    except postgres.PostgresError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the stack test: {exc}")
        pytest.skip(str(exc))
    # PostgreSQL runs as its own user when we are root: its folder must be reachable (pytest's tmp folders are 0700)
    state = Path(tempfile.mkdtemp(prefix="dapo-stack-"))
    state.chmod(0o755)
    ports = {opt: free_port() for opt in ("postgres", "mlflow", "prefect", "ray", "dashboard")}
    args = [arg for opt, port in ports.items() for arg in (f"--{opt}-port", str(port))]
    env = _env()
    started = subprocess.run(
        [str(BIN / "dapo"), "stack", "start", "--state-dir", str(state), "--project-dir", str(project),
         "--ray-cpus", "2", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    s = stack.saved_settings(str(state))
    pids = [int(p.read_text()) for p in state.glob("*.pid")]
    try:
        assert started.returncode == 0 and s is not None, started.stdout + started.stderr
        assert all(" answers " in v for v in stack.status(s).values()), stack.status(s)
        yield s
    finally:
        family = _descendants(pids)
        stopped = subprocess.run([str(BIN / "dapo"), "stack", "stop", "--state-dir", str(state)], env=env,
                                 capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        left = {p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        busy = [port for port in ports.values() if port_in_use("127.0.0.1", port)]
        shutil.rmtree(state, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not left, f"still running after `dapo stack stop`: {left}"
        assert not busy, f"ports still taken after `dapo stack stop`: {busy}"


def _mlflow(s: stack.StackSettings, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    r = httpx.request(method, f"{s.mlflow_url}/api/2.0/mlflow/{path}", timeout=30, **kwargs)
    assert r.status_code == 200, (path, r.status_code, r.text[:500])
    return r.json()


def test_a_pipeline_triggered_through_prefect_runs_on_the_team_stack(team, project):
    s, logs = team, Path(team.state_dir)
    http = httpx.Client(base_url=s.prefect_api, timeout=30)
    deps = http.post("/deployments/filter", json={"deployments": {"name": {"any_": ["pipeline"]}}}).json()
    assert len(deps) == 1 and deps[0]["work_pool_name"] == s.pool, deps
    # its runs go to the project folder (prefect.yaml's pull step, filled in by `prefect deploy`), wherever the
    # stack was started from
    (step,) = deps[0]["pull_steps"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == str(project)
    created = http.post(f"/deployments/{deps[0]['id']}/create_flow_run", json={"parameters": {}})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    def finished() -> dict[str, Any] | None:
        run = http.get(f"/flow_runs/{run_id}").json()
        return run if run["state"]["type"] in TERMINAL else None

    run = _wait_for(finished, 900, "the pipeline flow run", logs)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["work_pool_name"] == s.pool and run["infrastructure_pid"], run  # the worker ran it, in a process

    # MLflow, through the server: the pipeline's runs, the training metrics, params, checkpoints, registered model
    exp = _mlflow(s, "GET", "experiments/get-by-name", params={"experiment_name": "dapo-flow"})["experiment"]
    runs = _mlflow(s, "POST", "runs/search", json={"experiment_ids": [exp["experiment_id"]], "max_results": 100})
    by_name = {r["info"]["run_name"]: r for r in runs["runs"]}
    assert {"curate", "base_model", "tiny-dapo", "evaluate-tiny-dapo"} <= set(by_name), sorted(by_name)
    train = by_name["tiny-dapo"]
    assert train["info"]["status"] == "FINISHED"
    metrics = {m["key"] for m in train["data"].get("metrics", [])}
    assert {"train/acc/mean", "actor/pg_loss"} <= metrics, sorted(metrics)
    history = _mlflow(s, "GET", "metrics/get-history", params={"run_id": train["info"]["run_id"],
                                                                 "metric_key": "train/acc/mean"})  # fmt: skip
    assert sorted(m["step"] for m in history["metrics"]) == [1, 2]  # each step once
    params = {p["key"]: p["value"] for p in train["data"]["params"]}
    assert params["resources.executor"] == "ray" and params["resources.ray_address"] == s.ray_address
    models = _mlflow(s, "GET", "registered-models/search")["registered_models"]
    versions = [v for m in models for v in m.get("latest_versions", [])]
    assert any(v["run_id"] == train["info"]["run_id"] for v in versions), models
    listed = _mlflow(s, "GET", "artifacts/list", params={"run_id": train["info"]["run_id"], "path": "checkpoints"})
    assert {f["path"] for f in listed.get("files", [])} == {"checkpoints/step_1", "checkpoints/step_2"}, listed
    # served through the server (--serve-artifacts): stored under the stack's artifact folder, not the worker's
    stored = {p.name for p in (Path(s.state_dir) / "mlflow-artifacts").rglob("step_*") if p.is_dir()}
    assert stored == {"step_1", "step_2"}, stored

    # ... and they are in PostgreSQL, the server's store
    with s.cluster.connect("mlflow") as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM runs WHERE experiment_id = %s", (int(exp["experiment_id"]),))
        assert cur.fetchone()[0] == len(runs["runs"])
        cur.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'train/acc/mean'",
                    (train["info"]["run_id"],))  # fmt: skip
        assert cur.fetchone()[0] == 2

    # Ray: the run's actors ran on the head started before it, which is still up
    from ray.util.state import list_actors

    actors = list_actors(address=s.dashboard_url, limit=1000, raise_on_missing_output=False)
    classes = {a.class_name for a in actors}
    assert any("Trainer" in c for c in classes) and any("Rollout" in c for c in classes), classes
    assert stack.status(s)["ray"].startswith("running") and " answers " in stack.status(s)["ray"]

    # DVC: the run recorded its outputs; push them to the stack's remote, pull them into a fresh clone, repro there
    env = _env()
    assert "up to date" in _run(project, env, "dvc", "status")
    _run(project, env, "git", "add", "-A")
    _run(project, env, "git", "commit", "-qm", "the pipeline's outputs")
    _run(project, env, "dvc", "push")
    assert any(s.dvc_remote.rglob("*")), "nothing pushed to the stack's remote"
    clone = project.parent / "clone"
    _run(project.parent, env, "git", "clone", "-q", str(project), str(clone))
    _run(clone, env, "dvc", "remote", "add", "--local", "-d", "stack", str(s.dvc_remote))
    _run(clone, env, "dvc", "pull")
    out = _run(clone, env, "dvc", "repro")
    assert "Running stage" not in out, out
    assert "up to date" in _run(clone, env, "dvc", "status")


def test_dapo_stack_env_exports_the_stacks_addresses(team):
    out = subprocess.run([str(BIN / "dapo"), "stack", "env", "--state-dir", team.state_dir], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    exported = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
    assert exported == team.env()
