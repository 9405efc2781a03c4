"""`dapo serve` for real: a Prefect server on a free port, `dapo serve` against it, runs triggered through the REST
API the UI uses; plus the deployments' parameter forms, prefect.yaml, the MLflow experiment kind and the tests' own
Prefect/MLflow stores."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import mlflow
import pytest
import yaml
from conftest import TEST_MLFLOW_URI, TEST_STORES
from mlflow.tracking import MlflowClient

from dapo_core.config import ConfigError, load_config
from flows import serve as S
from flows.services.ui import free_port
from tasks import tracking

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PARAMS = str(REPO / "params.yaml")
SMALL = ["curation.synthetic.n=400", "curation.val_size=25", "tracking.log_system_metrics=false"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


# ---------------- the deployments' parameters (the UI's form) ----------------


@pytest.mark.parametrize("stage", list(S.DEPLOYMENTS))
def test_every_parameter_has_a_type_a_default_and_help(stage):
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(S.DEPLOYMENTS[stage]).model_dump_for_openapi()
    props = schema["properties"]
    assert not schema.get("required")  # every field has a default: "Run" works without filling the form
    assert {"config_path", "recipe", "overrides"} <= set(props)
    for name, prop in props.items():
        assert len(prop.get("description", "")) > 15, f"{stage}.{name} has no help text"
        assert "type" in prop or "anyOf" in prop, f"{stage}.{name} is untyped"
    assert props["overrides"]["type"] == "array" and props["overrides"]["default"] == []


def test_named_parameters_become_overrides_that_the_config_accepts():
    from flows.stage_params import TRAIN, stage_values

    v = stage_values(
        TRAIN,
        {
            "overrides": ["trainer.total_steps=3"],
            "run_name": "ui-run",
            "model_path": "runs:/abc/model",
            "train_files": ["a b.parquet"],
            "lr": None,
        },
    )
    assert v.overrides == [
        "trainer.total_steps=3",
        'tracking.run_name="ui-run"',
        'model.path="runs:/abc/model"',
        'data.train_files=["a b.parquet"]',
    ]
    cfg = load_config(config_path=PARAMS, overrides=v.overrides, env={})
    assert (cfg.tracking.run_name, cfg.model.path, cfg.data.train_files) == (
        "ui-run",
        "runs:/abc/model",
        ["a b.parquet"],
    )


def test_defaults_match_the_flows_and_names_are_stable():
    from dapo_core.data.curate import DEFAULT_OUTPUT_DIR
    from flows.base_model import DEFAULT_OUTPUT_DIR as BASE_DIR
    from flows.evaluate import DEFAULT_METRICS_PATH

    def default(fl: Any, name: str) -> Any:
        return fl.to_deployment(name="probe")._parameter_openapi_schema.properties[name]["default"]

    assert default(S.curate_deployment, "output_dir") == DEFAULT_OUTPUT_DIR
    assert default(S.base_model_deployment, "output_dir") == BASE_DIR
    assert default(S.evaluate_deployment, "metrics_path") == DEFAULT_METRICS_PATH
    assert S.deployment_names("lab-") == [
        "dapo-curate/lab-curate",
        "dapo-base-model/lab-base-model",
        "dapo-train/lab-train",
        "dapo-evaluate/lab-evaluate",
        "dapo-pipeline/lab-pipeline",
        "dapo-ablation/lab-ablation",
    ]
    deployments = S.build_deployments("lab-")
    assert [f"{d.flow_name}/{d.name}" for d in deployments] == S.deployment_names("lab-")
    # loaded by module path: the flow-run processes import them from any working directory
    assert [d.entrypoint for d in deployments] == [f"flows.serve.{fl.fn.__name__}" for fl in S.DEPLOYMENTS.values()]
    # `dapo ui start` waits for exactly these (a race once let it return before `pipeline` was registered)
    from flows.services.ui import SERVED_STAGES

    assert list(SERVED_STAGES) == list(S.DEPLOYMENTS)


def test_the_ablation_form_passes_its_report_name_resume_and_eval_k_through(monkeypatch):
    """The UI's ablation form: its report name is not the recipe's, --resume and --eval-k reach the flow, and a
    quick run scores at the recipe's rollout.val_n unless told otherwise."""
    import types

    from flows import ablation as A

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(A, "ablation_flow", types.SimpleNamespace(fn=lambda **kw: seen.append(kw) or {}))
    form = {
        "config_path": None, "recipe": None, "overrides": [], "regimes": ["tuned"], "tuned_lr": None,
        "aggressive_lr": None, "steps": None, "seeds": None, "base": None, "out_dir": None, "quick": False,
        "rungs": None, "name": "mine", "resume": True, "eval_k": 16,
    }  # fmt: skip
    S.ablation_deployment.fn(**form)
    S.ablation_deployment.fn(**{**form, "quick": True, "eval_k": None, "resume": False})
    assert (seen[0]["name"], seen[0]["recipe"], seen[0]["resume"], seen[0]["eval_k"]) == (
        "mine",
        A.DEFAULT_RECIPE,
        True,
        16,
    )
    assert seen[1]["eval_k"] == load_config(recipe=A.DEFAULT_RECIPE).rollout.val_n and seen[1]["resume"] is False
    from prefect.exceptions import MissingContextError

    # refused before any work (in a flow run: a Failed state with the message; here no run logger to report it to)
    with pytest.raises((ValueError, MissingContextError)):
        S.ablation_deployment.fn(**{**form, "eval_k": 0})
    assert len(seen) == 2


