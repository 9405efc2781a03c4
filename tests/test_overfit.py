"""RL overfits a handful of prompts (issue 12): a loop that cannot overfit four prompts has a bug.

A small base model is warm-started on one-operation problems (``run_warm_start``, as the base-model stage does);
four problems it solves only sometimes are chosen; then the real RL machinery (``LocalExecutor``, the step
functions of ``dapo_core.training.step``, dynamic sampling with ``GroupAccumulator``) trains on those four prompts
only, with the recipe's DAPO loss and AdamW. Their sampled accuracy (T=1.0, 64 samples per prompt, fixed seeds)
must climb from the base model's level to >= 0.95 within a bounded number of rollout steps.

Measured (2 shared cores, single-threaded): warm start ~40 s, the four at 0.30 sampled accuracy, solved at RL step 15
(~10 s). Negative control: with the policy loss's sign flipped the four fall to ~0% by step 15 and the test fails.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_overfit.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from dapo_core.algorithm import GroupAccumulator
from dapo_core.config import BaseModelStageConfig, DapoConfig, load_config
from dapo_core.data.schema import ProblemRecord
from dapo_core.data.synthetic import SyntheticProblem, generate_problems
from dapo_core.engines.executor import LocalExecutor
from dapo_core.seeding import derive_seed
from dapo_core.training.prompts import PromptItem
from dapo_core.training.step import build_train_batch, generate_and_score, keep_flags
from dapo_core.warmstart.sft import WarmStartConfig, prompt_ids, run_warm_start

pytestmark = pytest.mark.slow

BASE_ARCH = [
    "model.tiny.hidden_size=48",
    "model.tiny.num_hidden_layers=3",
    "model.tiny.num_attention_heads=4",
    "model.tiny.num_key_value_heads=2",
    "model.tiny.intermediate_size=96",
    "model.tiny.max_position_embeddings=64",
]
# One-operation problems only (responses like "57*6=342\nAnswer: 342", ~21 tokens); no held-out evaluation
WARM_START = WarmStartConfig.from_config(
    BaseModelStageConfig(), seed=0, max_new_tokens=24, steps=1000, lr=5e-3, warmup_steps=10, batch_size=32,
    micro_batch_size=32, demos={"min_ops": 1, "max_ops": 1}, heldout_size=0, log_every=1000,
)  # fmt: skip
RL_SETTINGS = [
    "trainer.lr=3e-4",  # 3x the recipe's; at 1e-3 one of the four can collapse to 0% correct (then: no signal)
    "trainer.lr_warmup_steps=0",
    "rollout.n=16",
    "data.train_batch_size=4",
    "data.gen_batch_size=4",
    "trainer.ppo_mini_batch_size=4",  # one optimizer step per rollout step
    "trainer.micro_batch_size=64",
    "data.max_response_length=32",
    "algorithm.overlong.buffer_length=4",  # correct responses (<= 24 tokens) are never penalised
    "algorithm.dynamic_sampling.max_num_gen_batches=10",
    "algorithm.dynamic_sampling.on_exhausted=continue",
    "trainer.seed=0",
]
NUM_CANDIDATES = 200  # one-operation problems the four are picked from
SHORTLIST = 12
MAX_PICK_ACC = 0.6
EVAL_SAMPLES = 64  # per prompt: 256 samples, ~0.013 standard error at 95% accuracy
EVAL_EVERY = 5
MAX_STEPS = 100  # measured: solved at step 15 here, 50-60 from weaker warm starts (other seeds)
TARGET = 0.95
MIN_EACH = 0.85


@dataclass
class OverfitRun:
    problems: list[SyntheticProblem]
    base_acc: list[float]  # per prompt, before any update
    evals: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, per-prompt accuracy)
    train_acc: list[float] = field(default_factory=list)  # per step: accuracy of its first generation batch


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def solved(acc: list[float]) -> bool:
    """Near 100%: >= 95% correct over the four prompts, and none of them below 85%."""
    return _mean(acc) >= TARGET and min(acc) >= MIN_EACH


def prompt_items(problems: list[SyntheticProblem], tokenizer) -> list[PromptItem]:
    return [
        PromptItem(
            record=ProblemRecord(data_source="synthetic", prompt=[], ground_truth=str(p.answer), index=i),
            prompt_ids=tuple(prompt_ids(tokenizer, p.question)),
        )
        for i, p in enumerate(problems)
    ]


def sampled_accuracy(executor: LocalExecutor, items: list[PromptItem], cfg: DapoConfig, *, n: int, seed: int):
    """Per prompt: the share of ``n`` samples (the training sampling: T=1.0, top_p=1.0) scored correct."""
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"n": n})})
    return [_mean([float(a) for a in g.acc]) for g in generate_and_score(executor, items, cfg, seed=seed).groups]


def rl_step(executor: LocalExecutor, items: list[PromptItem], cfg: DapoConfig, step: int) -> tuple[float, bool]:
    """One DAPO rollout step on ``items`` (dynamic sampling as the flow does it); returns the accuracy of the
    first generation batch and whether an update ran (no group with signal in any batch: none)."""
    ds = cfg.algorithm.dynamic_sampling
    acc = GroupAccumulator(
        target_num_groups=cfg.data.train_batch_size,
        max_num_gen_batches=ds.max_num_gen_batches,
        on_exhausted=ds.on_exhausted,
    )
    first: float | None = None
    while acc.need_more():
        seed = derive_seed(cfg.trainer.seed, "train", step, acc.num_gen_batches)
        gen = generate_and_score(executor, items, cfg, seed=seed)
        if first is None:
            first = _mean([float(a) for g in gen.groups for a in g.acc])
        acc.add(gen.groups, keep_flags(gen, cfg))
    groups = acc.take()
    assert first is not None
    if not groups:
        return first, False
    batch, _ = build_train_batch(groups, cfg, pad_token_id=executor.tokenizer.pad_token_id)
    batch.old_log_probs, _ = executor.compute_log_probs(batch, with_entropy=True)
    executor.update(batch)
    executor.sync_weights()
    return first, True


def pick_four(executor: LocalExecutor, cfg: DapoConfig) -> list[SyntheticProblem]:
    """The four one-operation problems the base model solves most often, short of nearly always: a coarse pass
    over many candidates (16 samples each), then a finer one over the shortlist (64 samples each), so that the
    choice is not just the luckiest draws of the coarse pass. Seeded: the same base model gives the same four."""
    tok = executor.tokenizer
    candidates = list({p.question: p for p in generate_problems(NUM_CANDIDATES, seed=7, min_ops=1, max_ops=1)}.values())
    coarse = sampled_accuracy(executor, prompt_items(candidates, tok), cfg, n=16, seed=11)
    shortlist = sorted((i for i, a in enumerate(coarse) if a <= 0.75), key=lambda i: (-coarse[i], i))[:SHORTLIST]
    fine = sampled_accuracy(executor, prompt_items([candidates[i] for i in shortlist], tok), cfg, n=64, seed=12)
    ranked = sorted((j for j, a in enumerate(fine) if a <= MAX_PICK_ACC), key=lambda j: (-fine[j], j))
    return [candidates[shortlist[j]] for j in ranked[:4]]


def overfit(base_dir: str, recipe: str = "tiny-dapo") -> OverfitRun:
    cfg = load_config(recipe=recipe, overrides=[f"model.path={base_dir}", *RL_SETTINGS], env={})
    executor = LocalExecutor(cfg)
    tok = executor.tokenizer
    problems = pick_four(executor, cfg)
    items = prompt_items(problems, tok)
    run = OverfitRun(problems=problems, base_acc=sampled_accuracy(executor, items, cfg, n=EVAL_SAMPLES, seed=1000))
    for step in range(1, MAX_STEPS + 1):
        train_acc, updated = rl_step(executor, items, cfg, step)
        run.train_acc.append(train_acc)
        if step % EVAL_EVERY == 0 or not updated:  # no update: the policy cannot change any more
            run.evals.append((step, sampled_accuracy(executor, items, cfg, n=EVAL_SAMPLES, seed=1000 + step)))
            if solved(run.evals[-1][1]) or not updated:
                break
    return run


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, one_thread) -> str:
    cfg = load_config(recipe="tiny-dapo", overrides=BASE_ARCH, env={})
    out = tmp_path_factory.mktemp("overfit") / "base_model"
    run_warm_start(cfg, WARM_START, output_dir=out)
    return str(out)


@pytest.fixture(scope="module")
def overfit_run(base_dir) -> OverfitRun:
    return overfit(base_dir)


def test_the_base_model_solves_the_four_prompts_only_sometimes(overfit_run) -> None:
    base = overfit_run.base_acc
    assert len({p.question for p in overfit_run.problems}) == 4
    assert all(p.num_ops == 1 for p in overfit_run.problems)
    # measured: 0.30 (per prompt 0.14-0.48); other warm-start seeds gave 0.11 and 0.42
    assert _mean(base) <= 0.7, base  # room to learn: the end point below is RL's doing
    assert min(base) > 0.0, base  # every prompt has signal to learn from


def test_rl_drives_the_four_prompts_to_near_perfect_accuracy(overfit_run) -> None:
    _assert_solved(overfit_run)


# DAPO's successors (issue 17): the same four prompts, the same settings, the successor's objective.
@pytest.mark.parametrize("recipe", ["tiny-gspo", "tiny-cispo", "tiny-gmpo", "tiny-drgrpo"])
def test_each_successor_objective_overfits_the_four_prompts(base_dir, overfit_run, recipe: str) -> None:
    run = overfit(base_dir, recipe)
    assert [p.question for p in run.problems] == [p.question for p in overfit_run.problems]  # the same four
    _assert_solved(run)


def _assert_solved(run: OverfitRun) -> None:
    step, acc = run.evals[-1]
    history = [(s, [round(a, 3) for a in accs]) for s, accs in run.evals]
    # measured: solved at step 15 (0.30 -> 0.80 -> 0.90 -> 0.96); from weaker bases (~0.1) by step 50-60
    assert solved(acc), (
        f"not solved (stopped at step {step}, bound {MAX_STEPS}): base {run.base_acc}, evals {history}, "
        f"rollout accuracy per step {[round(a, 2) for a in run.train_acc]}"
    )
