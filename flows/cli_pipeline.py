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
from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config
from flows.cli_train import USER_ERRORS, ray_errors


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
    from flows import ui, ui_procs

    s = ui.saved_settings(ui.UiSettings().state_dir)
    home = os.environ.get("PREFECT_HOME")
    if s is None or not home or os.environ.get("PREFECT_API_URL"):
        return None
    if Path(s.prefect_home).resolve() != Path(home).resolve():
        return None
    if ui_procs.recorded_process(s.state_dir, "prefect") is None:
        return None
    return f"{s.prefect_url}/api" if ui.prefect_answers(s) else None


def _summary(s: dict, wall_s: float, log_file: Path) -> list[str]:
    lines = [
        "",
        f"== dapo pipeline finished in {wall_s:.0f}s",
        f"Held-out accuracy (avg@{s['k']}, sampled, problems never trained on): "
        f"base model {s['base_acc']:.3f} -> after RL {s['final_acc']:.3f}",
        f"Final policy: {s['train']['final_model']} (registered as {s['train']['registered_model']})",
        f"Training dynamics plot: {s['train']['plot']}",
        f"Log of every stage: {log_file}",
        _ui_help(s["tracking_uri"]),
    ]
    if not s["dvc_committed"]:
        lines.append("note: stage outputs were not recorded in dvc.lock (see the warning above)")
    return lines


def register(app: typer.Typer) -> None:
    @app.command("pipeline")
    def pipeline(config: ConfigOpt = None, recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
        """The whole mission: curate -> base model (warm start) -> train (DAPO) -> evaluate, all tracked."""
        cfg = resolve_config(config, recipe, overrides)
        overrides = list(overrides or [])
        if not cfg.tracking.run_name:  # fix the timestamped default once, so the log path and the run agree
            overrides.append(f"tracking.run_name={resolved_run_name(cfg)}")
            cfg = resolve_config(config, recipe, overrides)
        api = _running_ui_api()
        if api:  # before Prefect is imported: its settings come from the environment
            os.environ["PREFECT_API_URL"] = api
        from flows.console import route_logs  # after prefect and mlflow are imported (by flows.pipeline)
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
                s = pipeline_flow(
                    config_path=str(config) if config else None,
                    recipe=recipe,
                    overrides=overrides,
                    log_file=str(log_file),
                )
        except (*USER_ERRORS, *ray_errors()) as exc:
            fail(f"{exc}\n(the log of the run: {log_file})")
        for line in _summary(s, time.perf_counter() - t0, log_file):
            typer.echo(line)
