"""log_probs_from_logits: the values and gradient of log_softmax(...).gather, and what autograd keeps for backward.

The custom autograd node keeps only the logits (their own dtype) and a float32 logsumexp per row; the plain chunked
graph it replaced kept every float32 chunk (a float32 copy of the logits, 2x the bf16 logits).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from dapo_core.algorithm import entropy_from_logits, log_probs_from_logits


def _reference(logits: Tensor, labels: Tensor) -> Tensor:
    """The plain definition: (..., V), (...) -> (...) in float32 (float64 for float64 logits)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _old_chunked(logits: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
    """The implementation this replaced (chunk.float() -> gather - logsumexp, differentiated by autograd)."""
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)  # (M, V), (M,)
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].float()  # (c, V)
        picked = chunk.gather(-1, flat_labels[start : start + chunk_size].unsqueeze(-1)).squeeze(-1)  # (c,)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(labels.shape)


def _saved_bytes(fn) -> tuple[Tensor, int]:
    """Run ``fn()`` and sum the bytes of the storages autograd saves for backward (deduplicated by data_ptr)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 3),
    t=st.integers(1, 5),
    v=st.integers(2, 40),
    chunk=st.integers(1, 7),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    sliced=st.booleans(),
)
def test_values_and_gradient_equal_log_softmax_gather(seed, n, t, v, chunk, dtype, sliced):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, t + 1, v, generator=g) * 4).to(dtype)  # (n, T+1, V)
    labels = torch.randint(0, v, (n, t), generator=g)  # (n, T)
    upstream = torch.randn(n, t, generator=g)  # (n, T): a non-uniform incoming gradient

    def run(f):
        leaf = base.clone().requires_grad_(True)
        logits = leaf[:, :-1, :] if sliced else leaf[:, :t, :].contiguous()  # the trainer's non-contiguous view
        out = f(logits, labels)
        (out * upstream).sum().backward()
        return out, leaf.grad

    got, got_grad = run(lambda z, y: log_probs_from_logits(z, y, chunk_size=chunk))
    want, want_grad = run(_reference)
    assert got.dtype == torch.float32 and got.shape == (n, t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grad.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}
    torch.testing.assert_close(got_grad, want_grad, **tol)


def test_gradcheck_in_float64_through_several_chunks():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)  # (n, T+1, V)
    labels = torch.randint(0, 7, (3, 4), generator=g)
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z[:, :-1, :], labels, chunk_size=3), (base,))
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels[:, :1], chunk_size=2), (base[:, :1],))


@pytest.mark.parametrize("sliced", [False, True])
def test_backward_keeps_the_bf16_logits_and_a_logsumexp_not_a_float32_copy(sliced):
    n, t, v, chunk = 4, 32, 2048, 24  # M = 128 rows over 6 chunks
    leaf = torch.randn(n, t + 1, v).to(torch.bfloat16).requires_grad_(True)  # (n, T+1, V) bf16: the model output
    logits = leaf[:, :-1, :] if sliced else leaf[:, :t, :].contiguous()  # (n, T, V)
    labels = torch.randint(0, v, (n, t))
    rows = n * t
    logits_bytes = logits.untyped_storage().nbytes()  # the whole model output when sliced (alive anyway)

    new_out, new_bytes = _saved_bytes(lambda: log_probs_from_logits(logits, labels, chunk_size=chunk))
    old_out, old_bytes = _saved_bytes(lambda: _old_chunked(logits, labels, chunk))
    print(f"saved for backward: new {new_bytes} B, old {old_bytes} B, ratio {new_bytes / old_bytes:.3f}")
    torch.testing.assert_close(new_out, old_out)
    # new: the logits themselves (no copy, even of the non-contiguous view) + labels (int64) + logsumexp (fp32)
    assert new_bytes <= logits_bytes + rows * (8 + 4)
    # old: a float32 copy of every chunk = 2x the bf16 logits; new / old measured 0.500 (0.516 sliced: the view's
    # storage holds the extra last position, T+1 / T)
    assert old_bytes >= 2 * rows * v * 2
    assert new_bytes / old_bytes < 0.53


def test_empty_rows_and_no_grad_calls():
    logits = torch.randn(0, 3, 5, requires_grad=True)
    assert log_probs_from_logits(logits, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
    with torch.no_grad():  # compute_log_probs: nothing saved, same values
        z = torch.randn(2, 3, 5)
        y = torch.randint(0, 5, (2, 3))
        torch.testing.assert_close(log_probs_from_logits(z, y, chunk_size=2), _reference(z, y))


def test_entropy_of_a_non_contiguous_view_equals_that_of_its_copy():
    base = torch.randn(3, 6, 11) * 3  # (n, T+1, V)
    view = base[:, :-1, :]  # (n, T, V), not viewable as (n*T, V)
    for chunk in (1, 4, 100):
        torch.testing.assert_close(entropy_from_logits(view, chunk_size=chunk), entropy_from_logits(view.clone()))
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        log_probs_from_logits(view, torch.zeros(3, 5, dtype=torch.long), chunk_size=0)
