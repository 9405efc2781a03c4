"""The supervised controls of the learning claim: continue the warm start for the time RL was given.

RL must beat these to matter: the same base model, the same time, spent on more supervised training instead of
DAPO. Two controls: ``sft-control`` continues on the warm start's own demonstrations, habits included (the paper's
situation: no better demonstrations exist); ``sft-control-clean`` (``clean=True``) on clean ones, which stop at
their answer line (where such demonstrations exist, it is the control to beat). The control sees exactly the
demonstrations the warm start had — it continues the warm start's own seeded stream after the batches the warm
start used, so a scarce part of the task (``demos.scarce_from_ops``) keeps its fixed few worked solutions and a
limited set (``demos.num_demos``) stays that set — at the lr the warm start's schedule ended on
(``lr * min_lr_ratio``), after a short linear warm-up. Its seed picks where along that stream it continues
(``stream_offset``): seed 1 right after the warm start, later seeds further on.

    result = continue_warm_start(cfg, ws, "outputs/base_model", time_budget_s=180, exclude=curated_questions)
    result.model  # evaluate it like any policy

Deterministic for a step budget (``max_steps``); a time budget (the fair match for a measured RL run) stops on
the clock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dapo_core.config import DapoConfig
from dapo_core.data.synthetic import SyntheticProblem
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.models import load_model, resolve_device, save_hf_dir
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.engines.trainer import OptimConfig, PolicyTrainer
from dapo_core.warmstart.sft import (
    WarmStartConfig,
    demonstration_batches,
    prompt_ids,
    response_ids,
    warm_start_sets,
)

logger = logging.getLogger(__name__)

CONTROL_WARMUP_STEPS = 10  # a fresh AdamW state: its first steps move every weight by ~lr (sign-like)


@dataclass
class ControlResult:
    """What the control did: steps, wall time, the last SFT loss, the trained model (and where it was saved), the
    CPU seconds its training loop used."""

    steps: int
    wall_s: float
    final_loss: float
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    output_dir: Path | None = None
    cpu_s: float = 0.0
    lr: float = 0.0  # the constant lr after the warm-up


def warm_start_exclusions(ws: WarmStartConfig, exclude: Collection[str]) -> set[str]:
    """The questions the warm start never trained on: ``exclude``, its held-out set and its probe set (the sets
    ``run_warm_start`` builds, ``warm_start_sets``), so the control draws the same stream of demonstrations."""
    return warm_start_sets(ws, exclude)[2]


def control_lr(ws: WarmStartConfig) -> float:
    """The lr the warm start's schedule ended on (``lr * min_lr_ratio``; a tenth of ``lr`` without a floor)."""
    return ws.lr * ws.min_lr_ratio if ws.min_lr_ratio > 0 else ws.lr * 0.1


def clean_settings(ws: WarmStartConfig) -> WarmStartConfig:
    """``ws`` with clean demonstrations: each one works its problem and stops at its answer line (no run-on to a
    next question, no answer stated before the work). What the task covers (operation counts, the scarce and
    limited sets of worked solutions) stays as configured: clean is about how demonstrations end, not which exist."""
    clean = ws.demos.model_copy(update={"run_on_frac": 0.0, "shortcut_frac": 0.0})  # in range: nothing to check
    return ws.model_copy(update={"demos": clean})


def stream_offset(ws: WarmStartConfig, seed: int) -> int:
    """Batches of the demonstration stream the control of ``seed`` skips beyond the warm start's: one warm-start
    length per seed after the first (seed 1: 0, so its runs continue the stream exactly where the warm start
    stopped)."""
    return (seed - 1) * ws.steps


def continue_warm_start(
    cfg: DapoConfig,
    ws: WarmStartConfig,
    base_dir: str | Path,
    *,
    time_budget_s: float | None = None,
    cpu_budget_s: float | None = None,
    max_steps: int | None = None,
    skip_steps: int | None = None,
    exclude: Collection[str] = (),
    output_dir: str | Path | None = None,
    seed: int = 1,
    lr: float | None = None,
    clean: bool = False,
) -> ControlResult:
    """Continue supervised training of the model in ``base_dir`` on the warm start's demonstrations.

    ``skip_steps``: batches of the stream the warm start already used (default ``ws.steps``). ``seed`` s (>= 1):
    seed 1 continues right after them; seed s starts ``(s - 1) * ws.steps`` batches further along the same stream
    (``stream_offset``), so the control's seeds train on other draws of the same demonstrations (the same
    distribution, the same scarce and limited sets, another order), as an RL run's seeds sample other
    responses. The batches skipped are drawn before the budget's clock starts. Stops after
    ``max_steps``, ``time_budget_s`` wall seconds or ``cpu_budget_s`` seconds of this process's CPU time (all its
    threads; other jobs on the machine inflate it less than wall time), whichever comes first (one of them is required).

    ``lr``: the constant lr after the warm-up (default: where the warm start's schedule ended, ``control_lr``).
    ``clean``: the same stream with every demonstration clean (``clean_settings``: no run-on past the answer line,
    no answer before the work); the scarce and limited sets stay as they are.
    """
    _check_arguments(ws, time_budget_s=time_budget_s, cpu_budget_s=cpu_budget_s, max_steps=max_steps, seed=seed, lr=lr)
    if clean:
        ws = clean_settings(ws)
    start = time.perf_counter()
    lr = control_lr(ws) if lr is None else lr
    model, tokenizer, trainer = _load_trainer(cfg, ws, base_dir, lr=lr, max_steps=max_steps)
    skip = (ws.steps if skip_steps is None else skip_steps) + stream_offset(ws, seed)
    stream = _demonstrations_after(ws, exclude, skip)
    c0 = time.process_time()
    steps, loss = _train_within(
        trainer, tokenizer, stream, max_steps=max_steps, time_budget_s=time_budget_s, cpu_budget_s=cpu_budget_s
    )
    model.eval()
    saved = save_hf_dir(model, tokenizer, output_dir) if output_dir is not None else None
    wall, cpu = time.perf_counter() - start, time.process_time() - c0
    logger.info("supervised control: %d steps at lr %g in %.1f s, %.1f CPU s (loss %.4f)", steps, lr, wall, cpu, loss)
    return ControlResult(
        steps=steps,
        wall_s=wall,
        final_loss=loss,
        model=model,
        tokenizer=tokenizer,
        output_dir=saved,
        cpu_s=cpu,
        lr=lr,
    )


