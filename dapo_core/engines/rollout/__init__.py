"""Rollout backends: ``hf`` (transformers, CPU default) and, lazily, ``vllm`` (GPU; ``rollout/vllm.py``).

backend_cls = get_rollout_backend_cls(cfg.rollout.backend)
backend = backend_cls.from_config(
    cfg, model=model if backend_cls.shares_policy_model else None, tokenizer=tokenizer, model_path=path
)
results = backend.generate(prompt_ids, SamplingConfig.from_config(cfg.rollout, max_new_tokens=64, seed=step))
"""

from dapo_core.engines.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBackend,
    RolloutResult,
    SamplingConfig,
    available_rollout_backends,
    get_rollout_backend_cls,
    register_rollout_backend,
)
from dapo_core.engines.rollout.hf import HFRolloutBackend, row_seed

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "HFRolloutBackend",
    "RolloutBackend",
    "RolloutResult",
    "SamplingConfig",
    "available_rollout_backends",
    "get_rollout_backend_cls",
    "register_rollout_backend",
    "row_seed",
]
