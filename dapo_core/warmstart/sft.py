"""The base-model warm start of the CPU default: supervised fine-tuning of the tiny Qwen2 on worked solutions.

The paper starts RL from a pretrained base (Qwen2.5-32B). The CPU default has no such model, so this module makes
one: a randomly initialised tiny Qwen2 (``cfg.model.tiny``) with the character tokenizer, trained with the
trainer's SFT objective (``PolicyTrainer.sft_step``: token-mean NLL of the response) on the synthetic task
(``dapo_core.data.synthetic``). Prompt = the ``tiny`` template ``"Q: {question}"`` through the chat template;
response = the worked solution + EOS. A short warm start leaves the model with some skill (held-out accuracy
~10-40%), so RL has groups with reward variance to learn from.

Held-out accuracy is measured on problems that never appear in the SFT stream: a seeded held-out set plus any
questions the caller excludes (e.g. the curated train/val problems), with the ``hf`` rollout backend (greedy and
k sampled responses at T=1.0) and the ``math_dapo`` scorer.

    cfg = load_config(recipe="tiny-dapo")
    ws = WarmStartConfig.from_config(cfg.base_model, seed=cfg.trainer.seed, max_new_tokens=80, steps=1000)
    result = run_warm_start(cfg, ws, output_dir="outputs/base_model")
    print(result.final_metrics["heldout/acc/mean_at_8"])

Deterministic for a seed (same machine and thread count) as long as ``time_budget_s`` does not bind: the step
budget is the contract, the time budget a safety cap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dapo_core.config import BaseModelStageConfig, DapoConfig, validate_section
from dapo_core.data.synthetic import SyntheticProblem
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.models import build_tiny_qwen2, resolve_device, save_hf_dir
from dapo_core.engines.rollout import HFRolloutBackend, SamplingConfig
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.engines.trainer import OptimConfig, PolicyTrainer
from dapo_core.rewards import score_batch
from dapo_core.seeding import derive_seed
from dapo_core.warmstart.demos import TINY_PROMPT as TINY_PROMPT  # re-exported: the data lives in demos
from dapo_core.warmstart.demos import demonstration_set as demonstration_set
from dapo_core.warmstart.demos import exclusion_digest as exclusion_digest
from dapo_core.warmstart.demos import (
    heldout_problems,
    normalize_question,
    prompt_ids,
    response_ids,
    sft_batches,
)
from dapo_core.warmstart.demos import shortcut_demo as shortcut_demo

logger = logging.getLogger(__name__)


MetricsCallback = Callable[[int, dict[str, float]], None]


class WarmStartConfig(BaseModelStageConfig):
    """The warm start's settings: the ``base_model:`` section, plus the seed and the generation length.

    Every knob, its default and its range are the section's (``dapo_core.config.base_model``); this class adds
    only what comes from elsewhere, with no default: ``seed`` (``trainer.seed`` unless the stage is given one) and
    ``max_new_tokens`` (``data.max_response_length``: what RL will allow). Build it with ``from_config``.

    ``steps`` is the budget that makes the run deterministic; ``time_budget_s`` (None = off) stops earlier on a
    slow machine, at the price of determinism. The lr follows a linear warm-up then cosine decay to
    ``lr * min_lr_ratio`` over ``steps``.

    Measured (seed 42, 2 shared CPU cores, the pipeline's exclusions): with lr 1e-3 and 100 warm-up steps the
    probe's greedy accuracy climbs steadily, 4.5% at step 500, 12.5% at 600, 20% at 700, 29.5% at 800; with lr
    3e-3 / 30 warm-up steps it was erratic (8.5% at 900, 3.5% at 1000, 12% at 1300) and varied wildly between
    runs (held-out greedy 10% or 42.5% after 1400 steps). ~0.35 s per step at 2 threads.
    """

    model_config = ConfigDict(frozen=True)

    seed: int = Field(description="Root seed of the warm start (trainer.seed unless the stage is given one).")
    max_new_tokens: int = Field(gt=0, description="Generation cap of its evaluations (data.max_response_length).")

    @classmethod
    def from_config(
        cls, section: BaseModelStageConfig, *, seed: int, max_new_tokens: int, **knobs: Any
    ) -> WarmStartConfig:
        """``section`` (the config's ``base_model:``) with ``knobs`` (its keys) replaced, plus the seed and the
        generation length. A bad knob raises ``ConfigError`` naming ``base_model.<knob>``, its value and range."""
        data = {**section.model_dump(), **knobs, "seed": seed, "max_new_tokens": max_new_tokens}
        return validate_section(cls, data, "base_model")

    def optim_config(self) -> OptimConfig:
        """The SFT optimizer: linear warm-up over ``warmup_steps``, cosine decay to ``lr * min_lr_ratio`` at
        ``steps``; AdamW's own betas (the section sets none)."""
        return OptimConfig(
            lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip, warmup_steps=self.warmup_steps,
            scheduler="cosine", total_steps=self.steps, min_lr_ratio=self.min_lr_ratio, betas=None,
        )  # fmt: skip

    def stamp(self) -> dict[str, Any]:
        """Everything that changes the trained weights or the reported metrics (for the stage's cache stamp)."""
        out = self.model_dump()
        out.pop("log_every")  # logging cadence changes nothing
        out.update(out.pop("demos"))  # flat, as the stamps of base models built before the knobs were nested
        if not out["check_frac"]:  # added later: at its default the stamps of earlier base models still hold
            out.pop("check_frac")
        return out


@dataclass
class WarmStartResult:
    """What a warm start did: steps run, wall time, the final and the logged metrics, the saved directory."""

    steps: int
    wall_s: float
    stopped_by: str  # "steps" | "target" | "time_budget"
    final_metrics: dict[str, float]
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    output_dir: Path | None = None
    num_excluded: int = 0


# ---------------------------------------------------------------------------------------------------- model
def build_base_model(cfg: DapoConfig, *, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A fresh tiny Qwen2 (architecture from ``cfg.model.tiny``) and the character tokenizer."""
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    t = cfg.model.tiny
    model = build_tiny_qwen2(
        tokenizer,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        rope_theta=t.rope_theta,
        seed=derive_seed(seed, "base_model_init"),
    )
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------- eval
def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[SyntheticProblem],
    *,
    max_new_tokens: int,
    micro_batch_size: int = 256,
    backend: HFRolloutBackend | None = None,
) -> float:
    """Share of ``problems`` whose greedy (temperature 0) response ``math_dapo`` scores correct."""
    if not problems:
        return 0.0
    backend = backend or HFRolloutBackend(model, tokenizer, micro_batch_size=micro_batch_size)
    was_training = model.training
    model.eval()
    prompts = [prompt_ids(tokenizer, p.question) for p in problems]
    greedy = backend.generate(
        prompts, SamplingConfig(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=0)
    )
    scored = score_batch("math_dapo", [g.text for g in greedy], [str(p.answer) for p in problems]).results
    model.train(was_training)
    return sum(bool(r["acc"]) for r in scored) / len(problems)


def evaluate_heldout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[SyntheticProblem],
    *,
    k: int,
    seed: int,
    max_new_tokens: int,
    micro_batch_size: int = 256,
) -> dict[str, float]:
    """Greedy accuracy and k samples at T=1.0 per problem, scored by ``math_dapo``.

    Returns ``heldout/acc/greedy``, ``heldout/acc/mean_at_{k}`` (avg@k), ``heldout/acc/pass_at_{k}`` (any of the k
    correct: the unbiased estimator with n = k), ``heldout/response_length/mean`` and ``.../clip_ratio``
    (truncated share) of the sampled responses.
    """
    if not problems:
        return {}
    backend = HFRolloutBackend(model, tokenizer, micro_batch_size=micro_batch_size)
    prompts = [prompt_ids(tokenizer, p.question) for p in problems]
    truths = [str(p.answer) for p in problems]
    greedy_acc = greedy_accuracy(model, tokenizer, problems, max_new_tokens=max_new_tokens, backend=backend)
    sampled = backend.generate(
        prompts, SamplingConfig(n=k, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=seed)
    )  # results[i * k + j]: sample j of problem i
    scored = score_batch("math_dapo", [s.text for s in sampled], [t for t in truths for _ in range(k)]).results
    acc = torch.tensor([bool(r["acc"]) for r in scored], dtype=torch.float32).view(len(problems), k)  # (B, k)
    lengths = torch.tensor([s.response_length for s in sampled], dtype=torch.float32)  # (B*k,)
    truncated = torch.tensor([s.truncated for s in sampled], dtype=torch.float32)  # (B*k,)
    return {
        "heldout/acc/greedy": greedy_acc,
        f"heldout/acc/mean_at_{k}": float(acc.mean()),
        f"heldout/acc/pass_at_{k}": float((acc.sum(dim=1) > 0).float().mean()),
        "heldout/response_length/mean": float(lengths.mean()),
        "heldout/response_length/clip_ratio": float(truncated.mean()),
    }


# ---------------------------------------------------------------------------------------------------- train
def _sft_loop(
    trainer: PolicyTrainer,
    tokenizer: PreTrainedTokenizerBase,
    batches: Iterator[list[SyntheticProblem]],
    ws: WarmStartConfig,
    on_metrics: MetricsCallback | None,
    probe: Callable[[], float] | None = None,
) -> tuple[int, str, list[tuple[int, dict[str, float]]]]:
    """SFT steps until ``ws.steps``, the probe target or the time budget; returns (steps done, stop reason,
    logged history). ``probe()`` is the greedy accuracy on the probe set, called every ``ws.check_every`` steps
    from ``ws.check_from`` when ``ws.target_greedy_acc`` is set."""
    start = time.perf_counter()
    pad_id = int(tokenizer.pad_token_id)
    history: list[tuple[int, dict[str, float]]] = []
    window: list[dict[str, float]] = []
    window_start, step, stopped_by = start, 0, "steps"
    for step, problems in enumerate(batches, start=1):
        batch = build_policy_batch(
            [prompt_ids(tokenizer, p.question) for p in problems],
            [response_ids(tokenizer, p.solution) for p in problems],
            pad_token_id=pad_id,
        )  # (B, P+T): prompt left-padded, solution + EOS right-padded
        m = trainer.sft_step(batch)
        m["tokens"] = float(batch.response_mask.sum())
        window.append(m)
        now = time.perf_counter()
        out_of_time = ws.time_budget_s is not None and now - start >= ws.time_budget_s and step < ws.steps
        checking = probe is not None and step >= ws.check_from and step % ws.check_every == 0
        if step % ws.log_every == 0 or step == ws.steps or out_of_time or checking:
            metrics = {
                f"sft/{k}": sum(r[k] for r in window) / len(window) for k in ("loss", "token_acc", "grad_norm", "lr")
            }
            metrics["sft/tokens_per_s"] = sum(r["tokens"] for r in window) / max(now - window_start, 1e-9)
            metrics["sft/elapsed_s"] = now - start
            history.append((step, metrics))
            if on_metrics is not None:
                on_metrics(step, metrics)
            logger.info("sft step %d: loss %.4f token_acc %.3f", step, metrics["sft/loss"], metrics["sft/token_acc"])
            window, window_start = [], now
        if step >= ws.steps:
            break
        if checking and probe is not None and ws.target_greedy_acc is not None:
            acc = probe()
            history.append((step, {"sft/probe_greedy_acc": acc}))
            if on_metrics is not None:
                on_metrics(step, {"sft/probe_greedy_acc": acc})
            logger.info("sft step %d: probe greedy accuracy %.3f (target %.3f)", step, acc, ws.target_greedy_acc)
            if acc >= ws.target_greedy_acc:
                stopped_by = "target"
                break
        if out_of_time:
            stopped_by = "time_budget"
            logger.warning(
                "warm start stopped by time_budget_s=%s after %d steps (not deterministic)", ws.time_budget_s, step
            )
            break
    return step, stopped_by, history


def warm_start_sets(
    ws: WarmStartConfig, exclude: Collection[str] = ()
) -> tuple[list[SyntheticProblem], list[SyntheticProblem], set[str]]:
    """The warm start's held-out problems, its probe set (empty unless a target greedy accuracy is checked within
    its steps) and every question it never trains on: ``exclude``'s (normalised), the held-out and the probe ones."""
    ops = {"min_ops": ws.demos.min_ops, "max_ops": ws.demos.max_ops}
    heldout = heldout_problems(ws.heldout_size, seed=ws.seed, exclude=exclude, **ops)
    banned = {normalize_question(q) for q in exclude} | {p.question for p in heldout}
    probe_set: list[SyntheticProblem] = []
    if ws.target_greedy_acc is not None and ws.check_from <= ws.steps:  # its own stream: held-out stays unbiased
        probe_set = heldout_problems(ws.probe_size, seed=ws.seed, exclude=banned, stream="probe", **ops)
        banned |= {p.question for p in probe_set}
    return heldout, probe_set, banned


def demonstration_batches(ws: WarmStartConfig, banned: Collection[str]) -> Iterator[list[SyntheticProblem]]:
    """The seeded stream of demonstration batches with the warm start's settings, none of them on a ``banned``
    question: the one stream the warm start and its supervised controls draw from."""
    return sft_batches(ws.batch_size, ws.demos, seed=ws.seed, exclude=banned)


def run_warm_start(
    cfg: DapoConfig,
    ws: WarmStartConfig,
    *,
    exclude: Collection[str] = (),
    output_dir: str | Path | None = None,
    on_metrics: MetricsCallback | None = None,
) -> WarmStartResult:
    """Build the tiny model, SFT it on the synthetic stream, measure held-out accuracy, save an HF directory.

    ``exclude``: question strings (bare or ``"Q: ..."``) that must never be trained on, e.g. the curated
    problems; the held-out problems are excluded too. ``on_metrics(step, metrics)`` receives the ``sft/*``
    metrics averaged over every ``ws.log_every`` steps, then the final metrics with ``heldout/*`` (e.g. to log
    them to MLflow).
    """
    start = time.perf_counter()
    model, tokenizer = build_base_model(cfg, seed=ws.seed)
    model.to(resolve_device(cfg.trainer.device))  # type: ignore[arg-type]
    heldout, probe_set, banned = warm_start_sets(ws, exclude)
    trainer = PolicyTrainer(model, ws.optim_config(), micro_batch_size=ws.micro_batch_size)
    batches = demonstration_batches(ws, banned)
    logger.info("warm start: %d steps x %d problems, lr %g, %d excluded", ws.steps, ws.batch_size, ws.lr, len(banned))

    def probe() -> float:
        return greedy_accuracy(model, tokenizer, probe_set, max_new_tokens=ws.max_new_tokens)

    steps, stopped_by, history = _sft_loop(trainer, tokenizer, batches, ws, on_metrics, probe if probe_set else None)
    train_s = time.perf_counter() - start

    model.eval()
    final = {k: v for _, m in history for k, v in m.items()}  # the last value of each logged metric
    final.update(
        evaluate_heldout(
            model, tokenizer, heldout, k=ws.heldout_k, seed=derive_seed(ws.seed, "heldout_sampling"),
            max_new_tokens=ws.max_new_tokens,
        )
    )  # fmt: skip
    final.update(
        {"sft/steps": float(steps), "sft/train_s": train_s, "heldout/eval_s": time.perf_counter() - start - train_s}
    )
    if on_metrics is not None:
        on_metrics(steps, final)
    saved = save_hf_dir(model, tokenizer, output_dir) if output_dir is not None else None
    wall = time.perf_counter() - start
    heldout_acc = {k: round(v, 3) for k, v in final.items() if k.startswith("heldout/acc")}
    logger.info("warm start done: %d steps in %.1f s, held-out %s", steps, wall, heldout_acc)
    return WarmStartResult(
        steps=steps, wall_s=wall, stopped_by=stopped_by, final_metrics=final, history=history, output_dir=saved,
        num_excluded=len(banned),
    )  # fmt: skip
