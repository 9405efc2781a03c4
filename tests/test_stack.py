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

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from stack_fixtures import BIN, TERMINAL, clean_env, mlflow_api, project_fixture, run_ok, team_fixture, wait_for

from dapo_core.algorithm import metric_names as mn
from dapo_core.engines.checkpoint import list_checkpoints
from flows.services import stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
_ = (project_fixture, team_fixture)  # the module's fixtures (project, team): imported, pytest finds them here


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

    run = wait_for(finished, 900, "the pipeline flow run", logs)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["work_pool_name"] == s.pool and run["infrastructure_pid"], run  # the worker ran it, in a process

    # MLflow, through the server: the pipeline's runs, the training metrics, params, checkpoints, registered model
    exp = mlflow_api(s, "GET", "experiments/get-by-name", params={"experiment_name": "dapo-flow"})["experiment"]
    runs = mlflow_api(s, "POST", "runs/search", json={"experiment_ids": [exp["experiment_id"]], "max_results": 100})
    by_name = {r["info"]["run_name"]: r for r in runs["runs"]}
    assert {"curate", "base_model", "tiny-dapo", "evaluate-tiny-dapo"} <= set(by_name), sorted(by_name)
    train = by_name["tiny-dapo"]
    assert train["info"]["status"] == "FINISHED"
    metrics = {m["key"] for m in train["data"].get("metrics", [])}
    assert {"train/acc/mean", "actor/pg_loss"} <= metrics, sorted(metrics)
    history = mlflow_api(s, "GET", "metrics/get-history", params={"run_id": train["info"]["run_id"],
                                                                 "metric_key": "train/acc/mean"})  # fmt: skip
    assert sorted(m["step"] for m in history["metrics"]) == [1, 2]  # each step once
    params = {p["key"]: p["value"] for p in train["data"]["params"]}
    assert params["resources.executor"] == "ray" and params["resources.ray_address"] == s.ray_address
    models = mlflow_api(s, "GET", "registered-models/search")["registered_models"]
    versions = [v for m in models for v in m.get("latest_versions", [])]
    assert any(v["run_id"] == train["info"]["run_id"] for v in versions), models
    listed = mlflow_api(s, "GET", "artifacts/list", params={"run_id": train["info"]["run_id"], "path": "checkpoints"})
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
    env = clean_env()
    assert "up to date" in run_ok(project, env, "dvc", "status")
    run_ok(project, env, "git", "add", "-A")
    run_ok(project, env, "git", "commit", "-qm", "the pipeline's outputs")
    run_ok(project, env, "dvc", "push")
    assert any(s.dvc_remote.rglob("*")), "nothing pushed to the stack's remote"
    clone = project.parent / "clone"
    run_ok(project.parent, env, "git", "clone", "-q", str(project), str(clone))
    run_ok(clone, env, "dvc", "remote", "add", "--local", "-d", "stack", str(s.dvc_remote))
    run_ok(clone, env, "dvc", "pull")
    out = run_ok(clone, env, "dvc", "repro")
    assert "Running stage" not in out, out
    assert "up to date" in run_ok(clone, env, "dvc", "status")


