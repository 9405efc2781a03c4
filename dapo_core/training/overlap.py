"""Rollout that overlaps training (``rollout.mode: one_step_off``): the next steps' first generation batches are
generated while the current step updates.

Weight versions: ``v`` counts the updates applied (step t's update turns v = t-1 into v = t; the sync after it
hands v = t to the rollout). With ``max_staleness`` s, step t submits, just before its update, the first
generation batch of every step up to t+s not yet queued; the rollout generates it with v = t-1 while the trainer
updates. Step t+s trains on it with v = t+s-1, so a batch is at most s versions behind the trainer (s = 1: the
first batch of step t+1 comes from the weights of step t-1, as in verl's one-step-off-policy recipe). The other
generation batches of a step (dynamic sampling's refills) are generated after the sync, on-policy.

The prompts of a queued batch are drawn from the sampler when it is submitted, so with s = 1 every step sees the
same prompts as in ``sync`` mode; its seed is the one ``sync`` would use (``derive_seed(seed, "train", step, 0)``).
A checkpoint holds the queue (prompt indices, seeds, versions and the generated samples), so a resumed run trains
on exactly the batches the uninterrupted one would have. The queue is kept in the checkpoint's JSON meta
(``trainer_state.json``): a few hundred kB at the CPU default, but at GPU scale (thousands of long responses) it
would make that file large; a binary side file is the better home there (not done).

In process (``LocalExecutor``) ``submit_generate`` generates before it returns: the schedule and the samples are
those of the overlapped run, without the speed-up. On Ray the rollout workers generate while the trainer ranks
update (the hf workers are not put to sleep for it; colocated vLLM engines are, which serialises the two).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dapo_core.algorithm import metric_names as mn
from dapo_core.config import DapoConfig
from dapo_core.engines.executor import Executor, PendingRollout, sampling_from
from dapo_core.engines.rollout import RolloutResult
from dapo_core.seeding import derive_seed
from dapo_core.training.prompts import PromptItem, PromptSampler

logger = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A queued generation batch lags the trainer by more than ``rollout.max_staleness`` versions (a bug)."""


@dataclass
class Prefetched:
    """The first generation batch of ``step``, submitted ahead: its prompts, seed and the pending samples."""

    step: int
    indices: list[int]  # into the training prompts
    seed: int
    pending: PendingRollout

    @property
    def version(self) -> int:
        """Weight version of the behaviour policy that generates it."""
        return self.pending.version


@dataclass
class Taken:
    """What a step trains on from the queue: the prompts, the samples and the version they came from."""

    items: list[PromptItem]
    results: list[RolloutResult]
    version: int


class RolloutPrefetcher:
    """The queue of submitted first generation batches (see the module docstring)."""

    def __init__(
        self, executor: Executor, cfg: DapoConfig, items: Sequence[PromptItem], sampler: PromptSampler
    ) -> None:
        self.executor, self.cfg, self.items, self.sampler = executor, cfg, items, sampler
        self.max_staleness = cfg.rollout.max_staleness
        self._queue: deque[Prefetched] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def fill(self, step: int) -> int:
        """Before step ``step``'s update: submit the first batch of each step up to ``step + max_staleness`` (and
        ``trainer.total_steps``) not queued yet; returns how many were submitted."""
        last = min(step + self.max_staleness, self.cfg.trainer.total_steps)
        nxt = self._queue[-1].step + 1 if self._queue else step + 1
        submitted = 0
        for future_step in range(nxt, last + 1):
            indices = self.sampler.next_indices(self.cfg.data.gen_batch_size)
            seed = derive_seed(self.cfg.trainer.seed, "train", future_step, 0)
            pending = self.executor.submit_generate(
                [list(self.items[i].prompt_ids) for i in indices], sampling_from(self.cfg, seed=seed, log_probs=True)
            )
            self._queue.append(Prefetched(future_step, indices, seed, pending))
            submitted += 1
        return submitted

    def take(self, step: int) -> Taken | None:
        """The queued first batch of ``step`` (None when none is queued: the step generates it itself)."""
        if not self._queue or self._queue[0].step > step:
            return None
        head = self._queue.popleft()
        if head.step < step:
            raise StalenessError(f"a batch queued for step {head.step} was left untrained at step {step}")
        lag = self.executor.weight_version - head.version
        if lag > self.max_staleness:
            raise StalenessError(
                f"step {step}'s queued batch was generated with weight version {head.version}, {lag} behind the "
                f"trainer's {self.executor.weight_version}: more than rollout.max_staleness ({self.max_staleness})"
            )
        items = [self.items[i] for i in head.indices]
        try:
            results, version = head.pending.result(), head.version
        except Exception as exc:  # e.g. its worker died after the weights moved on: the old version is gone
            logger.warning(
                "step %d: the batch generated ahead with weight version %d failed (%s); generating it again with "
                "the current weights (version %d)", step, head.version, exc, self.executor.weight_version,
            )  # fmt: skip
            sampling = sampling_from(self.cfg, seed=head.seed, log_probs=True)
            results = self.executor.generate([list(it.prompt_ids) for it in items], sampling)
            version = self.executor.weight_version
        return Taken(items, results, version)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> list[dict[str, Any]]:
        """The queue as JSON-able dicts (waits for batches still generating): goes into the checkpoint meta."""
        return [
            {
                "step": p.step,
                "indices": list(p.indices),
                "seed": p.seed,
                "version": p.version,
                "results": [asdict(r) for r in p.pending.result()],
            }
            for p in self._queue
        ]

    def load_state_dict(self, entries: Sequence[dict[str, Any]]) -> None:
        """Restore a checkpoint's queue (what the interrupted run had generated ahead)."""
        self._queue.clear()
        for e in entries:
            results = [RolloutResult(**r) for r in e["results"]]

            def done(results: list[RolloutResult] = results) -> list[RolloutResult]:
                return results

            pending = PendingRollout(done, int(e["version"]))
            self._queue.append(Prefetched(int(e["step"]), [int(i) for i in e["indices"]], int(e["seed"]), pending))


def staleness_metrics(versions: Sequence[int], trainer_version: int) -> dict[str, float]:
    """``rollout/staleness_*``: weight versions each trained group's samples lag the trainer (0 = on-policy)."""
    lags = [trainer_version - v for v in versions] or [0]
    return {
        mn.ROLLOUT_STALENESS_MEAN: sum(lags) / len(lags),
        mn.ROLLOUT_STALENESS_MAX: float(max(lags)),
        mn.ROLLOUT_OFF_POLICY_GROUPS_FRAC: sum(lag > 0 for lag in lags) / len(lags),
    }
