"""Token log-probabilities, entropy and probabilities from logits, chunked over rows.

A full-vocabulary float32 softmax of a (N*T, V) block with V ~ 152k (Qwen2.5) is 600 KB per token; chunking over
rows bounds the temporary memory to ``chunk_size * V`` floats. Shape legend: N responses, T tokens, V vocab,
M = N*T rows.

Memory kept for backward. ``log_probs_from_logits`` is one autograd node (``_TokenLogProbs``) that keeps only the
logits it was given (a view of the model's output, alive anyway, in their own dtype: bf16 under mixed precision)
and one float32 logsumexp per row; backward recomputes the softmax chunk by chunk. Differentiating the plain
``chunk.float()`` -> ``logsumexp`` graph instead keeps every float32 chunk until backward: a float32 copy of the
whole (micro x T x V) logits, twice the bf16 logits (~9.7 GB for 8 x 4k tokens at V = 152k).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_SIZE = 1024


def _row_blocks(x: Tensor, chunk_size: int) -> Iterator[tuple[int, Tensor]]:
    """(first flat row, block (c, V)) over the rows of ``x`` (..., V), in order; views of ``x``, never a copy.

    The trainer's logits are ``out.logits[:, :-1, :]``, which ``reshape(-1, V)`` would copy whole; such a tensor is
    walked one slice of its first dimension at a time instead."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 rows, got {chunk_size}")
    v = x.shape[-1]
    try:
        flat = x.view(-1, v)  # (M, V) when the strides allow a view
    except RuntimeError:
        flat = None
    if flat is not None:
        for start in range(0, flat.shape[0], chunk_size):
            yield start, flat[start : start + chunk_size]  # (c, V)
        return
    per_slice = math.prod(x.shape[1:-1])  # rows in one x[i]
    for i in range(x.shape[0]):
        for start, block in _row_blocks(x[i], chunk_size):
            yield i * per_slice + start, block


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16 / fp16 / fp32 logits; float64 stays float64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits)[label], saving for backward only the logits (own dtype) and the per-row logsumexp."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        compute = _compute_dtype(logits.dtype)
        flat_labels = labels.reshape(-1)  # (M,)
        out = torch.empty(flat_labels.shape[0], dtype=compute, device=logits.device)  # (M,)
        lse = torch.empty_like(out)  # (M,)
        for start, block in _row_blocks(logits, chunk_size):
            chunk = block.to(compute)  # (c, V): a temporary, freed with the next chunk
            stop = start + chunk.shape[0]
            lse[start:stop] = torch.logsumexp(chunk, dim=-1)  # (c,)
            picked = chunk.gather(-1, flat_labels[start:stop].unsqueeze(-1)).squeeze(-1)  # (c,)
            out[start:stop] = picked - lse[start:stop]
        ctx.save_for_backward(logits, flat_labels, lse)
        ctx.chunk_size = chunk_size
        return out.reshape(labels.shape)  # (...)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, flat_labels, lse = ctx.saved_tensors  # (..., V), (M,), (M,)
        g = grad_out.reshape(-1).to(lse.dtype)  # (M,)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (..., V), contiguous
        flat_grad = grad.view(-1, logits.shape[-1])  # (M, V)
        for start, block in _row_blocks(logits, ctx.chunk_size):
            stop = start + block.shape[0]
            g_rows = g[start:stop].unsqueeze(-1)  # (c, 1)
            # d/dz log softmax(z)[y] = onehot(y) - softmax(z), softmax recomputed from the saved logsumexp
            d = torch.exp(block.to(lse.dtype) - lse[start:stop].unsqueeze(-1)).mul_(-g_rows)  # (c, V)
            d.scatter_add_(-1, flat_labels[start:stop].unsqueeze(-1), g_rows)
            flat_grad[start:stop] = d  # cast to the logits dtype
        return grad, None, None


def log_probs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log softmax(logits)[label] for each position: (..., V), (...) -> (...) float32 (float64 for float64 logits).

    Differentiable; autograd keeps only ``logits`` and a float32 logsumexp per row (see the module docstring)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    if labels.numel() == 0:
        return torch.zeros(labels.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
    out: Tensor = _TokenLogProbs.apply(logits, labels, chunk_size)
    return out


def entropy_from_logits(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) z of each position's distribution: (..., V) -> (...) float32."""
    out = []
    for _start, block in _row_blocks(logits, chunk_size):  # views: no (M, V) copy of non-contiguous logits
        chunk = block.float()  # (c, V)
        probs = torch.softmax(chunk, dim=-1)  # (c, V)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))  # (c,)
    if not out:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(logits.shape[:-1])


def token_probs(log_probs: Tensor) -> Tensor:
    """Probability of each sampled token (the paper's "mean probability" curve averages this). (...) -> (...)"""
    return torch.exp(log_probs)
