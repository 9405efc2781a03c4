"""The data flows for real: Prefect (test harness), MLflow (SQLite in tmp), the `dapo data generate` / `dapo curate`
commands, determinism of the raw file and of the curated bytes."""

from __future__ import annotations

import pytest
import typer
import yaml
from conftest_data import REPO
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from dapo_core.data.loaders import file_md5
from dapo_core.data.schema import read_rl_parquet
from flows.cli.data import register
from flows.curate import curate_flow, generate_flow
from tasks.data import dvc_dir_md5, resolve_curation

PARAMS = str(REPO / "params.yaml")
SMALL = ["curation.synthetic.n=400", "curation.val_size=25", "tracking.log_system_metrics=false"]

pytestmark = pytest.mark.slow  # a Prefect server start-up (~10-20 s on 2 busy cores)


@pytest.fixture(scope="module")
def prefect(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_curate_flow_writes_outputs_and_records_them_in_mlflow(prefect, workdir):
    uri = f"sqlite:///{workdir}/mlflow.db"
    result = curate_flow(config_path=PARAMS, overrides=[*SMALL, f"tracking.uri={uri}"])
    assert (workdir / "data/synthetic/problems.jsonl").is_file()  # generated because it was missing
    train, val = (read_rl_parquet(workdir / f"outputs/curated/{s}.parquet") for s in ("train", "val"))
    assert len(val) == result["val"] == 25 and len(train) == result["train"]
    assert result["rows_in"] == 400 == len(train) + len(val) + sum(result["dropped"].values())
    assert train[0].prompt[0]["content"].startswith("Q: ") and train[0].data_source == "synthetic"

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result["mlflow_run_id"])
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["stage"] == "curate" and tags["data.digest"] == result["digest"]
    for name in ("train.parquet", "val.parquet", "card.json", "card.md"):
        assert tags[f"dvc.md5.{name}"] == file_md5(workdir / "outputs/curated" / name)
    assert tags["data.dvc_md5"] == "none" and tags["data.dvc_md5_current"] == dvc_dir_md5(workdir / "data")
    assert metrics["data/rows_in"] == 400 and metrics["data/val"] == 25
    assert run.data.params["curation.template"] == "tiny"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "data_card")}
    assert artifacts == {"data_card/card.json", "data_card/card.md"}

    again = curate_flow(config_path=PARAMS, overrides=SMALL, output_dir="again", track=False)
    for name in ("train.parquet", "val.parquet", "card.json", "card.md"):
        assert (workdir / "again" / name).read_bytes() == (workdir / "outputs/curated" / name).read_bytes()
    assert again["digest"] == result["digest"] and again["mlflow_run_id"] is None


def test_generate_is_bit_identical_and_keeps_existing_files(prefect, workdir):
    first = generate_flow(config_path=PARAMS, overrides=["curation.synthetic.n=300"])
    path = workdir / first["path"]
    data = path.read_bytes()
    assert first["created"] and data.count(b"\n") == 300
    assert generate_flow(config_path=PARAMS, overrides=["curation.synthetic.n=300"])["created"] is False
    path.unlink()
    assert generate_flow(config_path=PARAMS, overrides=["curation.synthetic.n=300"])["md5"] == first["md5"]
    assert path.read_bytes() == data
    other = generate_flow(
        config_path=PARAMS, overrides=["curation.synthetic.n=300", "curation.synthetic.seed=1"], force=True
    )
    assert other["md5"] != first["md5"]


def test_cli_commands_and_their_errors(prefect, workdir):
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    base = ["--config", PARAMS, "--set", "curation.synthetic.n=200"]
    out = runner.invoke(app, ["data", "generate", *base])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("wrote data/synthetic/problems.jsonl (200 problems, seed 0, md5 ")
    out = runner.invoke(app, ["curate", *base, "--set", "curation.val_size=10", "--no-track", "-o", "cur"])
    assert out.exit_code == 0, out.output
    assert "curated 200 rows -> train " in out.output and (workdir / "cur/card.md").is_file()

    out = runner.invoke(app, ["curate", *base, "--set", "curation.val_size=-1"])
    assert out.exit_code == 2 and "curation.val_size (-1) must be >= 0" in out.output
    before = {p.name: p.read_bytes() for p in (workdir / "cur").iterdir()}
    (workdir / "bad.csv").write_text("question,answer\n1+1,2\n")
    for source, message in (("missing.jsonl", "missing.jsonl: no such source file"),
                            ("bad.csv", "bad.csv: missing column(s) ['problem']")):  # fmt: skip
        out = runner.invoke(app, ["curate", *base, "--set", f"curation.sources=[{source}]", "--no-track", "-o", "cur"])
        assert out.exit_code == 2 and message in out.output
    assert {p.name: p.read_bytes() for p in (workdir / "cur").iterdir()} == before  # the last good version stays


def test_curation_section_is_read_from_the_file(tmp_path):
    params = tmp_path / "params.yaml"
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["curation"] = {"val_size": 7, "synthetic": {"n": 99}}
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg, ccfg = resolve_curation(params, overrides=["curation.synthetic.seed=3", "data.max_prompt_length=24"])
    assert (ccfg.val_size, ccfg.synthetic.n, ccfg.synthetic.seed) == (7, 99, 3)
    assert cfg.data.max_prompt_length == 24 and cfg.recipe == "tiny-dapo"
    assert [s.path for s in ccfg.train_specs()] == ["data/synthetic/problems.jsonl"]
