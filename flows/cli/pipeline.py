"""`dapo pipeline`: curate -> base model -> train -> evaluate, then where to look at the results.

On screen: one line per stage (what it did, how long), progress bars for the warm start and the RL steps (plain
lines when stdout is not a terminal), warnings and errors, and the summary. Everything else (Prefect's task and
flow states, MLflow's system-metrics monitor, INFO logs) goes to ``outputs/pipeline-<run_name>/pipeline.log``,
also logged as an artifact of the pipeline's MLflow run. ``dapo -v pipeline`` shows the INFO records on screen too.

With ``make ui`` running on the same PREFECT_HOME (and no PREFECT_API_URL set), the flow runs go to that Prefect
server, so they show in its UI as they happen (and no temporary server is started on the same database).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import typer

from dapo_core.config.schema import resolved_run_name
from flows.cli.common import fail, resolve_config
from flows.cli.stage_command import stage_command
from flows.stage_params import PIPELINE, StageValues


def _ui_help(tracking_uri: str) -> str:
    return "\n".join(
        [
            f"MLflow store: {tracking_uri} (artifacts under ./mlartifacts unless tracking.artifact_location says "
            "otherwise)",
            "Browse the runs: `make ui` (or `dapo ui start`) starts the Prefect UI (http://127.0.0.1:4200, where "
            "every stage can also be triggered) and the MLflow UI (http://127.0.0.1:5000, experiment 'dapo-flow'); "
            "`make ui-stop` stops them",
            "Reproduce with DVC:  source .venv/bin/activate && dvc status && dvc repro",
        ]
    )


def _running_ui_api() -> str | None:
    """The API URL of the Prefect server `make ui` runs for this PREFECT_HOME, if it answers; else None."""
    from flows.services import procs as ui_procs
    from flows.services import ui

    s = ui.saved_settings(ui.UiSettings().state_dir)
    home = os.environ.get("PREFECT_HOME")
    if s is None or not home or os.environ.get("PREFECT_API_URL"):
        return None
    if Path(s.prefect_home).resolve() != Path(home).resolve():
        return None
    if ui_procs.recorded_process(s.state_dir, "prefect") is None:
        return None
    return f"{s.prefect_url}/api" if ui.prefect_answers(s) else None


def _stop(split: dict) -> str:
    """``stop 40% (acc 31%)``: the share of responses that stop at their answer line, and their accuracy."""
    if "stop/stopped_rate" not in split:
        return ""
    acc = split.get("stop/acc_when_stopped")
    return f"stop {100 * split['stop/stopped_rate']:.0f}%" + (f" (acc {100 * acc:.0f}%)" if acc is not None else "")


def _comparison(s: dict) -> list[str]:
    """Accuracy and the stop split of the base model, the policy and each control, one row each."""
    from flows.controls import CONTROL_WHAT

    rows = [
        ("base model", s["base_acc"], s.get("base_stop", {})),
        ("after RL", s["final_acc"], s.get("final_stop", {})),
    ]
    for c in s.get("controls", []):
        rows.append((f"{c['name']} ({CONTROL_WHAT[c['name']]})", c["acc"], c.get("stop", {})))
    width = max(len(r[0]) for r in rows)
    lines = [f"  {name:<{width}}  {acc:.3f}  {_stop(split)}".rstrip() for name, acc, split in rows]
    if s.get("controls"):
        c0 = s["controls"][0]
        diffs = "; ".join(f"after RL − {c['name']} {s['final_acc'] - c['acc']:+.3f}" for c in s["controls"])
        lines.append(f"  {diffs} (one seed; `dapo ablation` runs three)")
        lines.append(
            f"  (controls: the base model given RL's {c0['budget_s']:.0f} {c0['budget_kind'].upper()} s of SFT instead; "
            "stop = responses that end at their answer line, acc = their accuracy: the arithmetic apart from stopping)"
        )
    return lines


def _summary(s: dict, wall_s: float, log_file: Path) -> list[str]:
    lines = [
        "",
        f"== dapo pipeline finished in {wall_s:.0f}s",
        f"Held-out accuracy (avg@{s['k']}, sampled, problems never trained on): "
        f"base model {s['base_acc']:.3f} -> after RL {s['final_acc']:.3f}",
        *_comparison(s),
        f"Final policy: {s['train']['final_model']} (registered as {s['train']['registered_model']})",
        f"Training dynamics plot: {s['train']['plot']}",
        f"Log of every stage: {log_file}",
        _ui_help(s["tracking_uri"]),
    ]
    if not s["dvc_committed"]:
        lines.append("note: stage outputs were not recorded in dvc.lock (see the warning above)")
    return lines


def _pipeline(v: StageValues) -> None:
    """Run the pipeline: one line per stage and progress bars on screen, everything else to the run's log file."""
    from flows import stages

    try:
        kwargs = stages.prepare("pipeline", v)  # a bad config fails here, before any work
    except stages.user_errors("pipeline") as exc:
        fail(str(exc))
    cfg = resolve_config(kwargs["config_path"], kwargs["recipe"], kwargs["overrides"])
    api = _running_ui_api()
    if api:  # before Prefect is imported: its settings come from the environment
        os.environ["PREFECT_API_URL"] = api
    from flows.cli.console import route_logs  # after prefect and mlflow are imported (by flows.pipeline)
    from flows.pipeline import pipeline_flow, pipeline_log_path
    from tasks import progress

    log_file = pipeline_log_path(cfg)
    # kept to the end of the process: Prefect's temporary server logs its shutdown at exit, into the log file
    route_logs(log_file, verbose=logging.getLogger().level == logging.DEBUG)
    reporter = progress.Reporter()
    reporter.echo(
        f"dapo pipeline ({cfg.recipe}, run {resolved_run_name(cfg)}): curate -> base model -> train -> evaluate"
        f"; details in {log_file}"
    )
    if api:
        reporter.echo(f"flow runs go to the Prefect server of `make ui`: {api.removesuffix('/api')}")
    t0 = time.perf_counter()
    try:
        with progress.attached(reporter):
            reporter.waiting("starting Prefect ...")  # until the first stage starts
            s = pipeline_flow(**kwargs, log_file=str(log_file))
    except stages.user_errors("pipeline") as exc:
        fail(f"{exc}\n(the log of the run: {log_file})")
    for line in _summary(s, time.perf_counter() - t0, log_file):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add ``dapo pipeline`` (its options: flows/stage_params.py's PIPELINE) to ``app``."""
    stage_command(app, PIPELINE, _pipeline)
