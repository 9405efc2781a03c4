"""What `dapo pipeline` shows on screen (stage lines, progress, warnings, summary) and what goes to its log file.

Fast tests check the pieces (log routing, plain progress lines, the bar fields); the slow one runs a tiny pipeline
through the real CLI, stdout piped (not a terminal, as in CI), and reads both the console and the log file.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow  # noqa: F401  (imported before route_logs, as in the CLI: importing mlflow resets its loggers)
import prefect  # noqa: F401
import pytest
from rich.console import Console

from dapo_core.config import dump_yaml, load_config
from flows.cli.console import route_logs
from tasks import progress
from tasks.base_model import warm_start_fields
from tasks.train import step_progress
from tasks.train_logging import val_fields

NO_API = {"send_to_api": False}  # Prefect's run loggers would otherwise try to ship the record to its API


def test_route_logs_keeps_warnings_on_screen_and_sends_the_chatter_to_the_file(tmp_path, capsys):
    log_file = tmp_path / "run" / "pipeline.log"
    mlflow_logger = logging.getLogger("mlflow")
    before = (list(mlflow_logger.handlers), mlflow_logger.propagate)
    assert before[0] and before[1] is False  # what importing mlflow sets up (else this test tests nothing)
    routing = route_logs(log_file)
    try:
        logging.getLogger("prefect.task_runs").info("Finished in state Completed()", extra=NO_API)
        logging.getLogger("prefect.flow_runs").info("Beginning subflow run 'x'", extra=NO_API)
        logging.getLogger("mlflow.system_metrics.system_metrics_monitor").info("Started monitoring system metrics.")
        logging.getLogger("dapo_core.warmstart.sft").info("sft step 10: loss 1.23")
        logging.getLogger("prefect.flow_runs").warning("dvc not found: outputs not recorded", extra=NO_API)
        logging.getLogger("dapo_core.training").error("reward worker died")
        logging.getLogger("mlflow.tracking").warning("artifact upload slow")
    finally:
        routing.restore()
    screen = capsys.readouterr()
    shown = screen.out + screen.err
    for chatter in ("Finished in state", "Beginning subflow", "system metrics", "sft step 10"):
        assert chatter not in shown, chatter
    for kept in ("dvc not found: outputs not recorded", "reward worker died", "artifact upload slow"):
        assert kept in screen.err, kept
    logged = log_file.read_text()
    for line in ("Finished in state Completed()", "Started monitoring system metrics.", "sft step 10: loss 1.23",
                 "dvc not found", "reward worker died", "artifact upload slow"):  # fmt: skip
        assert line in logged, line
    # restored: MLflow's own handler again, nothing of ours left on the root logger
    assert (mlflow_logger.handlers, mlflow_logger.propagate) == before
    assert routing.file_handler not in logging.getLogger().handlers


def _plain_reporter() -> tuple[progress.Reporter, io.StringIO]:
    out = io.StringIO()
    return progress.Reporter(Console(file=out, width=200, soft_wrap=True), live=False), out


def test_plain_progress_prints_a_few_whole_lines_not_carriage_returns():
    reporter, out = _plain_reporter()
    with progress.attached(reporter), progress.bar("warm start", total=1200) as bar:
        for step in range(10, 1201, 10):  # the warm start reports every 10 steps
            bar.update(step, {"loss": 1.0 / step})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # one line per fifth (240, 480, 720, 960) and the final state: not 120 lines
    assert [re.search(r"(\d+)/1200", line).group(1) for line in lines] == ["240", "480", "720", "960", "1200"]
    assert lines[-1].startswith("  warm start: 1200/1200 steps (100%)") and "loss 0.001" in lines[-1]
    assert "left" in lines[0] and "left" not in lines[-1]  # an ETA while running, none at the end


def test_progress_is_silent_without_a_reporter(capsys):
    with progress.bar("RL", total=3) as bar:
        bar.update(3, {"train acc": 0.5})
    progress.echo("a stage line")
    progress.note({"val avg@8": 0.3})
    assert capsys.readouterr().out == ""


def test_rl_bar_shows_train_accuracy_and_the_latest_validation():
    reporter, out = _plain_reporter()
    with progress.attached(reporter), progress.bar("RL", total=4) as bar:
        hook = step_progress(bar)
        progress.note({f"val {k}": v for k, v in val_fields({"val/synthetic/acc/mean_at_8": 0.25}).items()})  # step 0
        hook(1, 4, {"train/acc/mean": 0.5})
        hook(2, 4, {"train/acc/mean": 0.625, "val/synthetic/acc/mean_at_8": 0.375})
        hook(3, 4, {"train/acc/mean": 0.75})
        hook(4, 4, {"train/acc/mean": 0.875})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  RL: 1/4 steps") and "train acc 0.500  val avg@8 0.250" in lines[0]
    assert "train acc 0.625  val avg@8 0.375" in lines[1]
    assert lines[-1].startswith("  RL: 4/4 steps") and "train acc 0.875  val avg@8 0.375" in lines[-1]


def test_bar_fields_of_the_warm_start_and_validation():
    assert val_fields({"val/a/acc/mean_at_8": 0.2, "val/b/acc/mean_at_8": 0.4, "val/a/acc/pass_at_8": 0.9}) == {
        "avg@8": pytest.approx(0.3)
    }
    assert warm_start_fields({"sft/loss": 1.5, "sft/token_acc": 0.7, "sft/lr": 1e-3}) == {"loss": 1.5, "token acc": 0.7}
    final = warm_start_fields({"heldout/acc/mean_at_8": 0.3, "heldout/acc/greedy": 0.5, "sft/steps": 4.0})
    assert final == {"held-out avg@8": 0.3}


@pytest.mark.slow
def test_pipeline_console_is_short_and_the_log_file_has_the_chatter(tmp_path):
    from test_pipeline import SHORT  # the tiny config of the pipeline test

    overrides = [o for o in SHORT if not o.startswith(("algorithm.reward_fn", "tracking.log_system_metrics"))]
    overrides += ["trainer.test_freq=1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                  f"tracking.artifact_location={tmp_path}/artifacts"]  # fmt: skip
    cfg = load_config(recipe="tiny-dapo", overrides=overrides, env={})
    assert cfg.tracking.log_system_metrics  # MLflow's monitor chatter is part of what must stay off screen
    (tmp_path / "params.yaml").write_text(dump_yaml(cfg))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "pipeline", "--config", "params.yaml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    screen = proc.stdout + proc.stderr
    assert proc.returncode == 0, screen[-3000:]
    assert "Finished in state" not in screen and "system metrics" not in screen and "\r" not in screen
    stages = re.findall(r"^\[(\d)/7\] (\S+(?: \S+)?)\s", proc.stdout, flags=re.M)
    assert stages == [("1", "curate"), ("2", "base model"), ("3", "evaluate base"), ("4", "train"),
                      ("5", "evaluate"), ("6", "controls"), ("7", "dvc commit")]  # fmt: skip
    assert re.search(r"^  warm start: 4/4 steps \(100%\).*held-out avg@2", proc.stdout, flags=re.M)
    assert re.search(r"^  RL: 2/2 steps \(100%\)  train acc \d\.\d{3}  val avg@2 \d\.\d{3}", proc.stdout, flags=re.M)
    # a warning stays on screen (no dvc.yaml here), the summary of old is still the end of the output
    assert "WARNING prefect.flow_runs: dvc (or dvc.yaml / .dvc) not found" in proc.stderr
    assert "== dapo pipeline finished in" in proc.stdout and "Held-out accuracy (avg@2" in proc.stdout
    # one row each for the base model, the policy and the two controls: accuracy and the stop split
    for row in ("base model", "after RL", r"sft-control \(the warm start's demonstrations\)",
                r"sft-control-clean \(clean demonstrations\)"):  # fmt: skip
        assert re.search(rf"^  {row}\s+\d\.\d{{3}}  stop \d+%", proc.stdout, flags=re.M), (row, proc.stdout)
    assert len(screen.splitlines()) < 52, screen  # ~170 lines for this config before; +7 rows for the controls

    log_file = tmp_path / "outputs" / "pipeline-tiny-dapo" / "pipeline.log"
    assert f"Log of every stage: {log_file.relative_to(tmp_path)}" in proc.stdout
    logged = log_file.read_text()
    assert logged.count("Finished in state Completed()") > 20
    assert "Started monitoring system metrics." in logged and "[4/7] train" in logged
    assert "dvc (or dvc.yaml / .dvc) not found" in logged

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        filter_string="attributes.run_name = 'pipeline-tiny-dapo'",
    )[0]
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "logs")] == ["logs/pipeline.log"]
    assert (
        Path(tmp_path / "outputs" / "tiny-dapo").is_dir() and not (tmp_path / "outputs/tiny-dapo/pipeline.log").exists()
    )
