"""Prompt batches for training: tokenised chat prompts and a resumable, seeded sampler over epochs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dapo_core.data.schema import ProblemRecord


@dataclass(frozen=True)
class PromptItem:
    """One training/validation prompt: the record (ground truth, source) and its token ids."""

    record: ProblemRecord
    prompt_ids: tuple[int, ...]

    @property
    def uid(self) -> str:
        return self.record.uid


def encode_prompts(records: Sequence[ProblemRecord], tokenizer: Any, *, max_prompt_length: int) -> list[PromptItem]:
    """Render each record's chat messages with the tokenizer's chat template and tokenize.

    Prompts longer than ``max_prompt_length`` are a data error (curation drops them), so this raises with the
    problem's uid and the fix rather than silently truncating.
    """
    items = []
    for rec in records:
        text = tokenizer.apply_chat_template(rec.prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt of {rec.uid} has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}: re-run "
                "curation with this limit (it drops such rows) or raise data.max_prompt_length"
            )
        if not ids:
            raise ValueError(f"prompt of {rec.uid} tokenizes to nothing: check the chat template and the record")
        items.append(PromptItem(record=rec, prompt_ids=tuple(ids)))
    return items


class PromptSampler:
    """Draws prompt batches epoch after epoch; its position is part of every checkpoint (exact resume).

    Each epoch is a permutation seeded by (seed, epoch) when ``shuffle``; batches cross epoch boundaries.
    """

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True) -> None:
        if num_items <= 0:
            raise ValueError("the training set is empty: check data.train_files (curation kept no rows?)")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.offset >= self.num_items:
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), self.num_items - self.offset)
            out.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_items": self.num_items}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["num_items"]) != self.num_items:
            raise ValueError(
                f"the checkpoint's sampler saw {state['num_items']} training prompts, the data now has "
                f"{self.num_items}: resume with the same data version (see the run's data tags)"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._permutation(self.epoch)
