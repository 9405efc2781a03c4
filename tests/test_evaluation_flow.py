"""Model URIs of each kind, the evaluate flow end to end and `dapo compare`: real Prefect (test harness), MLflow
on SQLite in a temp dir, a tiny model directory."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import typer
from _tiny import tiny_model_dir
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from dapo_core.config import load_config
from dapo_core.data.schema import ProblemRecord, read_rl_parquet, write_rl_parquet
from dapo_core.engines.executor import LocalExecutor
from dapo_core.engines.models import ModelNotFoundError
from dapo_core.training.prompts import encode_prompts
from flows.cli.evaluate import register
from flows.evaluate import evaluate_flow
from tasks import tracking
from tasks.evaluate import TABLE_FILE, evaluate_items, resolve_model_uri

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def prefect_harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny", seed=3)


@pytest.fixture
def overrides(tmp_path, model_dir) -> list[str]:
    val = tmp_path / "val.parquet"
    rows = [
        ProblemRecord("tiny_arith", [{"role": "user", "content": "Q: 1+2"}], "3", index=0, raw_problem="1+2"),
        ProblemRecord("tiny_arith", [{"role": "user", "content": "Q: 4*5"}], "20", index=1, raw_problem="4*5"),
        ProblemRecord("tiny_arith", [{"role": "user", "content": "Q: 1+2"}], "3", index=0, raw_problem="1+2"),
    ]
    write_rl_parquet(rows, val)
    return [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_location={tmp_path}/mlartifacts",
        "tracking.log_system_metrics=false",
        "tracking.experiment=eval-tests",
        f"trainer.output_dir={tmp_path}/outputs",
        f"data.val_files=[{val}]",
        f"model.path={model_dir}",
        "data.max_response_length=12",
        "algorithm.overlong.buffer_length=4",
        "rollout.val_n=4",
    ]


@pytest.fixture
def cfg(overrides):
    c = load_config(recipe="tiny-dapo", overrides=overrides, env={})
    tracking.configure_mlflow(c)
    return c


def cfg_experiment(cfg) -> str:
    return MlflowClient().get_experiment_by_name(cfg.tracking.experiment).experiment_id


def log_model_run(cfg, model_dir: Path, register_as: str | None = None) -> tuple[str, str | None]:
    """A 'training' run holding the tiny HF dir as artifacts (optionally registered); (run id, models:/ URI)."""
    with tracking.start_run(cfg, run_name="train-for-eval") as run:
        if register_as:
            uri = tracking.register_hf_model(model_dir, register_as, artifact_path="model")
        else:
            tracking.log_artifacts(model_dir, "model")
            uri = None
    return run.info.run_id, uri


def test_model_uris_of_each_kind_resolve(cfg, model_dir, tmp_path):
    cache = tmp_path / "cache"
    run_id, registered = log_model_run(cfg, model_dir, register_as="tiny-eval")
    MlflowClient().set_registered_model_alias("tiny-eval", "champion", "1")

    local = resolve_model_uri(str(model_dir), cache_dir=cache)
    assert (local.kind, local.path, local.run_id) == ("local", str(model_dir), None)

    from_run = resolve_model_uri(f"runs:/{run_id}/model", cache_dir=cache)
    assert from_run.kind == "run" and from_run.run_id == run_id
    assert (Path(from_run.path) / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    again = resolve_model_uri(f"runs:/{run_id}/model", cache_dir=cache)  # reused, not downloaded twice
    assert again.path == from_run.path and len(list(cache.iterdir())) == 1

    for uri in (registered, "models:/tiny-eval@champion"):
        reg = resolve_model_uri(uri, cache_dir=cache)
        assert reg.kind == "registry" and reg.run_id == run_id
        assert (Path(reg.path) / "config.json").is_file() and (Path(reg.path) / "tokenizer_config.json").is_file()

    hub = resolve_model_uri("Qwen/Qwen2.5-32B", cache_dir=cache)
    assert (hub.kind, hub.path, hub.run_id) == ("hub", "Qwen/Qwen2.5-32B", None)

    # a checkpoint directory knows the run that trained it
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"mlflow_run_id": run_id, "step": 3}))
    assert resolve_model_uri(str(ckpt), cache_dir=cache).run_id == run_id

    with pytest.raises(ModelNotFoundError, match="no such run artifact"):
        resolve_model_uri("runs:/" + "0" * 32 + "/model", cache_dir=cache)
    with pytest.raises(ModelNotFoundError, match="no such registered model version"):
        resolve_model_uri("models:/tiny-eval/7", cache_dir=cache)


def test_evaluate_flow_end_to_end(cfg, overrides, model_dir, tmp_path):
    train_run, _ = log_model_run(cfg, model_dir)
    out = tmp_path / "metrics" / "eval.json"
    summary = evaluate_flow(overrides=overrides, model=f"runs:/{train_run}/model", metrics_path=str(out))

    # 3 rows, 2 unique problems, k = rollout.val_n = 4; metrics/eval.json == the MLflow run's metrics
    assert (summary["num_rows"], summary["num_problems"], summary["n"]) == (3, 2, 4)
    written = json.loads(out.read_text())
    assert set(written) >= {
        "val/tiny_arith/acc/mean_at_4",
        "val/tiny_arith/acc/pass_at_1",
        "val/tiny_arith/acc/pass_at_4",
        "val/tiny_arith/acc/maj_at_4",
        "val/tiny_arith/response_length/mean",
        "val/tiny_arith/reflection_rate",
    }
    assert all(isinstance(v, float) for v in written.values())
    assert written["val/tiny_arith/num_problems"] == 2.0
    assert written["val/tiny_arith/acc/mean_at_4"] == summary["mean_acc"]
    client = MlflowClient()
    run = client.get_run(summary["run_id"])
    assert run.data.metrics == pytest.approx(written)
    assert run.info.status == "FINISHED" and run.info.run_name == f"eval-{train_run}-model"
    tags = run.data.tags
    assert tags["eval.model_run_id"] == train_run and tags["stage"] == "evaluate"
    assert tags["eval.model_kind"] == "run" and tags["data.eval_digest"]
    table = mlflow.load_table(TABLE_FILE, run_ids=[summary["run_id"]])
    assert sorted(table["uid"]) == ["tiny_arith:0", "tiny_arith:1"] and set(table["n"]) == {4}

    # the same weights from the local directory, same fixed seed -> identical metrics (no eval.json this time)
    local = evaluate_flow(overrides=overrides, metrics_path=None)
    assert local["metrics"] == summary["metrics"] and local["metrics_path"] is None
    assert "eval.model_run_id" not in client.get_run(local["run_id"]).data.tags

    # the train flow's validation path (pre-tokenized prompts, live executor) gives the same numbers
    with LocalExecutor(cfg) as executor:
        items = encode_prompts(read_rl_parquet(cfg.data.val_files[0]), executor.tokenizer, max_prompt_length=32)
        metrics, rows = evaluate_items(executor, items, cfg, seed_parts=("evaluate",))
    assert metrics == local["metrics"] and len(rows) == 2


@pytest.fixture
def cli_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_compare_overlays_runs(cfg, overrides, cli_app, tmp_path):
    for name, acc in (("dapo-run", [0.1, 0.3, 0.5]), ("grpo-run", [0.1, 0.2, 0.25])):
        with tracking.start_run(cfg, run_name=name):
            for step, value in enumerate(acc):
                tracking.log_metrics(
                    {"val/tiny_arith/acc/mean_at_4": value, "actor/entropy": 1.0 - value, "other/x": 1.0}, step
                )
    args = ["compare", "dapo-run", "grpo-run", "--out", str(tmp_path / "cmp"), "--recipe", "tiny-dapo"]
    result = CliRunner().invoke(cli_app, args + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 0, result.output
    png = tmp_path / "cmp" / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| dapo-run | 0.5 | 0.5 |" in table and "| grpo-run | 0.25 | 0.75 |" in table
    assert "other/x" not in table  # only the default curves
    (run,) = MlflowClient().search_runs([cfg_experiment(cfg)], filter_string="tags.stage = 'compare'")
    assert run.info.run_name == "compare-dapo-run vs grpo-run" and run.info.run_id in result.output
    assert {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "compare")} == {
        "compare/compare.png",
        "compare/compare.md",
    }

    bad = CliRunner().invoke(cli_app, ["compare", "no-such-run", "--recipe", "tiny-dapo", "--set", overrides[0]])
    assert bad.exit_code == 2 and "no MLflow run with id or name 'no-such-run'" in bad.output


def test_cli_evaluate_reports_a_missing_model_cleanly(overrides, cli_app, tmp_path):
    args = ["evaluate", "--recipe", "tiny-dapo", "--model", "runs:/" + "f" * 32 + "/model"]
    args += ["--out", str(tmp_path / "eval.json")] + [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 2 and "no such run artifact" in result.output
    assert not (tmp_path / "eval.json").exists()