def test_dapo_stack_env_exports_the_stacks_addresses(team):
    out = subprocess.run([str(BIN / "dapo"), "stack", "env", "--state-dir", team.state_dir], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    exported = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
    assert exported == team.env()


# ---------------------------------------------------------------- faults on the stack

FAULT_STEPS = 40
FAULT_SETS = ["trainer.save_freq=2", "trainer.max_ckpt_to_keep=2", "trainer.test_freq=10"]
OUTAGE_S = 60


def _latest_checkpoint(ckpts: Path) -> int:
    found = list_checkpoints(ckpts) if ckpts.is_dir() else []
    return found[-1][0] if found else 0


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it at once, as when its machine goes away."""
    family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(family, timeout=30)


def test_faults_on_the_team_stack_lose_no_step(team, project):
    """One training run through the `train` deployment, struck three times: a Ray worker node dies (the flow run
    fails saying which rank on which node died and to resume); resumed by the deployment, the Prefect worker's
    machine goes (the server marks the flow run CRASHED when its heartbeats stop); resumed again, the MLflow server
    is down for 60 s (training goes on, its writes wait in the outbox). `dapo stack start` brings back what died
    each time, and the last resume finishes with every metric of every step logged once in the PostgreSQL-backed
    MLflow."""
    s, logs = team, Path(team.state_dir)
    assert (project / "outputs" / "base_model" / "config.json").is_file(), "needs the pipeline test's base model"
    http = httpx.Client(base_url=s.prefect_api, timeout=30)
    (dep,) = http.post("/deployments/filter", json={"deployments": {"name": {"any_": ["train"]}}}).json()
    ckpts = project / "outputs" / "faults" / "checkpoints"
    env = clean_env()

    def trigger(resume: bool) -> str:
        params = {"run_name": "faults", "steps": FAULT_STEPS, "overrides": FAULT_SETS, "resume": resume}
        created = http.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
        assert created.status_code == 201, created.text
        return created.json()["id"]

    def state(run_id: str) -> dict[str, Any]:
        return http.get(f"/flow_runs/{run_id}").json()["state"]

    def saved_at_least(n: int) -> int:
        return wait_for(lambda: (k := _latest_checkpoint(ckpts)) >= n and k, 600, f"a checkpoint of step {n}", logs)

    def restart(component: str) -> None:
        out = run_ok(project, env, str(BIN / "dapo"), "stack", "start", "--state-dir", s.state_dir)
        assert f"starting {stack.LABELS[component]} again" in out, out
        assert all(" answers " in v for v in stack.status(s).values()), stack.status(s)

    # 1. a Ray worker node dies mid-training (its raylet, agents and actors at once): a clear error, no hang
    first = trigger(resume=False)
    saved_at_least(2)
    os.killpg(int((logs / "ray-node.pid").read_text()), signal.SIGKILL)
    ended = wait_for(lambda: (st := state(first))["type"] in TERMINAL and st, 300, "the first run's end", logs)
    assert ended["type"] == "FAILED", ended
    assert "died" in ended["message"] and "dapo train --resume" in ended["message"], ended["message"]
    restart("ray-node")

    # 2. resumed through the deployment, then the worker's machine goes mid-training (the worker and its flow-run
    #    process killed at once): the server marks the flow run CRASHED once its heartbeats stop
    second = trigger(resume=True)
    saved_at_least(_latest_checkpoint(ckpts) + 2)
    assert state(second)["type"] == "RUNNING", "the run ended before the worker was killed: raise FAULT_STEPS"
    _kill_tree(int((logs / "worker.pid").read_text()))
    restart("worker")
    crashed = wait_for(lambda: (st := state(second))["type"] != "RUNNING" and st, 180, "CRASHED by the server", logs)
    assert crashed["type"] == "CRASHED" and "No heartbeat" in crashed["message"], crashed

    # 3. resumed again; the MLflow server goes down for 60 s while it trains: training goes on, its writes wait in
    #    the outbox (the run waits for the server at its end) and arrive once the server is back
    third = trigger(resume=True)
    down_at = saved_at_least(_latest_checkpoint(ckpts) + 2)
    mlflow = psutil.Process(int((logs / "mlflow.pid").read_text()))
    os.killpg(mlflow.pid, signal.SIGTERM)
    psutil.wait_procs([mlflow], timeout=30)
    time.sleep(OUTAGE_S)
    during = _latest_checkpoint(ckpts)
    assert during >= down_at + 4, f"training stalled during the outage ({down_at} -> {during})"
    restart("mlflow")
    ended = wait_for(lambda: (st := state(third))["type"] in TERMINAL and st, 600, "the last run's end", logs)
    assert ended["type"] == "COMPLETED", ended
    assert "tracking server unreachable" in (logs / "worker.log").read_text()  # the user was told

    # every metric of every step once in the remote MLflow, across the three runs; the outage's checkpoints too
    exp = mlflow_api(s, "GET", "experiments/get-by-name", params={"experiment_name": "dapo-flow"})["experiment"]
    runs = mlflow_api(s, "POST", "runs/search", json={"experiment_ids": [exp["experiment_id"]],
                                                      "filter": "attributes.run_name = 'faults'"})["runs"]  # fmt: skip
    (run,) = [r for r in runs if r["info"]["status"] == "FINISHED"]
    run_id = run["info"]["run_id"]
    every = list(range(1, FAULT_STEPS + 1))
    for key in mn.training_metric_names():  # every metric of every step, exactly once, across the four processes
        want = {"timing_s/save_checkpoint": every[1::2], "timing_s/testing": every[9::10]}.get(key, every)
        history = mlflow_api(s, "GET", "metrics/get-history", params={"run_id": run_id, "metric_key": key})
        assert sorted(m["step"] for m in history.get("metrics", [])) == want, key
    listed = mlflow_api(s, "GET", "artifacts/list", params={"run_id": run_id, "path": "checkpoints"})
    logged = {f["path"] for f in listed.get("files", [])}
    assert {f"checkpoints/step_{k}" for k in range(2, FAULT_STEPS + 1, 2)} <= logged, sorted(logged)
    val = mlflow_api(
        s, "GET", "metrics/get-history", params={"run_id": run_id, "metric_key": "val/synthetic/acc/mean_at_2"}
    )
    assert sorted(m["step"] for m in val["metrics"]) == every[9::10]
    versions = mlflow_api(s, "GET", "model-versions/search", params={"filter": f"run_id = '{run_id}'"})
    assert versions.get("model_versions"), "the final model was not registered"
    with s.cluster.connect("mlflow") as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'train/acc/mean'", (run_id,))
        assert cur.fetchone()[0] == FAULT_STEPS
    assert not list((project / "outputs").rglob("outbox-*.jsonl")), "writes left undelivered in the outbox"
