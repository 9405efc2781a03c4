"""How the ``vllm`` backend sets its engine up: engine arguments from the config (and for vLLM's CPU build), request
seeds, EOS ids, the checkpoint's tensor names and tied embeddings. Imports nothing from vLLM; the facts about vLLM
these rely on are in ``dapo_core.engines.rollout.vllm``'s docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dapo_core.engines.rollout.vllm_worker import WORKER_EXTENSION_CLS
from dapo_core.seeding import derive_seed

if TYPE_CHECKING:
    from dapo_core.config import DapoConfig

logger = logging.getLogger(__name__)

CPU_MIN_BATCHED_TOKENS = 2048  # a whole generation batch's prefill in one scheduler step on the CPU build


def cpu_engine_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments adjusted for vLLM's CPU build (module doc): no chunked prefill, a token budget that
    holds any single prefill, no sleep mode."""
    out = dict(kwargs)
    max_len = int(out.get("max_model_len") or 0)
    out["enable_chunked_prefill"] = False
    out["max_num_batched_tokens"] = max(int(out.get("max_num_batched_tokens") or 0), max_len, CPU_MIN_BATCHED_TOKENS)
    out["enable_sleep_mode"] = False
    return out


def prompt_seed(seed: int, prompt_index: int) -> int:
    """vLLM request seed of prompt ``prompt_index`` (62 bits: vLLM seeds sample j with ``seed + j``)."""
    return derive_seed(seed, "vllm-prompt", prompt_index) >> 1


def engine_kwargs_from(cfg: DapoConfig, model_path: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this run (rollout section + model identity + trainer seed)."""
    from dapo_core.config.schema import resolved_max_new_tokens

    r = cfg.rollout
    # the longest sequence a rollout can produce: prompt cap + response cap
    max_model_len = r.max_model_len or cfg.data.max_prompt_length + resolved_max_new_tokens(cfg)
    return {
        "model": model_path,
        "tokenizer": cfg.model.tokenizer_path or model_path,
        "revision": cfg.model.revision,
        "tokenizer_revision": cfg.model.revision,  # as load_tokenizer: one revision for model and tokenizer
        "trust_remote_code": cfg.model.trust_remote_code,
        "dtype": r.dtype,
        "tensor_parallel_size": r.tensor_parallel_size,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "enable_chunked_prefill": r.enable_chunked_prefill,
        "max_num_batched_tokens": r.max_num_batched_tokens,
        "max_model_len": max_model_len,
        "enable_prefix_caching": r.enable_prefix_caching,
        "enforce_eager": r.enforce_eager,
        "enable_sleep_mode": r.free_cache_engine,
        "seed": cfg.trainer.seed,
        "logprobs_mode": "raw_logprobs",  # pre-temperature, pre-top-p: the trainer's old_log_probs
        "worker_extension_cls": WORKER_EXTENSION_CLS,
    }


def eos_token_ids_for(tokenizer: Any, model_path: str, *, revision: str | None = None) -> list[int]:
    """EOS ids the ``hf`` backend stops on: the checkpoint's generation-config EOS, then the tokenizer's."""
    ids: list[int] = []
    values: list[Any] = []
    try:
        from transformers import GenerationConfig

        values.append(GenerationConfig.from_pretrained(model_path, revision=revision or "main").eos_token_id)
    except (OSError, ValueError) as exc:  # no generation_config.json: the tokenizer's EOS alone
        logger.debug("no generation config at %s (%s): EOS from the tokenizer only", model_path, exc)
    values.append(getattr(tokenizer, "eos_token_id", None))
    for value in values:
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def checkpoint_weight_names(model_path: str) -> set[str] | None:
    """HF names of the tensors in a local checkpoint (safetensors index or single file); None when unknown (a hub
    id, other formats). A weight sync must write every one of them: vLLM's in-place reload reports no names."""
    from pathlib import Path

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            import json

            return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        single = root / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return set(f.keys())
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("could not read the checkpoint's tensor names at %s (%s): syncs are not checked", root, exc)
    return None


def tied_embeddings(model_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> bool | None:
    """The checkpoint's ``tie_word_embeddings`` (None when the config cannot be read)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        logger.warning("could not read the model config at %s (%s): lm_head is shipped as given", model_path, exc)
        return None
    tied = getattr(config, "tie_word_embeddings", None)
    return bool(tied) if tied is not None else None
