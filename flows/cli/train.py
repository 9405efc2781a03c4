"""`dapo train`: start the training flow from the command line, with a progress bar on a terminal."""

from __future__ import annotations

import sys
import time

import typer

from flows.cli.common import fail, resolve_config
from flows.cli.stage_command import stage_command
from flows.stage_params import TRAIN, StageValues


def _progress_hook():
    """A rich progress bar: step, reward, acc, entropy, length, ETA (only when stdout is a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
    )
    state: dict[str, int] = {}

    def hook(step: int, total: int, m: dict[str, float]) -> None:
        if "task" not in state:
            progress.start()
            state["task"] = progress.add_task("train", total=total, completed=step - 1, stats="")
        stats = (
            f"reward {m.get('critic/rewards/mean', 0):+.3f}  acc {m.get('train/acc/mean', 0):.3f}  "
            f"entropy {m.get('actor/entropy', 0):.3f}  len {m.get('response_length/mean', 0):.1f}"
        )
        progress.update(state["task"], completed=step, stats=stats)
        if step >= total:
            progress.stop()

    return hook


def _train(v: StageValues) -> None:
    """Run the train stage with a progress bar on a terminal; print the run, its accuracy and the final model."""
    from flows import stages

    if not v["skip_plan"]:
        from flows.cli.plan import preflight

        preflight(resolve_config(v.config_path, v.recipe, v.overrides))  # a GPU config that cannot fit stops here
    from flows import train as train_module

    if sys.stdout.isatty():
        train_module.PROGRESS_HOOKS.append(_progress_hook())
    t0 = time.perf_counter()
    try:
        summary = stages.run("train", v)
    except stages.user_errors("train") as exc:
        fail(str(exc))
    finally:
        train_module.PROGRESS_HOOKS.clear()
    if summary.get("already_finished"):
        typer.echo(
            f"run {summary['run_name']} ({summary['run_id']}) had already finished: nothing to do; final model "
            f"{summary['final_model']}"
        )
        return
    m = summary["final_metrics"]
    typer.echo(
        f"run {summary['run_name']} ({summary['run_id']}) finished in {time.perf_counter() - t0:.0f}s: "
        f"train acc {m.get('train/acc/mean', float('nan')):.3f}; final model {summary['final_model']} "
        f"(registered as {summary['registered_model']})"
    )


def register(app: typer.Typer) -> None:
    """Add ``dapo train`` (its options: flows/stage_params.py's TRAIN) to ``app``."""
    stage_command(app, TRAIN, _train)
