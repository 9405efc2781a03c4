"""How the ``vllm`` backend sets its engine up: engine arguments from the config (and for vLLM's CPU build), request
seeds, EOS ids, the checkpoint's tensor names and tied embeddings, and which tensors a weight sync ships at what
size. Imports nothing from vLLM; the facts about vLLM these rely on are in ``dapo_core.engines.rollout.vllm``'s
docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dapo_core.engines.rollout.vllm_transfer import transfer_engine_kwargs
from dapo_core.engines.rollout.vllm_worker import WORKER_EXTENSION_CLS
from dapo_core.seeding import derive_seed

if TYPE_CHECKING:
    from dapo_core.config import DapoConfig
    from dapo_core.engines.rollout.base import SamplingConfig

logger = logging.getLogger(__name__)

CPU_MIN_BATCHED_TOKENS = 2048  # a whole generation batch's prefill in one scheduler step on the CPU build
# rollout.dtype -> the dtype weights are cast to before shipping (halves a bf16 engine's sync from fp32 masters)
ENGINE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
LM_HEAD = "lm_head.weight"  # HF name of the output projection; vLLM ties it to embed_tokens when configured


def shipped_nbytes(tensor: Tensor, dtype: torch.dtype | None) -> int:
    """Bytes ``tensor`` takes on the wire once floats are cast to ``dtype`` (None: as it is)."""
    itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize


def names_to_ship(
    state_dict: Mapping[str, Tensor], *, tie_word_embeddings: bool | None, expected: set[str] | None
) -> list[str]:
    """The names a full sync ships, in order (``lm_head.weight`` included when tied: vLLM's reload leaves the head
    stale without it); refuses a state dict that lacks an untied head or any checkpoint tensor (``expected``)."""
    names = list(state_dict)
    if tie_word_embeddings is False and LM_HEAD not in state_dict:
        raise ValueError(
            f"state_dict has no {LM_HEAD!r} but the model's embeddings are not tied (tie_word_embeddings "
            "false): pass the trainer's full model.state_dict()"
        )
    if not names:
        raise ValueError("state_dict is empty: pass the trainer's model.state_dict()")
    missing = sorted((expected or set()) - set(names))
    if missing:
        raise ValueError(
            f"the weight sync would leave {len(missing)} checkpoint tensor(s) unwritten, e.g. {missing[:5]}: "
            "pass the trainer's full model.state_dict() (HF names) of the same architecture"
        )
    return names


def cpu_engine_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments adjusted for vLLM's CPU build (module doc): no chunked prefill, a token budget that
    holds any single prefill, no sleep mode."""
    out = dict(kwargs)
    max_len = int(out.get("max_model_len") or 0)
    out["enable_chunked_prefill"] = False
    out["max_num_batched_tokens"] = max(int(out.get("max_num_batched_tokens") or 0), max_len, CPU_MIN_BATCHED_TOKENS)
    out["enable_sleep_mode"] = False
    return out


def engine_platform(vllm_module: Any, *, cuda_here: bool) -> tuple[str, bool]:
    """(device type of vLLM's platform, whether it supports sleep mode): ``("cuda", True)`` on NVIDIA GPUs,
    ``("cpu", False)`` on the CPU build; a build without ``vllm.platforms`` counts as CUDA when ``cuda_here``."""
    import importlib

    try:
        platform = importlib.import_module(f"{vllm_module.__name__}.platforms").current_platform
    except (ImportError, AttributeError):
        return ("cuda", True) if cuda_here else ("unknown", False)
    device = str(getattr(platform, "device_type", "unknown") or "unknown")
    sleep = getattr(platform, "is_sleep_mode_available", None)
    return device, bool(sleep()) if callable(sleep) else device == "cuda"


def sampling_kwargs(sampling: SamplingConfig, seed: int, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt (request seed ``seed``)."""
    kwargs: dict[str, Any] = {
        # vLLM refuses n > 1 with greedy decoding: one sample, copied n times (to_results)
        "n": 1 if sampling.temperature == 0 else sampling.n,
        "temperature": sampling.temperature,  # 0 -> greedy
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # 0 = off in vLLM (our -1 / 0)
        "max_tokens": sampling.max_new_tokens,
        "seed": seed,
        "logprobs": 0 if sampling.return_log_probs else None,  # 0: the sampled token's log-prob only
        "skip_special_tokens": True,
    }
    if eos_token_ids:
        kwargs["stop_token_ids"] = list(eos_token_ids)
    return kwargs


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
        **transfer_engine_kwargs(r.weight_sync),  # cuda_ipc / nccl: vLLM's weight_transfer_config
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
