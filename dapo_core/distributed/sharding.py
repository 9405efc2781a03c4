"""How the single controller cuts a step's work into per-actor shards, and glues the answers back in order.

Pure functions on index lists and ``PolicyBatch`` rows; no Ray. Three cuts:

- ``split_evenly(n, parts)``: contiguous, near-equal ``(start, stop)`` ranges. Rollout prompts are split this way
  and each shard is generated with ``prompt_index_offset=start``, so sample j of prompt i is seeded by
  ``(seed, i, j)`` exactly as in one in-process call (the ``hf`` backend's per-row seeding).
- ``shard_rows(batch, parts)``: contiguous row shards for log-probs and SFT; every rank gets at least one row
  (an empty share becomes a masked-out dummy row, so collective calls stay in lock-step).
- ``shard_for_update(batch, mini_batch_groups, world)``: data-parallel shards of every PPO mini-batch, cut by
  whole prompt groups (Algorithm 1, line 11: the mini-batch is the unit of one optimizer step). Rank r's shard
  holds its piece of every mini-batch, relabelled so that ``split_by_groups(shard, 1)`` gives back exactly one
  piece per mini-batch: all ranks take the same number of optimizer steps, and the trainer's all-reduced
  denominators and gradients make the sum of the pieces the gradient of the whole mini-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from dapo_core.distributed.ranges import split_evenly
from dapo_core.engines.batch import PolicyBatch, split_by_groups

__all__ = ["shard_for_update", "shard_rows", "split_evenly"]


def _groups_in_order(group_index: torch.Tensor) -> list[int]:
    seen: set[int] = set()
    order: list[int] = []
    for g in group_index.tolist():
        if g not in seen:
            seen.add(g)
            order.append(g)
    return order


def _select_with_dummies(
    batch: PolicyBatch, rows: Sequence[int], dummy: Sequence[bool], labels: Sequence[int]
) -> PolicyBatch:
    """Rows of ``batch`` (copies); rows flagged ``dummy`` are masked out of the loss and carry zero advantage."""
    out = batch.select(torch.tensor(list(rows), dtype=torch.long))
    out.group_index = torch.tensor(list(labels), dtype=batch.group_index.dtype)  # (n,)
    flags = torch.tensor(list(dummy), dtype=torch.bool)  # (n,)
    if bool(flags.any()):
        out.response_mask = out.response_mask.clone()
        out.response_mask[flags] = 0.0  # (n, T): no token of a dummy counts in any denominator
        if out.advantages is not None:
            out.advantages = out.advantages.clone()
            out.advantages[flags] = 0.0
    return out


def shard_rows(batch: PolicyBatch, parts: int) -> list[tuple[PolicyBatch, int]]:
    """Contiguous row shards ``(shard, real_rows)``; a shard with no real row holds one masked dummy row."""
    shards = []
    for start, stop in split_evenly(batch.num_responses, parts):
        if stop > start:
            rows = list(range(start, stop))
            labels = batch.group_index[start:stop].tolist()
            shards.append((_select_with_dummies(batch, rows, [False] * len(rows), labels), stop - start))
        else:
            shards.append((_select_with_dummies(batch, [0], [True], [0]), 0))
    return shards


def shard_for_update(batch: PolicyBatch, mini_batch_groups: int, world: int) -> list[PolicyBatch]:
    """One shard per rank; call ``trainer.update(shard, mini_batch_groups=1)`` on every rank (see module doc)."""
    if world < 1:
        raise ValueError(f"world ({world}) must be >= 1 trainer ranks")
    rows_of = [list[int]() for _ in range(world)]
    dummy_of = [list[bool]() for _ in range(world)]
    label_of = [list[int]() for _ in range(world)]
    group_index = batch.group_index
    position = torch.arange(batch.num_responses)  # (N,)
    for k, mini in enumerate(split_by_groups(_with_positions(batch, position), mini_batch_groups)):
        mini_rows = mini.extras["_row"]  # (n_k,) positions of this mini-batch's rows in ``batch``
        groups = _groups_in_order(mini.group_index)
        for rank, (g0, g1) in enumerate(split_evenly(len(groups), world)):
            wanted = torch.tensor(groups[g0:g1], dtype=group_index.dtype)
            rows = mini_rows[torch.isin(mini.group_index, wanted)].tolist()
            if rows:
                rows_of[rank] += rows
                dummy_of[rank] += [False] * len(rows)
            else:  # fewer groups than ranks in this mini-batch: a masked dummy keeps the rank in lock-step
                rows_of[rank].append(int(mini_rows[0]))
                dummy_of[rank].append(True)
            label_of[rank] += [k] * max(1, len(rows))
    return [_select_with_dummies(batch, rows_of[r], dummy_of[r], label_of[r]) for r in range(world)]


def _with_positions(batch: PolicyBatch, position: torch.Tensor) -> PolicyBatch:
    """A view of ``batch`` whose ``extras`` remember each row's position (to map mini-batches back to rows)."""
    return replace(batch, extras={**batch.extras, "_row": position})
