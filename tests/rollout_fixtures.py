"""Shared pieces of the hf rollout tests: a tiny model shape, mixed prompts and an EOS-prone model."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from dapo_core.engines.models import build_tiny_qwen2

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY["intermediate_size"] = 64
# mixed lengths (left padding) and a repeated prompt
TEXTS = ["Q: 1+2", "Q: 71-57*6", "Q: 3", "Solve: (12+30)/7 = ?", "Q: 9*9-1", "Q: 5-5", "Q: 3"]


def eos_prone_model(tok: PreTrainedTokenizerBase, seed: int = 0) -> Qwen2ForCausalLM:
    """A random tiny model (untied head) whose EOS logit is raised, so rows stop at many different steps (and some
    never)."""
    model = build_tiny_qwen2(tok, seed=seed, tie_word_embeddings=False, **TINY)
    head = torch.nn.Linear(TINY["hidden_size"], len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 20)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 2.5
    model.lm_head = head
    return model
