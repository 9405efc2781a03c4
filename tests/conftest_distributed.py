"""Helpers shared by the Ray tests: a tiny config and one DAPO step through any executor, compared field by field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from dapo_core.algorithm import group_advantages, overlong_penalty
from dapo_core.config import load_config
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.executor import Executor, LocalExecutor, sampling_from
from dapo_core.seeding import derive_seed

PROBLEMS = [("Q: 1+2\n", "3"), ("Q: 7*3\n", "21"), ("Q: 9-4\n", "5"), ("Q: 2*2\n", "4"), ("Q: 8+8\n", "16")]


def tiny_cfg(model_dir: Any, **extra: Any) -> Any:
    """5 prompts x 4 samples, 12 tokens, mini-batches of 2 groups (3 updates, the last one partial), lr 1e-4."""
    sets = [
        f"model.path={model_dir}",
        "rollout.n=4",
        "data.max_response_length=12",
        "algorithm.overlong.buffer_length=8",
        "data.train_batch_size=4",
        "data.gen_batch_size=5",
        "trainer.ppo_mini_batch_size=2",
        "trainer.micro_batch_size=6",
        "trainer.lr=1e-4",
        "resources.executor=ray",
        "resources.num_cpus=2",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(recipe="tiny-dapo", overrides=sets, env={})


@dataclass
class StepRecord:
    responses: list[list[int]]
    scores: list[dict]
    num_failed: int
    old_log_probs: torch.Tensor
    metrics: dict[str, float]
    version: int


def dapo_step(ex: Executor, step: int) -> StepRecord:
    """Algorithm 1 on a tiny random policy: generate -> score -> shaped reward -> advantages -> old log-probs ->
    update -> sync. A dense term (digit fraction) is added to the rule reward so that a random policy's groups
    vary and the update is not zero."""
    cfg, tok = ex.cfg, ex.tokenizer
    prompts = [tok.encode(q) for q, _ in PROBLEMS]
    results = ex.generate(prompts, sampling_from(cfg, seed=derive_seed(cfg.trainer.seed, step, 0)))
    scored = ex.score([r.text for r in results], [PROBLEMS[r.prompt_index][1] for r in results])
    ov = cfg.algorithm.overlong
    lengths = torch.tensor([r.response_length for r in results])
    rewards = torch.tensor([s["score"] for s in scored.results]) + overlong_penalty(  # DAPO eq. 13
        lengths, max_response_length=cfg.data.max_response_length, buffer_length=ov.buffer_length
    )
    rewards += torch.tensor([sum(c.isdigit() for c in r.text) / max(1, len(r.text)) for r in results])
    gids = [r.prompt_index for r in results]
    batch = build_policy_batch(
        [r.prompt_ids for r in results],
        [r.response_ids for r in results],
        pad_token_id=tok.pad_token_id,
        group_ids=gids,
        truncated=[r.truncated for r in results],
        advantages=group_advantages(rewards, gids),
    )
    batch.old_log_probs, _ = ex.compute_log_probs(batch)
    metrics = ex.update(batch)
    version = ex.sync_weights()
    return StepRecord(
        [r.response_ids for r in results], scored.results, scored.num_failed, batch.old_log_probs, metrics, version
    )


def assert_same_step(a: StepRecord, b: StepRecord) -> None:
    assert a.responses == b.responses  # same samples: per-(seed, prompt, sample) seeding survives the split
    assert a.scores == b.scores and a.num_failed == b.num_failed
    torch.testing.assert_close(a.old_log_probs, b.old_log_probs, atol=1e-5, rtol=0)
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        assert abs(a.metrics[key] - b.metrics[key]) <= 1e-5 * max(1.0, abs(a.metrics[key])), key
    assert a.version == b.version


def ray_weights(ex: Any) -> dict[str, torch.Tensor]:
    """Trainer rank 0's weights (what the rollout workers are synced to)."""
    return ray.get(ex.trainers.state_ref())


def max_weight_diff(local: LocalExecutor, weights: dict[str, torch.Tensor]) -> float:
    own = local.model.state_dict()
    assert own.keys() == weights.keys()
    return max(float((own[k] - weights[k]).abs().max()) for k in own)