def _check_arguments(
    ws: WarmStartConfig,
    *,
    time_budget_s: float | None,
    cpu_budget_s: float | None,
    max_steps: int | None,
    seed: int,
    lr: float | None,
) -> None:
    """At least one budget, each one positive, seed >= 1 and a positive lr (if given)."""
    if time_budget_s is None and cpu_budget_s is None and max_steps is None:
        raise ValueError(
            "continue_warm_start needs a budget: time_budget_s (wall seconds), cpu_budget_s (CPU seconds) or "
            "max_steps (SFT steps)"
        )
    for what, budget in (("time_budget_s", time_budget_s), ("cpu_budget_s", cpu_budget_s)):
        if budget is not None and budget <= 0:
            raise ValueError(f"{what} ({budget}) must be > 0 seconds")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps ({max_steps}) must be >= 1")
    if seed < 1:
        raise ValueError(f"seed ({seed}) must be >= 1: seed 1 continues the stream right after the warm start")
    if lr is not None and lr <= 0:
        raise ValueError(f"lr ({lr}) must be > 0 (null: the warm start's final lr, {control_lr(ws):g})")


def _load_trainer(
    cfg: DapoConfig, ws: WarmStartConfig, base_dir: str | Path, *, lr: float, max_steps: int | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PolicyTrainer]:
    """The model and tokenizer in ``base_dir`` and a trainer for them: a fresh AdamW at the constant ``lr`` after
    ``CONTROL_WARMUP_STEPS`` of linear warm-up, the warm start's weight decay, grad clip and micro-batch size."""
    device = resolve_device(cfg.trainer.device)
    model = load_model(str(base_dir), dtype=cfg.model.dtype, device=device)
    tokenizer = load_tokenizer(str(base_dir))
    optim = OptimConfig(
        lr=lr, weight_decay=ws.weight_decay, grad_clip=ws.grad_clip, warmup_steps=CONTROL_WARMUP_STEPS,
        scheduler="constant", total_steps=max_steps or 1, min_lr_ratio=0.0, betas=None,
    )  # fmt: skip
    return model, tokenizer, PolicyTrainer(model, optim, micro_batch_size=ws.micro_batch_size)


def _demonstrations_after(ws: WarmStartConfig, exclude: Collection[str], skip: int) -> Iterator[list[SyntheticProblem]]:
    """The warm start's seeded stream of demonstration batches (its exclusions, its scarce and limited sets), its
    first ``skip`` batches drawn now (outside any budget)."""
    stream = demonstration_batches(ws, warm_start_exclusions(ws, exclude))
    next(itertools.islice(stream, skip, skip), None)  # draw the skipped batches now, outside the budget
    return stream


def _train_within(
    trainer: PolicyTrainer,
    tokenizer: PreTrainedTokenizerBase,
    stream: Iterator[list[SyntheticProblem]],
    *,
    max_steps: int | None,
    time_budget_s: float | None,
    cpu_budget_s: float | None,
) -> tuple[int, float]:
    """One SFT step per batch of ``stream`` until a budget is spent (the clocks start here); (steps, last loss)."""
    pad_id = int(tokenizer.pad_token_id)
    steps, loss = 0, float("nan")
    t0, c0 = time.perf_counter(), time.process_time()
    for problems in stream:
        if max_steps is not None and steps >= max_steps:
            break
        if time_budget_s is not None and time.perf_counter() - t0 >= time_budget_s:
            break
        if cpu_budget_s is not None and time.process_time() - c0 >= cpu_budget_s:
            break
        batch = build_policy_batch(
            [prompt_ids(tokenizer, p.question) for p in problems],
            [response_ids(tokenizer, p.solution) for p in problems],
            pad_token_id=pad_id,
        )  # (B, P+T)
        loss = trainer.sft_step(batch)["loss"]
        steps += 1
    return steps, loss
