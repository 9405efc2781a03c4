"""Token log-probabilities, entropy and probabilities from logits, chunked over rows.

A full-vocabulary float32 softmax of a (N*T, V) block with V ~ 152k (Qwen2.5) is 600 KB per token; chunking over
rows bounds the temporary memory to ``chunk_size * V`` floats. Shape legend: N responses, T tokens, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 1024


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])  # (N*T, V)


def log_probs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log softmax(logits)[label] for each position: (..., V), (...) -> (...) float32. Differentiable."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    flat_logits = _rows(logits)  # (M, V)
    flat_labels = labels.reshape(-1)  # (M,)
    out = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        chunk = flat_logits[start : start + chunk_size].float()  # (c, V)
        picked = chunk.gather(-1, flat_labels[start : start + chunk_size].unsqueeze(-1)).squeeze(-1)  # (c,)
        out.append(picked - torch.logsumexp(chunk, dim=-1))  # (c,)
    if not out:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(labels.shape)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) z of each position's distribution: (..., V) -> (...) float32."""
    flat = _rows(logits)  # (M, V)
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].float()  # (c, V)
        probs = torch.softmax(chunk, dim=-1)  # (c, V)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))  # (c,)
    if not out:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(logits.shape[:-1])


def token_probs(log_probs: Tensor) -> Tensor:
    """Probability of each sampled token (the paper's "mean probability" curve averages this). (...) -> (...)"""
    return torch.exp(log_probs)
