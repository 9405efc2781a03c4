"""The settings both sides of the TRL race share, and how each side is configured from them.

``our_overrides`` turns the shared settings into ``--set`` overrides of the ``tiny-dapo`` recipe; ``trl_config_kwargs``
turns them into ``trl.GRPOConfig`` keyword arguments. ``tests/test_trl_settings.py`` resolves both and compares them
key by key (batch, group size, updates per batch, lengths, sampling, clip, loss, optimizer, dtype, threads), so a
recipe default that changes later cannot skew the race silently. Stdlib only: TRL lives in its own virtualenv.

Sides of the race (``SIDES``): TRL's GRPOTrainer (transformers' ``generate``), ours with the same decode path
(``rollout.hf_decode=generate``: the framework against the framework), and ours as shipped (the recipe's default
decode path, the static-KV-cache loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# side -> (label, decode path, extra overrides of our side; None for TRL)
SIDES: dict[str, tuple[str, str, list[str] | None]] = {
    "trl": ("TRL GRPOTrainer", "transformers generate", None),
    "ours-generate": ("dapo-flow, generate", "transformers generate", ["rollout.hf_decode=generate"]),
    "ours-static": ("dapo-flow as shipped", "static-KV-cache loop (recipe default)", []),
}

# What differs on purpose, and why it cannot favour either side's time per step by much.
KNOWN_DIFFERENCES = {
    "dual clip": "ours keeps the recipe's dual-clip c = 10 for negative advantages (TRL has none); it changes a "
    "clamp bound, not the work done",
    "optimizer": "TRL uses its fused AdamW, ours torch's AdamW",
    "generation": "the decode path of each side is stated in the results",
}


def our_overrides(s: dict[str, Any], *, output_dir: str, tracking_uri: str, run_name: str) -> list[str]:
    """``tiny-dapo`` overrides for the shared settings ``s`` (dynamic sampling and overlong shaping off: TRL has
    neither; token-level loss, no KL, constant lr without warm-up)."""
    return [
        f"model.path={s['model']}", f"data.train_files=[{s['train_file']}]",
        f"data.gen_batch_size={s['prompts_per_step']}", f"data.train_batch_size={s['prompts_per_step']}",
        f"rollout.n={s['n']}", f"trainer.ppo_mini_batch_size={s['prompts_per_step'] // s['updates']}",
        "trainer.ppo_epochs=1", f"rollout.max_new_tokens={s['max_new_tokens']}",
        f"rollout.temperature={s['temperature']}", "rollout.top_p=1.0", "rollout.top_k=-1",
        "algorithm.dynamic_sampling.enable=false", "algorithm.overlong.shaping=false",
        "algorithm.overlong.filtering=false", f"algorithm.clip_low={s['clip_low']}",
        f"algorithm.clip_high={s['clip_high']}", "algorithm.loss_agg=token-mean", "algorithm.kl_coef=0.0",
        "algorithm.entropy_coef=0.0", "algorithm.norm_adv_by_std=true", "model.dtype=float32",
        "model.gradient_checkpointing=false", f"trainer.lr={s['lr']}", "trainer.lr_warmup_steps=0",
        "trainer.lr_scheduler=constant", "trainer.weight_decay=0.0", f"trainer.grad_clip={s['grad_clip']}",
        f"trainer.total_steps={s['steps']}", f"trainer.seed={s['seed']}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", f"trainer.output_dir={output_dir}",
        f"tracking.uri={tracking_uri}", f"tracking.run_name={run_name}",
    ]  # fmt: skip


def trl_config_kwargs(s: dict[str, Any], out: Path) -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments for the shared settings ``s`` (TRL 1.16)."""
    completions = s["prompts_per_step"] * s["n"]
    return {
        "output_dir": str(out / "trainer"),
        "loss_type": "dapo",  # token-level: every token of the batch weighs the same (DAPO Eq. 12)
        "epsilon": s["clip_low"],
        "epsilon_high": s["clip_high"],
        "beta": 0.0,
        "num_generations": s["n"],
        "per_device_train_batch_size": completions // s["updates"],  # completions per optimizer step
        "gradient_accumulation_steps": 1,
        "steps_per_generation": s["updates"],  # one generation batch of `completions`, `updates` optimizer steps
        "num_iterations": 1,  # each generation batch is trained on once (our ppo_epochs=1)
        "max_completion_length": s["max_new_tokens"],
        "temperature": s["temperature"],
        "top_p": 1.0,
        "top_k": 0,
        "use_vllm": False,
        "learning_rate": s["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": s["grad_clip"],
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "mask_truncated_completions": False,
        "scale_rewards": "group",  # (r - mean) / std within each group, as our norm_adv_by_std
        "max_steps": s["steps"] * s["updates"],
        "save_strategy": "no",
        "logging_steps": s["updates"],
        "report_to": [],
        "seed": s["seed"],
        "disable_tqdm": True,
    }
