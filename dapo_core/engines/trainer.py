"""The policy trainer: per-token log-probs and entropy, DAPO/GRPO mini-batch updates, SFT, data parallel.

One ``update`` call is one rollout step of Algorithm 1, lines 10-12: ``ppo_epochs`` passes over the kept batch in
mini-batches of ``ppo_mini_batch_size`` prompt groups, each split into micro-batches whose gradients accumulate.
The token-mean denominator is the token count of the *whole* mini-batch (all micro-batches, all ranks), so the
accumulated gradient is exactly the mini-batch gradient however it is split (see ``dapo_core.algorithm``).

Data parallel: when ``torch.distributed`` is initialised with world size > 1, each rank holds a shard of every
mini-batch; the denominators are all-reduced (summed) and so are the gradients. Summing is right because each
rank's loss already divides by the global count: sum over ranks of d(local_sum / global_count) = d(whole loss).

FSDP2 (``dapo_core.engines.fsdp.apply_fsdp2`` applied before building the trainer): FSDP reduce-scatters the
gradients itself (summed, divide factor 1), so the manual all-reduce is skipped and gradient sync is deferred to
the last micro-batch of a mini-batch. Every forward all-gathers parameters, so every rank must run the same
number of forward/backward passes: ranks agree on the micro-batch count (all-reduce max) and a rank with fewer
rows runs zero-weight filler micro-batches (response mask all zero: they add exactly nothing).

Temperature: the RL log-probs and entropy (``compute_log_probs``, ``update``) are those of the *sampling*
distribution, softmax(logits / T) with T = rollout.temperature, as in verl; ``sft_step`` uses the raw logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from dapo_core.algorithm import (
    agg_loss,
    entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
)
from dapo_core.engines.batch import PolicyBatch, sorted_by_length, split_by_groups, split_rows, trim_padding
from dapo_core.engines.fsdp import (
    agreed_mini_batch_count,
    enable_activation_checkpointing,
    filler_micro_batch,
    full_value,
    is_fsdp,
    most_over_ranks,
    sum_over_ranks,
    world_size,
)
from dapo_core.engines.loss import LossConfig
from dapo_core.engines.optim import (
    OptimConfig,
    checked_mini_batch_scales,
    lr_lambda,
    scaled_lr,
    short_mini_batch_scales,
)

__all__ = ["LossConfig", "OptimConfig", "PolicyTrainer", "lr_lambda", "short_mini_batch_scales"]

logger = logging.getLogger(__name__)

# per-micro-batch metrics averaged with token weights over the mini-batch
_TOKEN_WEIGHTED = (
    "pg_clipfrac",
    "pg_clipfrac_high",
    "pg_clipfrac_low",
    "pg_clipfrac_dual",
    "ppo_kl",
    "entropy",
    "mean_prob",
)


class PolicyTrainer:
    """Owns the model's training side: optimizer, scheduler, and the update / log-prob / SFT computations."""

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        *,
        micro_batch_size: int = 64,
        gradient_checkpointing: bool = False,
        entropy_chunk_size: int = 1024,
        device: torch.device | str | None = None,
        fsdp_defer_grad_sync: bool = True,
        temperature: float = 1.0,
    ) -> None:
        """``fsdp_defer_grad_sync`` (FSDP2 only): reduce-scatter gradients once per mini-batch instead of once per
        micro-batch. Same numbers, fewer collectives, but the unsharded gradients of the whole model (in the
        reduce dtype) are held while accumulating: turn it off when that does not fit (e.g. 32B on 80 GB GPUs).

        ``temperature``: the rollout's sampling temperature (rollout.temperature). pi_old and pi_theta are
        softmax(logits / temperature), the distribution the responses were drawn from (verl does the same)."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"PolicyTrainer temperature ({temperature}) must be a finite number > 0: the trainer divides the "
                "logits by the rollout's sampling temperature to recompute its log-probs; set rollout.temperature "
                "> 0 (the paper trains at 1.0; greedy decoding, 0, has no distribution to train)"
            )
        self.temperature = float(temperature)
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.optim_cfg = optim
        self.micro_batch_size = micro_batch_size
        self.entropy_chunk_size = entropy_chunk_size
        # FSDP2: gradients are reduce-scattered by FSDP, and every rank must run as many forwards as the others
        self.fsdp = is_fsdp(model)
        self.fsdp_defer_grad_sync = fsdp_defer_grad_sync
        if gradient_checkpointing:
            enable_activation_checkpointing(model)  # (apply_fsdp2 does it before sharding; then this is a no-op)
        self.optimizer = torch.optim.AdamW(model.parameters(), **optim.adamw_kwargs())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim))
        self.global_step = 0  # optimizer-facing rollout steps done (= scheduler steps)

    # ------------------------------------------------------------------ forward
    def _forward_logits(self, mb: PolicyBatch) -> Tensor:
        """Logits predicting each response token: (n, T_mb, V)."""
        t = mb.response_width
        out = self.model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            logits_to_keep=t + 1,  # only positions P-1 .. P+T-1 need the LM head
            use_cache=False,
        )
        return out.logits[:, :-1, :]  # (n, T, V): position P-1+t predicts response token t

    def _sampling_logits(self, mb: PolicyBatch) -> Tensor:
        """Logits of the sampling distribution, logits / temperature: (n, T_mb, V). For the RL log-probs only."""
        logits = self._forward_logits(mb)  # (n, T, V)
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)  # in place, as verl: no second (n, T, V) copy
        return logits

    def _log_probs(self, mb: PolicyBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        logits = self._sampling_logits(mb)  # (n, T, V)
        log_probs = log_probs_from_logits(logits, mb.responses, chunk_size=self.entropy_chunk_size)  # (n, T)
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits, chunk_size=self.entropy_chunk_size)  # (n, T)
        return log_probs, entropy

    def _lockstep(self, micros: list[PolicyBatch]) -> list[PolicyBatch | None]:
        """Under FSDP2, pad with ``None`` (a filler micro-batch) to the largest micro-batch count of any rank."""
        if not self.fsdp:
            return list(micros)
        return [*micros, *([None] * (most_over_ranks(len(micros), self.device) - len(micros)))]

    def _prepare(self, micro: PolicyBatch | None) -> PolicyBatch:
        return filler_micro_batch(self.device) if micro is None else trim_padding(micro).to(self.device)

    def _agree_mini_batches(self, minis: list[PolicyBatch], batch: PolicyBatch) -> list[PolicyBatch]:
        """Under FSDP2 every rank takes the same optimizer steps: mini-batch counts must agree, except that a rank
        with no rows at all joins each mini-batch with filler micro-batches only."""
        if not self.fsdp:
            return minis
        most = agreed_mini_batch_count(len(minis), self.device)  # a collective: every rank calls it
        return minis or [batch] * most

    def _sync_grads_on(self, index: int, count: int) -> None:
        """FSDP2 with deferred sync: reduce-scatter only in the last micro-batch's backward (gradients accumulate
        unsharded before; see ``fsdp_defer_grad_sync``)."""
        if isinstance(self.model, FSDPModule) and self.fsdp_defer_grad_sync:
            self.model.set_requires_gradient_sync(index == count - 1)

    @torch.no_grad()
    def compute_log_probs(self, batch: PolicyBatch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropy) of every response token under the current policy, in micro-batches.

        Used for pi_old (recomputed on the kept batch right before updating), at the sampling temperature.
        Returns (N, T) tensors on CPU, zero where the response mask is zero.
        """
        was_training = self.model.training
        self.model.eval()
        n, width = batch.num_responses, batch.response_width
        out_lp = torch.zeros(n, width, dtype=torch.float32)
        out_ent = torch.zeros(n, width, dtype=torch.float32) if with_entropy else None
        micros = [batch.select(slice(s, s + self.micro_batch_size)) for s in range(0, n, self.micro_batch_size)]
        for k, micro in enumerate(self._lockstep(micros)):
            mb = self._prepare(micro)
            lp, ent = self._log_probs(mb, with_entropy)
            if micro is None:  # a filler: its forward only kept the FSDP ranks in step
                continue
            start, t = k * self.micro_batch_size, mb.response_width
            out_lp[start : start + lp.shape[0], :t] = (lp * mb.response_mask).float().cpu()
            if out_ent is not None and ent is not None:
                out_ent[start : start + ent.shape[0], :t] = (ent * mb.response_mask).float().cpu()
        self.model.train(was_training)
        return out_lp, out_ent

    # ------------------------------------------------------------------ RL update
    def update(
        self,
        batch: PolicyBatch,
        loss_cfg: LossConfig,
        *,
        ppo_epochs: int,
        mini_batch_groups: int,
        mini_batch_scales: Sequence[float] | None = None,
    ) -> dict:
        """``ppo_epochs`` x mini-batches of ``mini_batch_groups`` groups; one optimizer step per mini-batch.

        ``batch`` must carry ``advantages`` (N,) and ``old_log_probs`` (N, T). Returns bare metric names
        (callers prefix ``actor/``): pg_loss, pg_clipfrac(_high/_low/_dual), ppo_kl, entropy, mean_prob,
        grad_norm, lr, num_updates, short_minibatch_scale, plus the clip fractions of the last mini-batch
        (``*_last``).

        A short last mini-batch (fewer groups than ``mini_batch_groups``, as when dynamic sampling with
        on_exhausted=continue kept fewer than train_batch_size) steps at lr x its groups / ``mini_batch_groups``:
        it moves the policy in proportion to its data. The lr is scaled, not the loss, as Adam normalises the
        gradient's size away; it is restored right after that step and the scheduler never sees it.
        ``short_minibatch_scale`` reports the smallest multiplier (1.0: none short). Under data parallel the group
        count is summed over ranks (each holds whole groups of every mini-batch); shards that relabel groups
        (``shard_for_update``) come with ``mini_batch_scales`` instead: ``short_mini_batch_scales`` of the whole
        batch, one per mini-batch of an epoch.
        """
        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("update() needs batch.advantages and batch.old_log_probs (compute them first)")
        if ppo_epochs <= 0:
            raise ValueError(f"ppo_epochs must be > 0, got {ppo_epochs}")
        per_epoch = split_by_groups(batch, mini_batch_groups)
        given = checked_mini_batch_scales(mini_batch_scales, len(per_epoch))
        self.model.train()
        lr_now = self.optimizer.param_groups[0]["lr"]
        results: list[dict[str, float]] = []
        scales: list[float] = []
        minis = [mini for _epoch in range(ppo_epochs) for mini in per_epoch]
        for index, mini in enumerate(self._agree_mini_batches(minis, batch)):
            if given is not None:
                scales.append(given[index % len(given)])
            else:  # a collective under data parallel, like the denominators: every rank runs it per mini-batch
                groups = sum_over_ranks(float(mini.group_index.unique().numel()), self.device)
                scales.append(min(1.0, groups / mini_batch_groups))
            results.append(self._update_mini_batch(mini, loss_cfg, lr_scale=scales[-1]))
        self.scheduler.step()
        self.global_step += 1
        return _update_metrics(results, scales, lr_now)

    def _update_mini_batch(self, mini: PolicyBatch, loss_cfg: LossConfig, *, lr_scale: float) -> dict[str, float]:
        """One optimizer step on ``mini``: the micro-batches' gradients accumulated, then clipped and applied at
        lr x ``lr_scale``; the metrics token-weighted over the mini-batch (pg_loss summed, grad_norm)."""
        assert mini.advantages is not None and mini.old_log_probs is not None
        # Global denominators over the whole mini-batch (all micro-batches, all ranks), with the loss mask.
        num_tokens = sum_over_ranks(float(mini.response_mask.sum()), self.device)
        num_seqs = sum_over_ranks(float((mini.response_mask.sum(dim=1) > 0).sum()), self.device)
        # Dr. GRPO's constant: the configured length, else the mini-batch's padded width (same for every micro)
        norm_length = loss_cfg.norm_length if loss_cfg.norm_length is not None else mini.response_width
        self.optimizer.zero_grad(set_to_none=True)
        weighted = dict.fromkeys(_TOKEN_WEIGHTED, 0.0)  # the same keys on every rank (all-reduced below)
        loss_total = 0.0
        micros = self._lockstep(split_rows(sorted_by_length(mini), self.micro_batch_size))
        for index, micro in enumerate(micros):
            mb = self._prepare(micro)
            loss, m = self._micro_loss(mb, loss_cfg, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
            self._sync_grads_on(index, len(micros))
            loss.backward()
            loss_total += float(loss.detach())
            if micro is None:  # a filler adds nothing, not even to the metrics
                continue
            tokens = float(mb.response_mask.sum())  # token-weighted averages of the per-micro-batch metrics
            for k in _TOKEN_WEIGHTED:
                weighted[k] += m[k] * tokens
        self._all_reduce_grads()
        grad_norm = self._clip_and_step(lr_scale)
        out = {k: sum_over_ranks(v, self.device) / max(num_tokens, 1.0) for k, v in weighted.items()}
        out["pg_loss"] = sum_over_ranks(loss_total, self.device)
        out["grad_norm"] = float(grad_norm)
        return out

    def _micro_loss(
        self, mb: PolicyBatch, loss_cfg: LossConfig, *, num_tokens: float, num_seqs: float, norm_length: int
    ) -> tuple[Tensor, dict[str, float]]:
        """One micro-batch's policy loss (minus entropy_coef x the entropy, aggregated alike, when set) with the
        mini-batch's denominators, and its metrics, entropy and mean_prob included (masked token means)."""
        assert mb.old_log_probs is not None and mb.advantages is not None
        logits = self._sampling_logits(mb)  # (n, T, V), at the rollout temperature like pi_old
        log_probs = log_probs_from_logits(logits, mb.responses, chunk_size=self.entropy_chunk_size)  # (n, T)
        denominators = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "norm_length": norm_length}
        loss, m = policy_loss(
            log_probs, mb.old_log_probs, mb.advantages, mb.response_mask,
            mode=loss_cfg.mode, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c,
            loss_agg=loss_cfg.loss_agg, **denominators,
            token_weights=mb.extras.get("is_weights"),  # truncated IS (training.step.rollout_correction)
        )  # fmt: skip
        if loss_cfg.entropy_coef != 0.0:
            entropy = entropy_from_logits(logits, chunk_size=self.entropy_chunk_size)  # (n, T)
            ent_loss = agg_loss(entropy, mb.response_mask, loss_cfg.loss_agg, **denominators)
            loss = loss - loss_cfg.entropy_coef * ent_loss
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), chunk_size=self.entropy_chunk_size)
        with torch.no_grad():
            m["entropy"] = float(masked_mean(entropy.detach(), mb.response_mask))
            m["mean_prob"] = float(masked_mean(torch.exp(log_probs.detach()), mb.response_mask))
        return loss, m

    def _clip_and_step(self, lr_scale: float) -> Tensor:
        """Clip the gradients to ``grad_clip`` and step at lr x ``lr_scale``; a non-finite norm skips the step
        (gradients dropped). Returns the norm before clipping."""
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip))
        if torch.isfinite(grad_norm):
            with scaled_lr(self.optimizer, lr_scale):  # < 1 only for a short last mini-batch (see update)
                self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s: skipping this optimizer step", float(grad_norm))
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _all_reduce_grads(self) -> None:
        if world_size() == 1 or self.fsdp:  # FSDP2 already reduce-scattered (summed) them in backward
            return
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    # ------------------------------------------------------------------ SFT
    def sft_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One supervised step: token-mean NLL of the response tokens (the base model's warm start)."""
        self.model.train()
        num_tokens = sum_over_ranks(float(batch.response_mask.sum()), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        total, correct = 0.0, 0.0
        micros = self._lockstep(split_rows(sorted_by_length(batch), self.micro_batch_size))
        for index, micro in enumerate(micros):
            mb = self._prepare(micro)
            logits = self._forward_logits(mb)  # (n, T, V)
            log_probs = log_probs_from_logits(logits, mb.responses, chunk_size=self.entropy_chunk_size)  # (n, T)
            loss = -masked_sum(log_probs, mb.response_mask) / max(num_tokens, 1.0)
            self._sync_grads_on(index, len(micros))
            loss.backward()
            total += float(loss.detach())
            with torch.no_grad():
                hits = (logits.argmax(dim=-1) == mb.responses).float()
                correct += float(masked_sum(hits, mb.response_mask))
        self._all_reduce_grads()
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip))
        lr_now = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        return {
            "loss": sum_over_ranks(total, self.device),
            "token_acc": sum_over_ranks(correct, self.device) / max(num_tokens, 1.0),
            "grad_norm": float(grad_norm),
            "lr": lr_now,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Optimizer (not under FSDP2: its state is sharded, see ``fsdp.save_sharded``), scheduler and step."""
        state: dict = {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step}
        if not self.fsdp:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Under FSDP2 the optimizer comes from the shards (``fsdp.load_sharded``), so ``state`` must not hold it."""
        if self.fsdp and "optimizer" in state:
            raise ValueError(
                "this trainer state holds a full optimizer state (saved by ddp ranks) but this trainer is sharded "
                "(FSDP2): resume with trainer.strategy=ddp, or start a new run from its weights (model.path=<dir>)"
            )
        if not self.fsdp and "optimizer" not in state:
            raise ValueError(
                "this trainer state has no optimizer state: it was saved by FSDP2 ranks (optimizer sharded under "
                "the checkpoint's shards/); resume with trainer.strategy=fsdp2, or start a new run from its "
                "weights (model.path=<checkpoint dir>)"
            )
        if not self.fsdp:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])


def _update_metrics(results: list[dict[str, float]], scales: list[float], lr: float) -> dict[str, float]:
    """``update``'s metrics: each mini-batch metric's mean, the lr, the update count, the smallest lr scale and the
    clip fractions and KL of the last mini-batch (``*_last``)."""
    sums: dict[str, float] = {}
    for m in results:
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    metrics = {k: v / len(results) for k, v in sums.items()}
    metrics["lr"] = lr
    metrics["num_updates"] = float(len(results))
    metrics["short_minibatch_scale"] = min(scales, default=1.0)
    last = results[-1] if results else {}
    for k in ("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ppo_kl"):
        metrics[f"{k}_last"] = last.get(k, 0.0)
    return metrics
