"""Packing prompts + responses into padded tensors for the trainer.

Layout of one row: ``[pad ... pad, prompt tokens | response tokens, pad ... pad]`` — prompts left-padded to P,
responses right-padded to T, so every response starts at column P and the logits that predict response token t
sit at column P - 1 + t. Shape legend: N responses (= B*G), P prompt width, T response width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class PolicyBatch:
    """Everything one policy update needs, as tensors (kept inside executors; never sent through Prefect)."""

    input_ids: Tensor  # (N, P+T) long
    attention_mask: Tensor  # (N, P+T) long
    position_ids: Tensor  # (N, P+T) long
    response_mask: Tensor  # (N, T) float 0/1: tokens that count in the loss
    prompt_width: int  # P
    group_index: Tensor  # (N,) long: dense prompt-group index, responses of a group contiguous
    advantages: Tensor | None = None  # (N,) float
    old_log_probs: Tensor | None = None  # (N, T) float
    truncated: Tensor | None = None  # (N,) bool
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_responses(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def responses(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]  # (N, T)

    def select(self, rows: Tensor | slice) -> PolicyBatch:
        """A sub-batch of rows (same P and T, so per-token tensors stay aligned)."""

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[rows]

        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            position_ids=self.position_ids[rows],
            response_mask=self.response_mask[rows],
            group_index=self.group_index[rows],
            advantages=pick(self.advantages),
            old_log_probs=pick(self.old_log_probs),
            truncated=pick(self.truncated),
            extras={k: v[rows] for k, v in self.extras.items()},
        )

    def to(self, device: torch.device | str) -> PolicyBatch:
        def mv(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device)

        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            group_index=self.group_index.to(device),
            advantages=mv(self.advantages),
            old_log_probs=mv(self.old_log_probs),
            truncated=mv(self.truncated),
            extras={k: v.to(device) for k, v in self.extras.items()},
        )


def build_policy_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    group_ids: Sequence[int] | None = None,
    truncated: Sequence[bool] | None = None,
    advantages: Tensor | Sequence[float] | None = None,
    response_width: int | None = None,
) -> PolicyBatch:
    """Pack N (prompt, response) pairs. ``group_ids`` default: every row its own group."""
    n = len(prompt_ids)
    if len(response_ids) != n:
        raise ValueError(f"{n} prompts but {len(response_ids)} responses")
    if n == 0:
        raise ValueError("cannot build a policy batch from zero responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first response token is predicted from it)")
    width_p = max(len(p) for p in prompt_ids)
    width_t = max(1, max(len(r) for r in response_ids))
    if response_width is not None:
        if response_width < width_t:
            raise ValueError(f"response_width {response_width} is shorter than the longest response ({width_t})")
        width_t = response_width
    input_ids = torch.full((n, width_p + width_t), pad_token_id, dtype=torch.long)  # (N, P+T)
    attention_mask = torch.zeros((n, width_p + width_t), dtype=torch.long)  # (N, P+T)
    response_mask = torch.zeros((n, width_t), dtype=torch.float32)  # (N, T)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[i, width_p - len(p) : width_p] = torch.as_tensor(list(p), dtype=torch.long)
        attention_mask[i, width_p - len(p) : width_p] = 1
        if len(r):
            input_ids[i, width_p : width_p + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            attention_mask[i, width_p : width_p + len(r)] = 1
            response_mask[i, : len(r)] = 1.0
    # positions count real tokens only, so a left-padded prompt sees the same positions as an unpadded one
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, P+T)
    gid = torch.arange(n) if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.long)
    adv = None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
    trunc = None if truncated is None else torch.as_tensor(list(truncated), dtype=torch.bool)
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        prompt_width=width_p,
        group_index=gid,
        advantages=adv,
        truncated=trunc,
    )


def split_by_groups(batch: PolicyBatch, groups_per_split: int) -> list[PolicyBatch]:
    """Consecutive mini-batches of ``groups_per_split`` prompt groups (responses of a group stay together)."""
    if groups_per_split <= 0:
        raise ValueError(f"groups_per_split must be > 0, got {groups_per_split}")
    gidx = batch.group_index
    # order of first appearance of each group, then rows of each split
    uniq: list[int] = []
    seen: set[int] = set()
    for g in gidx.tolist():
        if g not in seen:
            seen.add(g)
            uniq.append(g)
    splits = []
    for start in range(0, len(uniq), groups_per_split):
        wanted = torch.tensor(uniq[start : start + groups_per_split], dtype=gidx.dtype)
        rows = torch.nonzero(torch.isin(gidx, wanted), as_tuple=False).squeeze(-1)
        splits.append(batch.select(rows))
    return splits


def split_rows(batch: PolicyBatch, rows_per_split: int) -> list[PolicyBatch]:
    """Consecutive micro-batches of at most ``rows_per_split`` responses."""
    if rows_per_split <= 0:
        raise ValueError(f"rows_per_split must be > 0, got {rows_per_split}")
    return [batch.select(slice(s, s + rows_per_split)) for s in range(0, batch.num_responses, rows_per_split)]


def sorted_by_length(batch: PolicyBatch) -> PolicyBatch:
    """Rows sorted by real length, so each micro-batch is trimmed to similar widths (up to ~1/3 less padding
    compute here). The mini-batch gradient is the same sum in another order (global denominators)."""
    order = torch.argsort(batch.attention_mask.sum(dim=1), stable=True)  # (N,)
    return batch.select(order)


def trim_padding(batch: PolicyBatch) -> PolicyBatch:
    """Drop columns that are padding in every row (left of prompts, right of responses) to save compute."""
    used = batch.attention_mask.any(dim=0)  # (P+T,)
    prompt_used = torch.nonzero(used[: batch.prompt_width]).squeeze(-1)
    start = int(prompt_used[0]) if prompt_used.numel() else batch.prompt_width - 1
    resp_len = int(batch.response_mask.sum(dim=0).nonzero().max()) + 1 if batch.response_mask.any() else 1
    stop = batch.prompt_width + resp_len
    return PolicyBatch(
        input_ids=batch.input_ids[:, start:stop],
        attention_mask=batch.attention_mask[:, start:stop],
        position_ids=batch.position_ids[:, start:stop],
        response_mask=batch.response_mask[:, :resp_len],
        prompt_width=batch.prompt_width - start,
        group_index=batch.group_index,
        advantages=batch.advantages,
        old_log_probs=None if batch.old_log_probs is None else batch.old_log_probs[:, :resp_len],
        truncated=batch.truncated,
        # per-token extras (N, T) lose the same columns; per-row ones stay as they are
        extras={
            k: v[:, :resp_len] if v.dim() == 2 and v.shape[1] == batch.response_width else v
            for k, v in batch.extras.items()
        },
    )
