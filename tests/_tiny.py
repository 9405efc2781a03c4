"""Small builders shared by engine tests (no dependency on the project's own model code)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_core.engines.batch import PolicyBatch, build_policy_batch
from dapo_core.engines.loss import LossConfig
from dapo_core.engines.optim import OptimConfig
from dapo_core.engines.rollout.base import SamplingConfig

VOCAB = 24
PAD = 0
MAX_RESPONSE = 64  # L_max of the loss built by ``loss_config`` (Dr. GRPO's constant)


def optim_config(lr: float, **kw: Any) -> OptimConfig:
    """An engine test's optimizer: AdamW at a constant ``lr`` without warm-up, weight decay 0.1, grad clip 1.0 and
    AdamW's own betas; ``kw`` replaces any of them."""
    fields: dict[str, Any] = dict(weight_decay=0.1, grad_clip=1.0, warmup_steps=0, scheduler="constant", total_steps=1,
                                  min_lr_ratio=0.0, betas=None)  # fmt: skip
    return OptimConfig(lr=lr, **{**fields, **kw})


def plain_sampling(**kw: Any) -> SamplingConfig:
    """An engine test's sampling: one response per prompt from the whole distribution (temperature 1, no top-p or
    top-k), at most 32 new tokens, seed 0; ``kw`` replaces any of them."""
    return SamplingConfig(**{"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32, **kw})


def loss_config(**algorithm: Any) -> LossConfig:
    """The policy loss of an ``algorithm:`` section with these keys and the schema's defaults for the rest (DAPO's
    ppo-clip at 0.2 / 0.28, token-mean), except the dual clip: off unless ``clip_c`` is given."""
    from dapo_core.config import AlgorithmConfig

    section = AlgorithmConfig(**{"clip_c": None, **algorithm})
    return LossConfig.from_config(section, max_response_length=MAX_RESPONSE)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg._attn_implementation = "eager"
    return Qwen2ForCausalLM(cfg).to(dtype)


def random_batch(seed: int, groups: int = 4, g: int = 3) -> PolicyBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, gids = [], [], []
    for k in range(groups):
        plen = int(torch.randint(2, 6, (1,), generator=gen))
        prompt = torch.randint(3, VOCAB, (plen,), generator=gen).tolist()
        for _ in range(g):
            rlen = int(torch.randint(1, 8, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, VOCAB, (rlen,), generator=gen).tolist())
            gids.append(k)
    batch = build_policy_batch(prompts, responses, pad_token_id=PAD, group_ids=gids)
    batch.advantages = torch.randn(len(prompts), generator=gen, dtype=torch.float64).float()
    return batch


def tiny_model_dir(path, seed: int = 0):
    """An HF directory with the project's char tokenizer and a very small Qwen2 (fast tests)."""
    from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(
        tok,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        seed=seed,
    )
    return save_hf_dir(model, tok, path)
