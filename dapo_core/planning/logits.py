"""Logits memory of one micro-batch, as ``dapo_core.algorithm.entropy.log_probs_from_logits`` works today.

The trainer asks the model for the LM head on the response positions only (``logits_to_keep = T + 1``), so the
LM-head output is (n, T+1, V) in the compute dtype (e bytes): it stays referenced by the trainer until after
backward (entropy is computed from it afterwards). ``log_probs_from_logits`` is one autograd node that saves for
backward only that tensor (a view of it: no copy), the labels (int64) and one float32 logsumexp per row; backward
recomputes the softmax chunk by chunk (``DEFAULT_CHUNK_SIZE`` rows).

Exact for what is saved (tests measure it); the backward transient is an estimate: the node's gradient
(n, T, V) in e bytes, the slice's zero-padded gradient (n, T+1, V) in e bytes and two float32 chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK_ROWS = 1024  # dapo_core.algorithm.entropy.DEFAULT_CHUNK_SIZE


@dataclass(frozen=True)
class LogitsBytes:
    live: int  # the LM-head output (n, T+1, V) x e, alive from forward to after backward
    saved: int  # saved for backward beyond ``live``: labels (int64) + logsumexp (float32) per row
    grad: int  # transient gradient buffers during backward (estimate)


def logits_memory(*, micro: int, response_len: int, vocab: int, e: int) -> LogitsBytes:
    """Logits bytes for ``micro`` rows of ``response_len`` response tokens over ``vocab`` in ``e``-byte floats."""
    rows = micro * response_len  # M = n x T
    live = micro * (response_len + 1) * vocab * e  # (n, T+1, V)
    saved = rows * (8 + 4)  # labels int64 (M,), logsumexp float32 (M,); the logits themselves are ``live``
    grad = rows * vocab * e + live + 2 * min(rows, CHUNK_ROWS) * vocab * 4
    return LogitsBytes(live=live, saved=saved, grad=grad)
