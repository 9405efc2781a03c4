"""The policy's architecture for planning: where it comes from and its exact parameter count.

Sources, first that applies (``resolve_arch``):

1. ``--model-config PATH`` (a ``config.json`` or a directory holding one);
2. ``model.path``'s local ``config.json`` (an HF directory: the base model stage's output, a checkpoint);
3. ``PUBLIC_CONFIGS``: the public ``config.json`` values of the hub ids the shipped recipes use (no download);
4. ``model.tiny`` when ``model.path`` is the tiny base model not built yet (vocabulary: the char tokenizer's);
5. otherwise ``ArchError`` naming ``model.path`` and ``--model-config``.

The parameter count is exact for Qwen2-shaped decoders (Qwen2 / Qwen2.5, and Llama-like ones without q/k/v
biases): it is checked against ``sum(p.numel())`` of a model built on the meta device in tests/test_plan.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


class ArchError(ValueError):
    """The architecture of model.path cannot be found without a download."""


@dataclass(frozen=True)
class Arch:
    """The shapes that memory depends on. ``source`` says where they came from (shown in the plan)."""

    hidden: int  # h
    layers: int  # L
    heads: int  # H (query heads)
    kv_heads: int  # KV heads (GQA)
    intermediate: int  # I (MLP width)
    vocab: int  # V
    tied: bool  # lm_head shares the embedding matrix
    head_dim: int  # d = h / H unless the config says otherwise
    qkv_bias: bool = True  # Qwen2: q/k/v projections have biases, o_proj none
    dtype: str = "bfloat16"  # the checkpoint's torch_dtype (what rollout.dtype=auto resolves to)
    source: str = ""

    @property
    def kv_dim(self) -> int:
        """Width of the k (and v) projection: KV heads x head_dim."""
        return self.kv_heads * self.head_dim


def _public(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> Arch:
    return Arch(h, layers, heads, kv, inter, vocab, tied, h // heads, source="built-in public config.json")


# The public config.json values (huggingface.co/<id>/blob/main/config.json) of the models the recipes name.
PUBLIC_CONFIGS: dict[str, Arch] = {
    "Qwen/Qwen2.5-32B": _public(5120, 64, 40, 8, 27648, 152064, tied=False),
    "Qwen/Qwen2.5-Math-1.5B": _public(1536, 28, 12, 2, 8960, 151936, tied=True),
    "Qwen/Qwen2.5-0.5B": _public(896, 24, 14, 2, 4864, 151936, tied=True),
}


def arch_from_hf_config(config: Any, source: str) -> Arch:
    """An ``Arch`` from a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    return Arch(
        hidden=int(config.hidden_size),
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=int(head_dim),
        qkv_bias=getattr(config, "model_type", "qwen2") == "qwen2" or bool(getattr(config, "attention_bias", False)),
        dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
        source=source,
    )


def _from_config_json(path: Path) -> Arch:
    from transformers import AutoConfig

    directory = path.parent if path.name == "config.json" else path
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    return arch_from_hf_config(config, f"{directory / 'config.json'}")


def _tiny_arch(cfg: DapoConfig) -> Arch:
    """``model.tiny`` with the character tokenizer's vocabulary (what the base_model stage builds)."""
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    t = cfg.model.tiny
    vocab = len(build_char_tokenizer(DEFAULT_ALPHABET))
    return Arch(
        hidden=t.hidden_size,
        layers=t.num_hidden_layers,
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        intermediate=t.intermediate_size,
        vocab=vocab,
        tied=t.tie_word_embeddings,
        head_dim=t.hidden_size // t.num_attention_heads,
        dtype="float32",
        source="model.tiny (the base model is not built yet)",
    )


def _is_unbuilt_tiny(cfg: DapoConfig, path: str) -> bool:
    from dapo_core.config.schema import ModelConfig

    default = ModelConfig.model_fields["path"].default
    return os.path.normpath(path) == os.path.normpath(default) or cfg.data.template == "tiny"


def resolve_arch(cfg: DapoConfig, model_config: str | os.PathLike | None = None) -> Arch:
    """The policy's architecture (see the module docstring for the order of the sources)."""
    if model_config is not None:
        return _from_config_json(Path(model_config))
    path = os.path.expanduser(cfg.model.path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _from_config_json(Path(path))
    if cfg.model.path in PUBLIC_CONFIGS:
        return PUBLIC_CONFIGS[cfg.model.path]
    if not os.path.exists(path) and _is_unbuilt_tiny(cfg, path):
        return _tiny_arch(cfg)
    raise ArchError(
        f"model.path ({cfg.model.path!r}) has no local config.json and is not one of the built-in public configs "
        f"({', '.join(PUBLIC_CONFIGS)}): pass --model-config PATH (its config.json), or download the model first"
    )


def layer_params(a: Arch) -> int:
    """Parameters of one decoder layer: attention (q/k/v with biases, o without), SwiGLU MLP, 2 RMSNorms."""
    q = a.hidden * a.heads * a.head_dim + (a.heads * a.head_dim if a.qkv_bias else 0)
    kv = 2 * (a.hidden * a.kv_dim + (a.kv_dim if a.qkv_bias else 0))
    o = a.heads * a.head_dim * a.hidden
    mlp = 3 * a.hidden * a.intermediate  # gate, up: h -> I; down: I -> h
    return q + kv + o + mlp + 2 * a.hidden


def embedding_params(a: Arch) -> int:
    """Input embeddings, plus the LM head unless tied (V x h each)."""
    return a.vocab * a.hidden * (1 if a.tied else 2)


def param_count(a: Arch) -> int:
    """Exact parameter count: embeddings (+ untied LM head) + L layers + the final RMSNorm."""
    return embedding_params(a) + a.layers * layer_params(a) + a.hidden


def param_tensor_count(a: Arch) -> int:
    """Number of parameter tensors (AdamW keeps one scalar ``step`` tensor per parameter tensor)."""
    per_layer = (3 if a.qkv_bias else 0) + 4 + 3 + 2  # q/k/v biases, q/k/v/o weights, MLP, norms
    return a.layers * per_layer + 1 + 1 + (0 if a.tied else 1)  # + embed, final norm, lm_head
