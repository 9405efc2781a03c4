"""The optimizer side of the policy trainer: AdamW settings, the lr schedule, and the short-mini-batch lr scale.

Pure helpers (no model): ``lr_lambda`` feeds ``torch.optim.lr_scheduler.LambdaLR``; ``short_mini_batch_scales``
(checked by ``checked_mini_batch_scales``) and ``scaled_lr`` give a short last mini-batch an optimizer step in
proportion to its groups (``PolicyTrainer.update``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dapo_core.engines.batch import PolicyBatch

if TYPE_CHECKING:  # the engines import without pydantic (scripts/gpu_check.py runs where it is absent)
    from dapo_core.config import TrainerConfig


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + schedule. Warm-up and decay count optimizer-facing steps (one ``update`` call = 1).

    No field has a default: the values and their defaults live in the config. RL's optimizer is
    ``from_config(cfg.trainer)``; the warm start and its controls build theirs from ``base_model:``
    (``dapo_core.warmstart``), which sets no betas: ``betas=None`` leaves AdamW's own. AdamW's eps is never set.
    """

    lr: float
    weight_decay: float
    grad_clip: float
    warmup_steps: int
    scheduler: str  # constant | cosine
    total_steps: int
    min_lr_ratio: float
    betas: tuple[float, float] | None  # None: torch.optim.AdamW's default

    @classmethod
    def from_config(cls, trainer: TrainerConfig) -> OptimConfig:
        """The RL optimizer of the ``trainer:`` section (lr, schedule over ``total_steps`` rollout steps, AdamW)."""
        return cls(
            lr=trainer.lr,
            weight_decay=trainer.weight_decay,
            grad_clip=trainer.grad_clip,
            warmup_steps=trainer.lr_warmup_steps,
            scheduler=trainer.lr_scheduler,
            total_steps=trainer.total_steps,
            min_lr_ratio=trainer.min_lr_ratio,
            betas=(trainer.betas[0], trainer.betas[1]),
        )

    def adamw_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.optim.AdamW`` (betas only when set)."""
        kwargs: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.betas is not None:
            kwargs["betas"] = self.betas
        return kwargs


def lr_lambda(cfg: OptimConfig) -> Callable[[int], float]:
    """Multiplier of the base lr at scheduler step s: linear warm-up to 1, then constant or cosine."""
    if cfg.scheduler not in ("constant", "cosine"):
        raise ValueError(f"unknown lr scheduler {cfg.scheduler!r}; valid: constant, cosine")

    def fn(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            # (s+1)/W rather than s/W: the first update already moves (HF's s/W wastes step 0 at lr 0)
            return (step + 1) / cfg.warmup_steps
        if cfg.scheduler == "constant":
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def short_mini_batch_scales(batch: PolicyBatch, mini_batch_groups: int) -> list[float]:
    """The lr multiplier of each mini-batch of ``split_by_groups(batch, mini_batch_groups)``: its group count over
    ``mini_batch_groups`` (1.0, except for a short last mini-batch). See ``PolicyTrainer.update``."""
    if mini_batch_groups <= 0:
        raise ValueError(f"mini_batch_groups must be > 0, got {mini_batch_groups}")
    groups = int(batch.group_index.unique().numel())
    return [min(mini_batch_groups, groups - s) / mini_batch_groups for s in range(0, groups, mini_batch_groups)]


def checked_mini_batch_scales(mini_batch_scales: Sequence[float] | None, num_minis: int) -> list[float] | None:
    """``PolicyTrainer.update``'s ``mini_batch_scales`` as floats, checked: one lr multiplier in (0, 1] per
    mini-batch of an epoch (``num_minis``; a rank without rows, 0, takes any count: it joins the others' steps)."""
    given = None if mini_batch_scales is None else [float(s) for s in mini_batch_scales]
    expected = num_minis or len(given or [])
    if given is not None and (not given or len(given) != expected or not all(0 < s <= 1 for s in given)):
        raise ValueError(
            f"mini_batch_scales ({given}) must hold one lr multiplier in (0, 1] per mini-batch ({num_minis} "
            "here): pass short_mini_batch_scales(<the whole batch>, mini_batch_groups), or None"
        )
    return given


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every param group's lr times ``scale`` inside the block, restored after (the scheduler never sees it)."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