def test_serve_needs_a_reachable_prefect_server():
    from prefect.settings import temporary_settings
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["serve"])  # the tests' environment has no PREFECT_API_URL
    assert result.exit_code == 2 and "PREFECT_API_URL is not set" in result.output
    url = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings(updates={"PREFECT_API_URL": url}), pytest.raises(S.ServeError, match="no Prefect server"):
        S.prefect_api_url(timeout_s=2)


# ---------------- prefect.yaml ----------------


def test_prefect_yaml_deploys_every_flow_on_a_process_pool():
    from prefect.flows import Flow, load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == set(S.DEPLOYMENTS)
    for name, d in deployments.items():
        path, func = d["entrypoint"].split(":")
        assert (REPO / path).is_file(), d["entrypoint"]
        loaded = load_flow_from_entrypoint(str(REPO / d["entrypoint"]))
        assert isinstance(loaded, Flow) and loaded.name == S.DEPLOYMENTS[name].name
        assert func == S.DEPLOYMENTS[name].fn.__name__
        assert set(d.get("parameters") or {}) <= set(loaded.parameters.properties)
        assert d["work_pool"]["name"] == "dapo-process"
    assert any("set_working_directory" in str(step) for step in spec["pull"])


# ---------------- MLflow: a model-training experiment ----------------


