"""Evaluation metrics: avg@k, unbiased pass@k, maj@k, reflection rate, response-length stats. Pure Python.

The paper reports AIME 2024 as avg@32 (Sec. 4.1: "we repeat the evaluation set 32 times and report avg@32"): the
mean correctness of k samples per problem, then the mean over problems. The other two are computed from the same
n samples of a problem, for any k <= n, without drawing new ones:

- **pass@k**, the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, Eq. 1): with c of n samples correct,
  ``pass@k = 1 - C(n-c, k) / C(n, k)``, the chance that a random k-subset holds a correct sample.
- **maj@k**, the same idea for majority voting: the chance that the majority answer of a random k-subset is a
  correct one, computed exactly by counting subsets (no bootstrap, no randomness); maj@n is the plain majority
  vote over all n samples.

Both are computed in exact integer arithmetic (``math.comb`` / ``fractions.Fraction``) and rounded once to a
float, so neither overflows nor cancels for any n (the float product form ``prod(1 - k / i)`` is the usual
alternative; it loses digits when pass@k is close to 1).

Majority vote rules (deterministic, documented once here):

- Only valid answers vote: a response whose ``pred`` is empty, ``[INVALID]`` (no "Answer:" line) or ``[ERROR]``
  (the reward function raised) abstains. With no valid answer there is no winner, which counts as wrong.
- Ties are broken in favour of the answer that appears first in the sample order (its lowest sample index among
  all n samples), as ``collections.Counter.most_common`` does. Samples are i.i.d., so this equals a uniformly
  random tie-break in expectation, yet the same samples always give the same result.
- An answer is correct when any response giving it was scored correct (with the DAPO rule all of them are, since
  correctness depends only on the normalised answer).

    pass_at_k(32, 4, 8)                                   # 0.7045...
    maj_at_k(["7", "5", "7", "[INVALID]"], [True, False, True, False], 4)   # 1.0
    reflection_rate(["Wait, let me check.", "Answer: 3"])  # 0.5
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction

from dapo_core.rewards.math_dapo import INVALID_PRED
from dapo_core.rewards.registry import ERROR_PRED

ABSTAIN_PREDS: frozenset[str] = frozenset({"", INVALID_PRED, ERROR_PRED})
"""Predicted answers that do not vote in maj@k (no extractable answer, or the reward function failed)."""

DEFAULT_PASS_KS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""k values reported for pass@k and maj@k (those <= n, plus n itself)."""

DEFAULT_REFLECTION_PHRASES: tuple[str, ...] = (
    "wait",
    "let me check",
    "let me verify",
    "let me re-check",
    "let me recheck",
    "double-check",
    "double check",
    "re-examine",
    "reexamine",
    "re-evaluate",
    "reconsider",
    "verify",
    "verifying",
    "check again",
    "on second thought",
)
"""Reflective moves (the DAPO paper, Sec. 4.3, notes such behaviour emerging during RL); matched as whole words,
case-insensitively."""


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1 samples per problem: sample at least one response (paper: 32)")


