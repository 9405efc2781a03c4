"""The `dapo` CLI skeleton (`config show`, `config recipes`) and the quiet environment it applies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dapo_core.config import config_from_dict, dump_yaml, load_config
from dapo_core.env import OFFLINE_ENV, QUIET_ENV, apply_quiet_env
from flows.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)
    for var in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_show_defaults_to_params_yaml():
    result = invoke("config", "show")
    assert result.exit_code == 0, result.output
    assert result.stdout == dump_yaml(load_config(REPO / "params.yaml", env={}))
    assert config_from_dict(yaml.safe_load(result.stdout)).recipe == "tiny-dapo"


def test_show_recipe_with_set_overrides():
    result = invoke("config", "show", "--recipe", "dapo-qwen2.5-32b", "--set", "trainer.lr=2e-6", "-s", "rollout.n=8")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert shown["recipe"] == "dapo-qwen2.5-32b"
    assert (shown["trainer"]["lr"], shown["rollout"]["n"]) == (2e-6, 8)


def test_show_flat_prints_dotted_keys_that_feed_back_into_set():
    result = invoke("config", "show", "--flat", "--set", "trainer.total_steps=3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "trainer.total_steps=3" in lines and "algorithm.clip_high=0.28" in lines
    assert 'data.train_files=["outputs/curated/train.parquet"]' in lines
    # Every line is a valid --set: feeding them all back reproduces the config.
    again = load_config(recipe="tiny-dapo", overrides=lines, env={})
    assert again == load_config(recipe="tiny-dapo", overrides=["trainer.total_steps=3"], env={})


def test_show_reads_the_environment(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    result = invoke("config", "show", "--flat")
    assert "tracking.uri=http://127.0.0.1:5000" in result.stdout.splitlines()


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--set", "trainer.lr_warmup=3"], "did you mean 'trainer.lr_warmup_steps'?"),
        (["--set", "trainer.ppo_mini_batch_size=7"], "must divide data.train_batch_size (32)"),
        (["--recipe", "tiny-dap"], "did you mean 'tiny-dapo'?"),
        (["--config", "missing.yaml"], "config file missing.yaml not found"),
        (["--config", "params.yaml", "--recipe", "tiny-dapo"], "got both --config"),
        (["--set", "oops"], "must look like dotted.key=value"),
    ],
)
def test_errors_exit_2_with_one_red_line_and_no_traceback(args, pattern):
    result = invoke("config", "show", *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and pattern in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_bad_yaml_file_reports_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: x\ntrainer: [1,\n")
    result = invoke("config", "show", "--config", str(bad))
    assert result.exit_code == 2 and f"{bad}:" in result.stderr


def test_recipes_lists_one_line_each():
    result = invoke("config", "recipes")
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    names = [line.split()[0] for line in lines]
    assert names == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert all(len(line.split(None, 1)) == 2 for line in lines)  # every recipe has a summary


def test_only_real_commands_are_registered(tmp_path, monkeypatch):
    result = invoke("--help")
    assert result.exit_code == 0 and "config" in result.stdout
    assert invoke("no-such-command").exit_code == 2  # click's usage error
    monkeypatch.chdir(tmp_path)  # no params.yaml here: train is registered and says what is missing
    missing = invoke("train")
    assert missing.exit_code == 2 and "params.yaml" in missing.stderr


# ---------------- apply_quiet_env ----------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in [*QUIET_ENV, *OFFLINE_ENV, "PREFECT_HOME", "DAPO_OFFLINE"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path


def test_quiet_env_sets_defaults_without_overriding(clean_env, monkeypatch):
    monkeypatch.setenv("DVC_NO_ANALYTICS", "0")  # the user's value wins
    applied = apply_quiet_env(project_root=clean_env)
    assert os.environ["PREFECT_HOME"] == str(clean_env.resolve() / ".prefect")
    assert os.environ["DVC_NO_ANALYTICS"] == "0" and "DVC_NO_ANALYTICS" not in applied
    for var, value in QUIET_ENV.items():
        if var != "DVC_NO_ANALYTICS":
            assert os.environ[var] == value and applied[var] == value
    assert "HF_HUB_OFFLINE" not in os.environ  # online unless asked
    assert (clean_env / "home" / "ray_bootstrap_config.yaml").read_text() == ""


@pytest.mark.parametrize(("offline", "switch", "expected"), [(True, None, True), (None, "1", True), (None, "0", False)])
def test_quiet_env_offline(clean_env, monkeypatch, offline, switch, expected):
    if switch is not None:
        monkeypatch.setenv("DAPO_OFFLINE", switch)
    apply_quiet_env(project_root=clean_env, offline=offline)
    assert all((os.environ.get(var) == "1") == expected for var in OFFLINE_ENV)


def test_quiet_env_keeps_an_existing_ray_bootstrap_file(clean_env):
    existing = clean_env / "home" / "ray_bootstrap_config.yaml"
    existing.write_text("cluster_name: mine\n")
    apply_quiet_env(project_root=clean_env)
    assert existing.read_text() == "cluster_name: mine\n"
