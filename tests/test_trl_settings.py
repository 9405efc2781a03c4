"""The TRL race compares like with like: both sides' settings, resolved, match key by key (a recipe default that
changes later fails here instead of skewing benchmarks/results/trl.json), and each side states its decode path."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.trl_settings import SIDES, our_overrides, trl_config_kwargs
from dapo_core.config import load_config
from dapo_core.config.schema import resolved_max_new_tokens

SETTINGS = {
    "model": "outputs/base_model", "train_file": "outputs/curated/train.parquet", "prompts_per_step": 32, "n": 8,
    "updates": 2, "max_new_tokens": 80, "temperature": 1.0, "lr": 1e-4, "grad_clip": 1.0, "clip_low": 0.2,
    "clip_high": 0.28, "steps": 16, "seed": 42, "threads": 2,
}  # fmt: skip


def _ours(side: str):
    extra = SIDES[side][2]
    assert extra is not None
    sets = our_overrides(SETTINGS, output_dir="out", tracking_uri="sqlite:///x.db", run_name="r")
    return load_config(recipe="tiny-dapo", overrides=[*sets, *extra], env={})


@pytest.mark.parametrize("side", ["ours-generate", "ours-static"])
def test_our_side_and_trl_match_key_by_key(side):
    cfg, trl = _ours(side), trl_config_kwargs(SETTINGS, Path("out"))
    completions = cfg.data.train_batch_size * cfg.rollout.n
    pairs = {
        "completions per generation batch": (cfg.data.gen_batch_size * cfg.rollout.n,
                                             trl["per_device_train_batch_size"] * trl["steps_per_generation"]),
        "group size G": (cfg.rollout.n, trl["num_generations"]),
        "optimizer steps per generation batch": (
            cfg.trainer.ppo_epochs * cfg.data.train_batch_size // cfg.trainer.ppo_mini_batch_size,
            trl["steps_per_generation"] * trl["num_iterations"]),
        "completions per optimizer step": (completions // 2, trl["per_device_train_batch_size"]),
        "max new tokens": (resolved_max_new_tokens(cfg), trl["max_completion_length"]),
        "temperature": (cfg.rollout.temperature, trl["temperature"]),
        "top_p": (cfg.rollout.top_p, trl["top_p"]),
        "top_k off": (cfg.rollout.top_k == -1, trl["top_k"] == 0),
        "clip low": (cfg.algorithm.clip_low, trl["epsilon"]),
        "clip high": (cfg.algorithm.clip_high, trl["epsilon_high"]),
        "token-level loss": (cfg.algorithm.loss_agg == "token-mean", trl["loss_type"] == "dapo"),
        "no KL": (cfg.algorithm.kl_coef, trl["beta"]),
        "group-std advantages": (cfg.algorithm.norm_adv_by_std, trl["scale_rewards"] == "group"),
        "lr": (cfg.trainer.lr, trl["learning_rate"]),
        "constant lr": (cfg.trainer.lr_scheduler, trl["lr_scheduler_type"]),
        "warm-up": (cfg.trainer.lr_warmup_steps, trl["warmup_steps"]),
        "weight decay": (cfg.trainer.weight_decay, trl["weight_decay"]),
        "grad clip": (cfg.trainer.grad_clip, trl["max_grad_norm"]),
        "float32": (cfg.model.dtype == "float32", not trl["bf16"] and not trl["fp16"]),
        "no gradient checkpointing": (cfg.model.gradient_checkpointing, trl["gradient_checkpointing"]),
        "RL steps": (cfg.trainer.total_steps * 2, trl["max_steps"]),
        "seed": (cfg.trainer.seed, trl["seed"]),
        "no dynamic sampling (TRL has none)": (cfg.algorithm.dynamic_sampling.enable, False),
        "no overlong shaping (TRL has none)": (cfg.algorithm.overlong.shaping, False),
        "no entropy bonus": (cfg.algorithm.entropy_coef, 0.0),
    }  # fmt: skip
    mismatched = {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert not mismatched, mismatched


def test_the_two_of_our_sides_differ_only_in_the_decode_path():
    generate, static = _ours("ours-generate"), _ours("ours-static")
    assert (generate.rollout.hf_decode, static.rollout.hf_decode) == ("generate", "static")
    a, b = generate.model_dump(), static.model_dump()
    a["rollout"].pop("hf_decode"), b["rollout"].pop("hf_decode")
    assert a == b
    assert static.rollout.hf_procs == 1  # as shipped: the recipe's default, one process
    assert {side: SIDES[side][1] for side in SIDES}["ours-generate"] == SIDES["trl"][1]  # stated decode paths