def _check_k(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k ({k}) must be in [1, n] with n = {n} samples: pick k <= n or sample more responses")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)`` (exact, then rounded)."""
    _check_n(n)
    if not 0 <= c <= n:
        raise ValueError(f"c ({c}) must be in [0, n] with n = {n}: it counts the correct samples among the n")
    _check_k(n, k)
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def avg_at_k(accs: Sequence[bool | float]) -> float:
    """avg@k (the paper's AIME metric): the mean correctness of the k samples of one problem."""
    if not accs:
        raise ValueError("accs is empty: avg@k needs at least one scored sample")
    return float(sum(float(a) for a in accs) / len(accs))


def pass_ks(n: int, ks: Iterable[int] = DEFAULT_PASS_KS) -> list[int]:
    """The k values to report for n samples: the given ks that are <= n, plus n itself; sorted, unique."""
    _check_n(n)
    bad = [k for k in ks if k < 1]
    if bad:
        raise ValueError(f"ks {bad} must be >= 1: pass@k and maj@k need at least one sample")
    return sorted({k for k in ks if k <= n} | {n})


def _answer_classes(preds: Sequence[str], accs: Sequence[bool]) -> tuple[list[str], dict[str, int], set[str], int]:
    """Valid answers in first-appearance order, their counts, the correct ones, and the abstaining count."""
    if len(preds) != len(accs):
        raise ValueError(f"preds ({len(preds)}) and accs ({len(accs)}) must have one entry per sample")
    order: list[str] = []
    counts: dict[str, int] = {}
    correct: set[str] = set()
    abstain = 0
    for pred, acc in zip(preds, accs, strict=True):
        if pred in ABSTAIN_PREDS:
            abstain += 1
            continue
        if pred not in counts:
            order.append(pred)
            counts[pred] = 0
        counts[pred] += 1
        if acc:
            correct.add(pred)
    return order, counts, correct, abstain


def majority_vote(preds: Sequence[str]) -> str | None:
    """The most frequent valid answer; ties go to the earliest-appearing one; ``None`` when every sample abstains."""
    order, counts, _, _ = _answer_classes(preds, [False] * len(preds))
    if not order:
        return None
    best = max(counts[a] for a in order)
    return next(a for a in order if counts[a] == best)


def _truncated_product(factors: Iterable[list[int]], degree: int) -> list[int]:
    """Coefficients of the product of integer polynomials, up to ``x**degree``."""
    out = [1] + [0] * degree
    for f in factors:
        new = [0] * (degree + 1)
        for i, a in enumerate(out):
            if a:
                for j, b in enumerate(f[: degree - i + 1]):
                    new[i + j] += a * b
        out = new
    return out


def _choose_poly(m: int, limit: int) -> list[int]:
    """sum_{j=0..min(m, limit)} C(m, j) x^j: the ways to take j of m identical-answer samples."""
    return [math.comb(m, j) for j in range(min(m, limit) + 1)]


def maj_at_k(preds: Sequence[str], accs: Sequence[bool], k: int) -> float:
    """maj@k: the probability that the majority vote of a uniformly random k-subset of the samples is correct.

    Exact: for a correct answer a appearing c times in the subset, it wins when every other answer b appears at
    most c times (if a precedes b in the tie order) or c - 1 times (otherwise), abstentions unrestricted. The
    number of such subsets is a coefficient of a product of binomial polynomials; summing over c and the
    correct answers and dividing by C(n, k) gives the probability. ``maj_at_k(..., k=n)`` is the plain vote.
    """
    n = len(preds)
    _check_n(n)
    _check_k(n, k)
    order, counts, correct, abstain = _answer_classes(preds, accs)
    rank = {a: i for i, a in enumerate(order)}
    wins = 0
    for a in correct:
        for c in range(1, min(counts[a], k) + 1):
            factors = [_choose_poly(counts[b], c if rank[a] < rank[b] else c - 1) for b in order if b != a]
            factors.append(_choose_poly(abstain, abstain))
            wins += math.comb(counts[a], c) * _truncated_product(factors, k - c)[k - c]
    return float(Fraction(wins, math.comb(n, k)))


def compile_reflection_pattern(phrases: Sequence[str] = DEFAULT_REFLECTION_PHRASES) -> re.Pattern[str]:
    """One case-insensitive regex matching any phrase as whole words (any whitespace between the words)."""
    cleaned = [p.strip() for p in phrases]
    if not cleaned or any(not p for p in cleaned):
        raise ValueError(
            f"reflection phrases {list(phrases)!r} must be a non-empty list of non-empty strings, "
            "e.g. ['wait', 'let me check']"
        )
    alternatives = sorted((r"\s+".join(map(re.escape, p.split())) for p in cleaned), key=len, reverse=True)
    return re.compile(r"(?<!\w)(?:" + "|".join(alternatives) + r")(?!\w)", re.IGNORECASE)


def has_reflection(text: str, pattern: re.Pattern[str]) -> bool:
    """True when ``text`` contains a reflective phrase (see ``compile_reflection_pattern``)."""
    return pattern.search(text) is not None


def reflection_rate(texts: Sequence[str], phrases: Sequence[str] = DEFAULT_REFLECTION_PHRASES) -> float:
    """Share of responses using at least one reflective phrase ("wait", "let me check", ...); 0.0 for none."""
    if not texts:
        return 0.0
    pattern = compile_reflection_pattern(phrases)
    return sum(has_reflection(t, pattern) for t in texts) / len(texts)


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """``{"mean", "max", "min"}`` of response lengths in tokens (as verl's ``response_length/*``)."""
    if not lengths:
        raise ValueError("lengths is empty: length statistics need at least one response")
    return {"mean": sum(lengths) / len(lengths), "max": float(max(lengths)), "min": float(min(lengths))}


def truncation_rate(truncated: Sequence[bool]) -> float:
    """Share of responses cut at the generation limit without EOS (verl's ``response_length/clip_ratio``)."""
    if not truncated:
        raise ValueError("truncated is empty: the truncation rate needs at least one response")
    return sum(bool(t) for t in truncated) / len(truncated)


# The first answer line of a response: "Answer:" and the rest of its line (``\s*`` may cross one newline, as the
# scorer's pattern does, so "Answer:\n42" ends after "42").
_FIRST_ANSWER_LINE = re.compile(r"(?i)Answer\s*:[^\S\n]*\n?[^\n]*")
STOP_CLASSES: tuple[str, ...] = ("stopped", "run_on", "no_answer")


def stop_class(text: str) -> str:
    """Where a response ends, relative to its first answer line: ``stopped`` (nothing but whitespace after it),
    ``run_on`` (it goes on after it, e.g. to another question: the scorer then reads a later answer line) or
    ``no_answer`` (no answer line at all).

        stop_class("4+5=9\\nAnswer: 9")                  # "stopped"
        stop_class("Answer: 9\\nQ: 2+2?\\nAnswer: 4")      # "run_on"
    """
    m = _FIRST_ANSWER_LINE.search(text)
    if m is None:
        return "no_answer"
    return "stopped" if not text[m.end() :].strip() else "run_on"


def stop_metrics(texts: Sequence[str], accs: Sequence[bool]) -> dict[str, float]:
    """How much of a policy's accuracy is stopping and how much is arithmetic: the share of responses that stop at
    their first answer line (``stopped_rate``) or run on past it (``run_on_rate``), and the accuracy within each
    (``acc_when_stopped``, ``acc_when_run_on``; left out when no response is in the class). Overall accuracy =
    stopped_rate * acc_when_stopped + run_on_rate * acc_when_run_on (a response without an answer line is wrong).
    """
    if len(texts) != len(accs):
        raise ValueError(f"texts ({len(texts)}) and accs ({len(accs)}) must have one entry per response")
    if not texts:
        raise ValueError("texts is empty: stop metrics need at least one response")
    classes = [stop_class(t) for t in texts]
    out: dict[str, float] = {}
    for name, label in (("stopped", "stopped"), ("run_on", "run_on")):
        hits = [bool(a) for c, a in zip(classes, accs, strict=True) if c == label]
        out[f"{name}_rate"] = len(hits) / len(texts)
        if hits:
            out[f"acc_when_{name}"] = sum(hits) / len(hits)
    return out