def test_experiments_are_created_and_marked_as_model_training(tmp_path):
    def cfg(name: str):
        return load_config(
            config_path=PARAMS,
            overrides=[f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.experiment={name}"],
            env={},
        )

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    tracking.configure_mlflow(cfg("fresh"))
    assert client.get_experiment_by_name("fresh").tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    old = client.create_experiment("old")  # made before the tag existed
    guessed = client.create_experiment("guessed", tags={tracking.EXPERIMENT_KIND_TAG: "genai_development_inferred"})
    chosen = client.create_experiment("chosen", tags={tracking.EXPERIMENT_KIND_TAG: "genai_development"})
    for name in ("old", "guessed", "chosen"):
        tracking.configure_mlflow(cfg(name))
    kinds = [client.get_experiment(e).tags[tracking.EXPERIMENT_KIND_TAG] for e in (old, guessed, chosen)]
    assert kinds == ["custom_model_development", "custom_model_development", "genai_development"]


def test_mlflow_ui_links(monkeypatch):
    monkeypatch.delenv(tracking.MLFLOW_UI_ENV, raising=False)
    assert (
        tracking.run_ui_url("3", "abc", "sqlite:///x.db")
        == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert tracking.mlflow_ui_url("http://mlflow.lab:8080/") == "http://mlflow.lab:8080"
    monkeypatch.setenv(tracking.MLFLOW_UI_ENV, "http://10.0.0.2:5001/")
    assert tracking.run_ui_url("1", "r", "http://mlflow.lab:8080") == (
        "http://10.0.0.2:5001/#/experiments/1/runs/r?workflowType=machine_learning"
    )
    with mlflow.start_run() as run:  # outside a Prefect flow run there is nothing to link
        assert tracking.link_flow_run(run) is None


# ---------------- the tests' own stores ----------------


def test_tests_use_their_own_prefect_home_and_mlflow_store():
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    assert Path(settings.home) == TEST_STORES / "prefect" and Path(settings.home) != REPO / ".prefect"
    assert settings.api.url is None  # no user server: flows use an ephemeral one (or the test harness)
    assert str(TEST_STORES) in settings.server.database.connection_url.get_secret_value()
    assert TEST_MLFLOW_URI.startswith(f"sqlite:///{TEST_STORES}/")  # the session's default MLflow store


@pytest.mark.slow
def test_a_flow_run_from_a_test_lands_in_the_test_database_not_the_users(tmp_path):
    user_db = REPO / ".prefect" / "prefect.db"
    before = user_db.stat().st_mtime_ns if user_db.exists() else None
    code = "from prefect import flow\n@flow(name='isolation-probe')\ndef probe():\n    return 1\nprobe()\n"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=300, capture_output=True)
    test_db = TEST_STORES / "prefect" / "prefect.db"
    with sqlite3.connect(test_db) as db:
        assert db.execute("select count(*) from flow where name = 'isolation-probe'").fetchone()[0] >= 1
    assert (user_db.stat().st_mtime_ns if user_db.exists() else None) == before


# ---------------- a real server, `dapo serve`, runs triggered like the UI does ----------------


@contextmanager
def _process(cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group; on exit stop the whole group (SIGTERM, then SIGKILL)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        proc.wait(timeout=10)


def _time(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _wait_for(check: Callable[[], Any], timeout: float, what: str, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


@pytest.mark.slow
def test_runs_triggered_through_the_rest_api(tmp_path, monkeypatch):
    port, work = free_port(), tmp_path / "work"
    work.mkdir()
    api = f"http://127.0.0.1:{port}/api"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false"}
    server_env = {**base_env, "PREFECT_HOME": str(tmp_path / "server-home")}
    serve_env = {
        **base_env,
        "PREFECT_HOME": str(tmp_path / "client-home"),
        "PREFECT_API_URL": api,
        "MLFLOW_TRACKING_URI": store,
        "DAPO_MLFLOW_UI_URL": "http://mlflow.test:5000",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    logs = [tmp_path / "server.log", tmp_path / "serve.log"]
    http = httpx.Client(base_url=api, timeout=30)
    with ExitStack() as stack:
        server_cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        stack.enter_context(_process(server_cmd, env=server_env, cwd=tmp_path, log=logs[0]))
        _wait_for(lambda: http.get("/health").status_code == 200, 120, "the Prefect server", logs)
        stack.enter_context(_process([str(BIN / "dapo"), "serve"], env=serve_env, cwd=work, log=logs[1]))
        deployment = _wait_for(
            lambda: (r := http.get("/deployments/name/dapo-curate/curate")).status_code == 200 and r.json(),
            90,
            "the curate deployment",
            logs,
        )

        def trigger(**parameters: Any) -> str:
            url, body = f"/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters}
            r = _wait_for(lambda: (r := http.post(url, json=body)).status_code < 500 and r, 60, "create_flow_run", logs)
            assert r.status_code == 201, r.text  # a busy SQLite server may answer 503 for a moment: retried above
            return str(r.json()["id"])

        good = trigger(config_path=PARAMS, overrides=SMALL)
        bad_key = trigger(config_path=PARAMS, overrides=[*SMALL, "trainer.no_such_knob=1"])
        bad_recipe = trigger(recipe="no-such-recipe")

        def finished() -> dict[str, dict[str, Any]] | None:
            replies = {i: http.get(f"/flow_runs/{i}") for i in (good, bad_key, bad_recipe)}
            runs = {i: r.json() for i, r in replies.items() if r.status_code == 200}
            return runs if len(runs) == 3 and all(r["state"]["type"] in TERMINAL for r in runs.values()) else None

        def post(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
            return _wait_for(lambda: (r := http.post(path, json=body)).status_code == 200 and r, 60, path, logs).json()

        runs = _wait_for(finished, 240, "the three flow runs", logs)
        artifacts = post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [good]}}})
        bad_logs = post("/logs/filter", {"logs": {"flow_run_id": {"any_": [bad_key]}}, "limit": 200})
        serve_log = logs[1].read_text(errors="replace")
    http.close()

    assert "dapo-train/train" in serve_log and "dapo-ablation/ablation" in serve_log  # the banner
    assert runs[good]["state"]["type"] == "COMPLETED", runs[good]["state"]
    # a bad parameter: FAILED, with the CLI's error text as the state message and in the run's log
    monkeypatch.chdir(work)  # where the runs resolved their config (the recipe error lists the folders it searched)
    for run_id, kwargs in ((bad_key, {"overrides": [*SMALL, "trainer.no_such_knob=1"]}), (bad_recipe, {})):
        with pytest.raises((ConfigError, FileNotFoundError)) as err:
            load_config(config_path=PARAMS if kwargs else None, recipe=None if kwargs else "no-such-recipe", **kwargs)
        state = runs[run_id]["state"]
        assert state["type"] == "FAILED" and state["message"] == str(err.value), state
    assert any(f"error: {runs[bad_key]['state']['message']}" == entry["message"] for entry in bad_logs)
    # --limit 1: the runs took turns
    spans = sorted((_time(r["start_time"]), _time(r["end_time"])) for r in runs.values() if r["start_time"])
    assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans)), spans

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("dapo-flow")
    assert exp.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    (mrun,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{good}'")
    assert mrun.data.params["curation.val_size"] == "25" and mrun.data.metrics["data/val"] == 25
    assert all("/" in key for key in mrun.data.metrics)  # metric charts group into sections by prefix
    assert mrun.data.tags["prefect.flow_run_url"] == f"http://127.0.0.1:{port}/runs/flow-run/{good}"
    assert (work / "outputs/curated/train.parquet").is_file()  # runs work where `dapo serve` runs
    run_page = f"#/experiments/{exp.experiment_id}/runs/{mrun.info.run_id}?{tracking.MODEL_TRAINING_VIEW}"
    url = f"http://mlflow.test:5000/{run_page}"
    assert [a["data"] for a in artifacts] == [f"[MLflow run curate]({url})"]  # the link (stored as markdown)
