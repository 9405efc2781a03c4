"""Dynamic sampling (DAPO Sec. 3.2, Eq. 11 constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G).

Groups whose responses all got the same accuracy (all right or all wrong) have zero advantage and so no gradient;
DAPO drops them and keeps sampling generation batches until the training batch is full of groups with signal.
Filtering uses the raw accuracy (or another *unshaped* metric), never the shaped reward: the overlong penalty
would otherwise make an all-wrong group look informative.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import Tensor

from dapo_core.algorithm.advantages import group_index

logger = logging.getLogger(__name__)

T = TypeVar("T")


def dynamic_sampling_mask(metric: Tensor, group_ids: Sequence[Hashable] | Tensor) -> Tensor:
    """True for members of groups whose ``metric`` varies (or groups of size 1, as verl keeps them). (N,) bool."""
    if metric.dim() != 1:
        raise ValueError(f"metric must be 1-D (N,), got shape {tuple(metric.shape)}")
    if len(group_ids) != metric.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but metric has {metric.shape[0]}")
    if metric.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=metric.device)
    index = group_index(group_ids, device=metric.device)  # (N,)
    num_groups = int(index.max()) + 1
    values = metric.to(torch.float64)
    gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=metric.device)
    gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=metric.device)
    gmax = gmax.scatter_reduce(0, index, values, reduce="amax")  # (K,)
    gmin = gmin.scatter_reduce(0, index, values, reduce="amin")  # (K,)
    counts = torch.bincount(index, minlength=num_groups)  # (K,)
    keep_group = (gmax > gmin) | (counts == 1)  # (K,)
    return keep_group[index]


class DynamicSamplingExhausted(RuntimeError):
    """Raised when ``max_num_gen_batches`` generation batches did not yield enough groups with signal."""


@dataclass
class GroupAccumulator(Generic[T]):
    """Collects kept groups across generation batches until ``target_num_groups`` are held (Algorithm 1, l. 6-9).

    Usage (a flow's loop)::

        acc = GroupAccumulator(target_num_groups=512, max_num_gen_batches=10)
        while acc.need_more():
            groups, keep = sample_and_score_one_generation_batch()
            acc.add(groups, keep)
        batch = acc.take()

    ``max_num_gen_batches <= 0`` means unlimited (as verl). When the budget is spent without a full batch,
    ``need_more`` raises ``DynamicSamplingExhausted`` (on_exhausted="error") or returns False so the step goes on
    with what was kept (on_exhausted="continue"; ``take`` then returns fewer groups and ``exhausted`` is True).
    """

    target_num_groups: int
    max_num_gen_batches: int = 10
    on_exhausted: str = "error"
    kept: list[T] = field(default_factory=list)
    num_gen_batches: int = 0
    num_groups_seen: int = 0
    num_groups_kept: int = 0
    exhausted: bool = False

    def __post_init__(self) -> None:
        if self.target_num_groups <= 0:
            raise ValueError(f"target_num_groups must be > 0, got {self.target_num_groups}")
        if self.on_exhausted not in ("error", "continue"):
            raise ValueError(f"on_exhausted must be 'error' or 'continue', got {self.on_exhausted!r}")

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_num_groups

    def add(self, groups: Sequence[T], keep: Sequence[bool]) -> None:
        """Record one generation batch: its groups and, for each, whether it has signal."""
        if len(groups) != len(keep):
            raise ValueError(f"{len(groups)} groups but {len(keep)} keep flags")
        self.num_gen_batches += 1
        self.num_groups_seen += len(groups)
        for group, k in zip(groups, keep, strict=True):
            if k:
                self.kept.append(group)
                self.num_groups_kept += 1

    def need_more(self) -> bool:
        """True while another generation batch should be sampled."""
        if self.full:
            return False
        if self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches:
            self.exhausted = True
            msg = (
                f"dynamic sampling kept {len(self.kept)} of the {self.target_num_groups} groups needed after "
                f"{self.num_gen_batches} generation batches (algorithm.dynamic_sampling.max_num_gen_batches="
                f"{self.max_num_gen_batches}); most groups are all-correct or all-wrong. Fix: raise "
                "max_num_gen_batches (<= 0 = unlimited), use a larger data.gen_batch_size, a harder/easier dataset, "
                "or set algorithm.dynamic_sampling.on_exhausted=continue"
            )
            if self.on_exhausted == "error":
                raise DynamicSamplingExhausted(msg)
            logger.warning(msg + " — continuing with the groups kept")
            return False
        return True

    def take(self) -> list[T]:
        """The first ``target_num_groups`` kept groups (the surplus of the last batch is dropped)."""
        return self.kept[: self.target_num_groups]

    @property
    def kept_groups_frac(self) -> float:
        return self.num_groups_kept / self.num_groups_seen if self.num_groups_seen else 0.0

    @property
    def zero_std_groups_frac(self) -> float:
        return 1.0 - self.kept_groups_frac if self.num_groups_seen else 0.0
