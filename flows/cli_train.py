"""`dapo train`: start the training flow from the command line, with a progress bar on a terminal."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from dapo_core.algorithm import DynamicSamplingExhausted
from dapo_core.config import ConfigError
from dapo_core.data.freshness import SourceChangedError
from dapo_core.data.schema import SchemaError
from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config

# errors a user can fix from the message alone: shown without a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError, ConfigError, SchemaError, DynamicSamplingExhausted, SourceChangedError
)  # fmt: skip


def ray_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors a user acts on from the message (an actor that died: which, where, resume), when Ray is loaded:
    importing them here would load Ray for every command."""
    faults = sys.modules.get("dapo_core.distributed.faults")
    return (faults.ActorFailureError,) if faults is not None else ()


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


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        resume: Annotated[
            bool, typer.Option("--resume", help="Continue the run named by tracking.run_name from its last checkpoint.")
        ] = False,
        force: Annotated[
            bool,
            typer.Option(
                "--force", help="With --resume: continue even though the config differs from the checkpoint's."
            ),
        ] = False,
        skip_plan: Annotated[
            bool, typer.Option("--skip-plan", help="Skip the pre-flight memory plan of a GPU config (`dapo plan`).")
        ] = False,
    ) -> None:
        """Train with DAPO (or the recipe's GRPO baseline): rollout -> reward -> filter -> update, in MLflow."""
        cfg = resolve_config(config, recipe, overrides)  # a bad config fails here, before any work
        if not skip_plan:
            from flows.cli_plan import preflight

            preflight(cfg)  # a GPU config that cannot fit stops here, with the knob to change
        from flows import train as train_module

        if sys.stdout.isatty():
            train_module.PROGRESS_HOOKS.append(_progress_hook())
        t0 = time.perf_counter()
        try:
            summary = train_module.train_flow(
                config_path=str(config) if config else None, recipe=recipe, overrides=overrides or [], resume=resume,
                force=force,
            )  # fmt: skip
        except (*USER_ERRORS, train_module.T.CheckpointWriteError, *ray_errors()) as exc:
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
