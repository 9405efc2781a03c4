"""Models: build the tiny Qwen2 of the CPU default, save/load ordinary HF directories, resolve devices.

The tiny model is a real ``Qwen2ForCausalLM`` (the architecture of the paper's Qwen2.5-32B base), only small:
hidden 128, 4 layers, 4 query / 2 key-value heads, intermediate 512, tied embeddings -> ~1M parameters with the
~80-token character vocabulary. Because it is an ordinary HF directory, the same loading code (and vLLM on a
GPU) serves the tiny model and the 32B one.

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, seed=0)
    save_hf_dir(model, tok, "outputs/base_model")
    model = load_model("outputs/base_model", dtype="float32")
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

logger = logging.getLogger(__name__)

# Valid `dtype` names for load_model; "auto" keeps the dtype stored in the checkpoint's config.
DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}

_TRUTHY = {"1", "on", "yes", "true"}


class ModelNotFoundError(FileNotFoundError):
    """The model named by a path or hub id is not available (missing local directory, or offline and not cached)."""


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised ``Qwen2ForCausalLM`` sized for CPU RL (~1M parameters with the char vocabulary).

    The vocabulary size and the pad/bos/eos ids come from ``tokenizer`` and are written into both the model
    config and its generation config. Same arguments and ``seed`` -> identical weights (the global torch RNG is
    left untouched).
    """
    if hidden_size % num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads}): "
            "pick e.g. hidden_size=128 with 4 heads"
        )
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be divisible by num_key_value_heads "
            f"({num_key_value_heads}) for grouped-query attention: pick e.g. 4 heads with 2 key-value heads"
        )
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer has no EOS token: generation could never stop; set tokenizer.eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    # Qwen2 base models use <|endoftext|> as both bos and eos; the tiny model follows.
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        use_sliding_window=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny Qwen2: %d parameters, vocab %d, seed %d", n_params, config.vocab_size, seed)
    return model


def save_hf_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | os.PathLike) -> Path:
    """Write ``model`` (safetensors) and ``tokenizer`` as an ordinary HF directory at ``path``, atomically.

    Everything is written to a temporary sibling directory first and renamed into place, so a reader never sees
    a half-written model. An existing ``path`` is replaced (moved aside, then deleted after the rename).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates 0700; the final directory should look like any other
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved model to %s", target)
    return target


def offline_mode() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set (read now, not at import time)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUTHY for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (a hub id is "name" or "org/name", never ./, / or ~)."""
    if os.path.exists(path):
        return True
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path


def _not_found(path: str, reason: str) -> ModelNotFoundError:
    offline = offline_mode()
    mode = "on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE set)" if offline else "off"
    return ModelNotFoundError(
        f"model {path!r} not found: {reason}. Offline mode is {mode}. Fix: download it first "
        f"(`hf download {path}` while online), or set model.path to a local HF directory, "
        "or run the base_model stage (`dvc repro base_model`) that writes outputs/base_model/."
    )


def _resolve_dtype(dtype: str) -> torch.dtype | str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid names: {sorted(DTYPES)}") from None


def load_model(
    path: str,
    *,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM from a local HF directory or a hub id, in eval mode on ``device``.

    ``dtype`` is one of ``DTYPES``. With ``HF_HUB_OFFLINE`` set only the local cache is used. A missing local
    directory, or a hub id that is neither reachable nor cached, raises ``ModelNotFoundError`` naming the model,
    the offline state and the fix.
    """
    torch_dtype = _resolve_dtype(dtype)
    target_device = resolve_device(device) if isinstance(device, str) else device
    path = os.path.expanduser(path)
    if _looks_local(path) and not os.path.isdir(path):
        raise _not_found(path, "no such local directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise _not_found(path, "the directory has no config.json (not an HF model directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            revision=revision,
            trust_remote_code=trust_remote_code,
            local_files_only=offline_mode(),
        )
    except ModelNotFoundError:
        raise
    except (OSError, HFValidationError) as e:  # unknown repo / uncached offline lookup / malformed id
        first_line = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
        raise _not_found(path, f"{type(e).__name__}: {first_line}") from e
    model.to(target_device)  # type: ignore[arg-type]  # transformers types .to loosely
    model.eval()
    logger.info("loaded model %s (%s) on %s", path, dtype, target_device)
    return model


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; otherwise the named device, checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here: use 'auto' or 'cpu'")
    return device
