"""A short pipeline (a few steps of each stage) through Prefect with MLflow on SQLite: the stages connect."""

from __future__ import annotations

import json

import pytest
import train_fixtures  # noqa: F401  (registers the test rewards)
from mlflow.tracking import MlflowClient

from dapo_core.config import dump_yaml, load_config
from flows.pipeline import pipeline_flow

pytestmark = pytest.mark.slow

SHORT = [
    "curation.synthetic.n=400",
    "curation.val_size=12",
    "base_model.steps=4",
    "base_model.batch_size=8",
    "base_model.micro_batch_size=8",
    "base_model.heldout_size=6",
    "base_model.heldout_k=2",
    "base_model.warmup_steps=0",
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64",
    "trainer.total_steps=2",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "data.train_batch_size=4",
    "data.gen_batch_size=6",
    "trainer.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.val_n=2",
    "data.max_response_length=24",
    "algorithm.overlong.buffer_length=6",
    "algorithm.dynamic_sampling.on_exhausted=continue",
    "tracking.log_system_metrics=false",
    "algorithm.reward_fn=test_even_length",  # a reward with variance: a 4-step warm start solves nothing yet
]


def test_short_pipeline_connects_the_stages(tmp_path, monkeypatch, prefect_api):
    monkeypatch.chdir(tmp_path)  # the pipeline writes data/, outputs/, metrics/ relative to the project
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=[*SHORT, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_location={tmp_path}/a"],
        env={},
    )
    (tmp_path / "params.yaml").write_text(dump_yaml(cfg))
    summary = pipeline_flow(config_path="params.yaml", dvc_commit=False)

    client = MlflowClient()
    parent = summary["parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    by_name = {r.info.run_name: r for r in children}
    controls = ("sft-control", "sft-control-clean")  # the recipe's control.pipeline
    assert tuple(cfg.control.pipeline) == controls
    assert set(by_name) == {
        "curate", "base_model", "evaluate-base_model", "tiny-dapo", "evaluate-tiny-dapo",
        *(f"{c}-tiny-dapo" for c in controls), *(f"evaluate-{c}-tiny-dapo" for c in controls),
    }  # fmt: skip
    assert all(r.info.status == "FINISHED" for r in children)

    # the data version flows from curation to training to evaluation
    digest = by_name["curate"].data.tags["data.digest"]
    assert digest == summary["curate"]["digest"]
    for name in ("base_model", "tiny-dapo", "evaluate-tiny-dapo"):
        assert by_name[name].data.tags["data.curated_digest"] == digest, name
    # training used the curated files and the warm-started model; evaluation scored the trained policy
    train_run = by_name["tiny-dapo"]
    assert train_run.data.params["model.path"] == "outputs/base_model"
    assert (tmp_path / "outputs/curated/train.parquet").is_file()
    assert (tmp_path / "outputs/base_model/model.safetensors").is_file()
    assert by_name["evaluate-tiny-dapo"].data.tags["eval.model_path"].endswith("outputs/tiny-dapo/final")
    metrics = json.loads((tmp_path / "metrics/eval.json").read_text())
    key = "val/synthetic/acc/mean_at_2"
    assert metrics[key] == pytest.approx(summary["final_acc"])
    assert by_name["evaluate-tiny-dapo"].data.metrics[key] == pytest.approx(summary["final_acc"])
    # the base accuracy is the evaluation of the warm-started model (not of the trained one), as logged
    base_eval = by_name["evaluate-base_model"]
    assert base_eval.data.tags["eval.model_path"].endswith("outputs/base_model")
    assert base_eval.data.metrics[key] == pytest.approx(summary["base_acc"])
    pipeline_metrics = client.get_run(parent).data.metrics
    assert pipeline_metrics["pipeline/base_acc"] == pytest.approx(summary["base_acc"])
    assert pipeline_metrics["pipeline/final_acc"] == pytest.approx(summary["final_acc"])

    # the controls: each the base model given the RL run's training CPU seconds of SFT, evaluated like the policy
    cpu = sum(m.value for m in client.get_metric_history(train_run.info.run_id, "perf/cpu_time_per_step"))
    assert cpu > 0 and [c["name"] for c in summary["controls"]] == list(controls)
    for c in summary["controls"]:
        assert c["budget_kind"] == "cpu" and c["budget_s"] == pytest.approx(cpu) and c["cpu_s"] >= cpu, c["name"]
        assert c["steps"] >= 1 and c["output_dir"] == f"outputs/controls-tiny-dapo/{c['name']}"
        ev = by_name[f"evaluate-{c['name']}-tiny-dapo"]
        assert ev.data.tags["eval.model_path"].endswith(f"outputs/controls-tiny-dapo/{c['name']}")
        assert (
            ev.data.metrics[key]
            == pytest.approx(c["acc"])
            == pytest.approx(pipeline_metrics[f"pipeline/{c['name']}_acc"])
        )
        assert c["stop"]["stop/stopped_rate"] == pytest.approx(ev.data.metrics["val/synthetic/stop/stopped_rate"])
    lrs = {c["name"]: c["lr"] for c in summary["controls"]}
    assert (
        lrs["sft-control-clean"] == pytest.approx(cfg.control.clean_lr)
        and lrs["sft-control"] != lrs["sft-control-clean"]
    )
    # the stop split of the base model and the policy, as their evaluations logged it
    assert summary["base_stop"]["stop/stopped_rate"] == pytest.approx(
        base_eval.data.metrics["val/synthetic/stop/stopped_rate"]
    )
    final_eval = by_name["evaluate-tiny-dapo"].data.metrics
    assert summary["final_stop"]["stop/run_on_rate"] == pytest.approx(final_eval["val/synthetic/stop/run_on_rate"])
