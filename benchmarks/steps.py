"""The training flow's RL step, run by benchmarks with or without its Prefect task wrappers.

``flows.train_step.train_step`` is the step ``dapo train`` runs (generation batches until dynamic sampling has filled
the batch -> reward -> filter -> update -> weight sync); it calls the phases through ``tasks.train`` (Prefect
tasks). ``StepRunner`` runs that same function either as it is (inside a flow run each phase is a Prefect task run)
or with ``tasks.train`` swapped for the tasks' plain functions (``Task.fn``), so the difference between the two is
what Prefect's task runs cost and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prefect import Task
from prefect.utilities.annotations import BaseAnnotation

from dapo_core.config import DapoConfig
from dapo_core.config.schema import resolved_data_seed
from dapo_core.data.synthetic import generate_problems, synthetic_records
from dapo_core.engines.executor import Executor
from dapo_core.training.health import HealthMonitor
from dapo_core.training.prompts import PromptItem, PromptSampler, encode_prompts


def _plain(task: Any) -> Any:
    """The task's function, with Prefect's ``quote`` wrappers taken off its arguments as Prefect would."""
    fn = task.fn

    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.unwrap() if isinstance(a, BaseAnnotation) else a for a in args)
        kwargs = {k: v.unwrap() if isinstance(v, BaseAnnotation) else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return call


@contextmanager
def plain_tasks() -> Iterator[None]:
    """Inside: ``flows.train_step.train_step`` calls the phases as plain functions (no Prefect task runs)."""
    import flows.train_step as flow_module
    from tasks import train as task_module

    plain = SimpleNamespace(
        **{name: _plain(obj) if isinstance(obj, Task) else obj for name, obj in vars(task_module).items()}
    )
    flow_module.T = plain  # type: ignore[assignment]
    try:
        yield
    finally:
        flow_module.T = task_module


class StepRunner:
    """One executor and its own prompt sampler (same seed for every runner, so runners with the same config take
    the same steps), stepping through ``flows.train_step.train_step``."""

    def __init__(self, executor: Executor, cfg: DapoConfig, items: list[PromptItem]) -> None:
        from flows.train_step import RunState
        from tasks.train_logging import HeldMetrics

        self.executor, self.cfg, self.items = executor, cfg, items
        self.sampler = PromptSampler(len(items), seed=resolved_data_seed(cfg), shuffle=cfg.data.shuffle)
        self.run = RunState(
            cfg=cfg, executor=executor, train_items=items, val_items=[], sampler=self.sampler,
            health=HealthMonitor(), prefetcher=None, held=HeldMetrics(enabled=False), run_name="bench",
            ckpt_root=Path("unused"),
        )  # fmt: skip
        self.step_no = 0

    @property
    def gen_batches(self) -> int:
        return self.run.gen_batches_total

    def step(self, *, with_tasks: bool) -> tuple[float, dict[str, float]]:
        """Run the next step; returns (wall seconds, the step's metrics)."""
        from flows.train_step import train_step

        self.step_no += 1
        t0 = time.perf_counter()
        if with_tasks:
            metrics = train_step(self.run, self.step_no)
        else:
            with plain_tasks():
                metrics = train_step(self.run, self.step_no)
        return time.perf_counter() - t0, metrics


def synthetic_items(tokenizer: Any, n: int, *, max_prompt_length: int, seed: int = 0) -> list[PromptItem]:
    """``n`` prompts of the synthetic task (1-4 operations), tokenized as training tokenizes curated ones."""
    records = synthetic_records(generate_problems(n, seed=seed))
    return encode_prompts(records, tokenizer, max_prompt_length=max_prompt_length)
