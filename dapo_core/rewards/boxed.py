"""A ``\\boxed{...}`` variant of the DAPO scorer: the last boxed expression instead of the "Answer:" line.

Extraction follows the reference helper ``last_boxed_only_string`` (verl ``math_dapo.py``): find the *last*
``\\boxed{`` in the completion and walk forward counting braces until they balance; an unclosed last box means
no answer (earlier boxes are not consulted). The content then goes through the same Minerva
``normalize_final_answer`` as the DAPO rule, and so does the ground truth; exact match, +1.0 / -1.0.

Time bound: ``str.rfind`` runs in C over the whole completion; the brace walk is limited to
``MAX_BOXED_CHARS`` characters after the opener (MATH-500's longest answer is 159 characters), so a completion
of 5 MB of nested braces costs one ``rfind`` and a 2 KB scan. A box whose braces do not balance inside that
window counts as no answer -- the one place this differs from an unbounded brace walk.
"""

from __future__ import annotations

import re
from typing import Any

from dapo_core.rewards.math_dapo import INVALID_PRED, check_str, normalize_final_answer

BOXED_OPENER = "\\boxed{"
MAX_BOXED_CHARS = 2048
"""Longest ``\\boxed{...}`` (opener and closing brace included) that is extracted; longer counts as invalid."""

_BRACE_RE = re.compile(r"[{}]")


def last_boxed_content(completion: str, max_chars: int = MAX_BOXED_CHARS) -> str | None:
    """Return the content of the last ``\\boxed{...}`` in ``completion`` (braces balanced), or None.

    Args:
        completion: text to search.
        max_chars: the box (``\\boxed{`` through its closing ``}``) must end within this many characters of
            the opener's start; otherwise None. Bounds the work at O(max_chars) after a C-speed ``rfind``.
    """
    start = check_str("completion", completion).rfind(BOXED_OPENER)
    if start < 0:
        return None
    window_end = min(len(completion), start + max_chars)
    depth = 0
    # "\boxed" holds no brace, so the first brace seen is the opener's "{" and depth is >= 1 until it balances.
    for brace in _BRACE_RE.finditer(completion, start, window_end):
        if brace.group() == "{":
            depth += 1
            continue
        depth -= 1
        if depth == 0:
            return completion[start + len(BOXED_OPENER) : brace.start()]
    return None


def boxed_score(completion: str, ground_truth: str) -> dict[str, Any]:
    """Score one completion by its last ``\\boxed{...}``: +1.0 if the normalised content equals the normalised
    ground truth, else -1.0.

    Returns:
        ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``; ``pred`` is "[INVALID]" when there is no closed
        last box (as with the DAPO rule, a ground truth normalising to "[INVALID]" then matches).

    Raises:
        TypeError: if ``completion`` or ``ground_truth`` is not a ``str``.
    """
    check_str("completion", completion)
    check_str("ground_truth", ground_truth)
    content = last_boxed_content(completion)
    pred = normalize_final_answer(INVALID_PRED if content is None else content)
    acc = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
