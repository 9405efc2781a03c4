"""The DAPO "Answer:" math scorer, bit-compatible with the authors' published rule.

Specification: ``verl/utils/reward_score/math_dapo.py`` (volcengine/verl), the scorer DAPO (arXiv 2503.14476,
Sec. 3 "rule-based reward", Eq. 7: R = +1 if is_equivalent(y_hat, y) else -1) was trained and evaluated with;
its ``normalize_final_answer`` is the Minerva / lm-evaluation-harness hendrycks_math normaliser. The default
path of the reference ``compute_score`` is, step by step:

1. keep only the last 300 characters of the completion (``solution_str[-300:]``);
2. ``re.findall(r"(?i)Answer\\s*:\\s*([^\\n]+)", tail)``, take the last match, or the literal "[INVALID]";
3. ``pred = normalize_final_answer(match)`` and -- the ground truth is normalised too (``gt_need_extract``
   defaults to False, so no ``\\boxed`` extraction) -- ``gt = normalize_final_answer(ground_truth)``;
4. ``acc = pred == gt`` (exact string match), ``score = 1.0 if acc else -1.0``, ``pred`` returned normalised.

The reference's ``strict_box_verify`` option (last ``\\boxed{}`` in the final 100 chars, compared to the *raw*
ground truth) is not part of the DAPO recipe and is not implemented; ``boxed.boxed_score`` is our boxed variant.

Time bound without signals: the completion is cut to its tail before any regex, so the one regex kept from the
reference runs on <= 300 characters. The normalisation's five ``re.sub`` calls are replaced by hand-written
single-pass equivalents (each documented with the regex it replaces and checked against it by property tests),
because the ground truth is not cut and ``(.*?)(\\$)(.*?)(\\$)(.*)`` is quadratic on a long line with one ``$``.
Nothing here evaluates text as code.

Usage::

    >>> math_dapo_score("... so the result is\\nAnswer: $\\\\boxed{42}$", "42")
    {'score': 1.0, 'acc': True, 'pred': '42'}
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

TAIL_CHARS = 300
"""Only the last 300 characters of a completion are read (reference: "the longest answer in MATH-500 has 159")."""

INVALID_PRED = "[INVALID]"
"""What the reference extracts when no "Answer:" line is found (then normalised, which leaves it unchanged)."""

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
_ANSWER_RE = re.compile(ANSWER_PATTERN)

# Minerva normalisation tables (Lewkowycz et al. 2022, appendix D.1), exactly as in the reference. These are
# specification data: order matters (each replacement runs on the result of the previous one).
SUBSTITUTIONS: list[tuple[str, str]] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]

# NB: "\\text{\ns}" and "\\text{\n}" contain a real newline character (not a raw string), as in the reference.
REMOVED_EXPRESSIONS: list[str] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]


def check_str(name: str, value: object) -> str:
    """Return ``value`` if it is a ``str``, else raise a TypeError naming the argument ``name``."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a str, got {type(value).__name__} ({value!r:.80}); "
            f"decode bytes / convert to str before scoring"
        )
    return value


# ---------------------------------------------------------------------------------------------------------
# Linear-time equivalents of the reference's re.sub calls. In Python's `re`, "." matches anything but "\n",
# and re.sub never rescans replaced text; both facts are what makes these single passes exact.
# ---------------------------------------------------------------------------------------------------------


def _keep_first_dollar_pair(text: str) -> str:
    """``re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\\\3$", text)`` in one pass.

    No group crosses a newline, and a match consumes its line to the end, so each line is independent: a line
    holding two or more ``$`` becomes ``"$" + <text between its first and second $> + "$"``; other lines stay.
    """
    if text.count("$") < 2:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        first = line.find("$")
        if first < 0:
            continue
        second = line.find("$", first + 1)
        if second >= 0:
            lines[i] = "$" + line[first + 1 : second] + "$"
    return "\n".join(lines)


def _unwrap_lazy(text: str, opener: str) -> str:
    """``re.sub(rf"({re.escape(opener)})(.*?)(\\}})", "\\\\2", text)`` in one pass.

    A match is ``opener`` followed by the nearest ``}`` with no newline in between; it is replaced by what lies
    between them. The next ``}`` / ``\\n`` positions only move forward, so the scan is linear.
    """
    if opener not in text:
        return text
    parts: list[str] = []
    copied = search = 0
    close = newline = -1  # cached: first "}" / "\n" at or after the current content start
    while True:
        start = text.find(opener, search)
        if start < 0:
            break
        content = start + len(opener)
        if close < content:
            close = text.find("}", content)
            if close < 0:  # no "}" left: no later opener can match either
                break
        if newline < content:
            newline = text.find("\n", content)
            if newline < 0:
                newline = len(text)
        if close < newline:
            parts += (text[copied:start], text[content:close])
            copied = search = close + 1
        else:
            search = start + 1
    parts.append(text[copied:])
    return "".join(parts)


def _unwrap_boxed_greedy(text: str) -> str:
    """``re.sub(r"(\\\\boxed\\{)(.*)(\\})", "\\\\2", text)`` in one pass.

    ``(.*)`` is greedy and stops at a newline, so per line: the first ``\\boxed{`` that has a ``}`` after it on
    the same line is replaced, through the *last* ``}`` of that line, by what lies between (at most one match
    per line, since nothing after the last ``}`` can close another).
    """
    opener = "\\boxed{"
    if opener not in text:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        start = line.find(opener)
        if start < 0:
            continue
        close = line.rfind("}")
        if close >= start + len(opener):
            lines[i] = line[:start] + line[start + len(opener) : close] + line[close + 1 :]
    return "\n".join(lines)


def _fix_frac_shorthand(text: str) -> str:
    """``re.sub(r"(frac)([^{])(.)", "frac{\\\\2}{\\\\3}", text)``: ``fracab`` -> ``frac{a}{b}``.

    ``[^{]`` may be a newline, ``.`` may not.
    """
    if "frac" not in text:
        return text
    parts: list[str] = []
    copied = search = 0
    while True:
        start = text.find("frac", search)
        if start < 0:
            break
        a = start + 4
        if a + 1 < len(text) and text[a] != "{" and text[a + 1] != "\n":
            parts += (text[copied:start], "frac{", text[a], "}{", text[a + 1], "}")
            copied = search = a + 2
        else:
            search = start + 1
    parts.append(text[copied:])
    return "".join(parts)


def _fix_sqrt_shorthand(text: str) -> str:
    """``re.sub(r"(sqrt)([^{])", "sqrt{\\\\2}", text)``: ``sqrta`` -> ``sqrt{a}``."""
    if "sqrt" not in text:
        return text
    parts: list[str] = []
    copied = search = 0
    while True:
        start = text.find("sqrt", search)
        if start < 0:
            break
        a = start + 4
        if a < len(text) and text[a] != "{":
            parts += (text[copied:start], "sqrt{", text[a], "}")
            copied = search = a + 1
        else:
            search = start + 1
    parts.append(text[copied:])
    return "".join(parts)


def normalize_final_answer(final_answer: str) -> str:
    """Minerva-normalise a final answer exactly as the reference ``normalize_final_answer`` does.

    Steps, in the reference's order: keep the text after the last "="; apply ``SUBSTITUTIONS`` then delete
    ``REMOVED_EXPRESSIONS``; keep the first ``$...$`` of each line; unwrap ``\\text{}``, ``\\textbf{}``,
    ``\\overline{}`` (lazy) and ``\\boxed{}`` (greedy); expand ``\\fracab`` / ``\\sqrta`` shorthand; drop ``$``;
    drop commas when what remains is all digits (``str.isdigit``, so Unicode digits count too); strip.
    Runs in time linear in ``len(final_answer)``.
    """
    check_str("final_answer", final_answer)
    text = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = _keep_first_dollar_pair(text)
    text = _unwrap_lazy(text, "\\text{")
    text = _unwrap_lazy(text, "\\textbf{")
    text = _unwrap_lazy(text, "\\overline{")
    text = _unwrap_boxed_greedy(text)
    text = _fix_frac_shorthand(text)
    text = _fix_sqrt_shorthand(text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(completion: str) -> str:
    """The raw (unnormalised) text after the last "Answer:" in the last ``TAIL_CHARS`` chars, or "[INVALID]".

    The reference regex runs unchanged, but only on the tail, so its cost is bounded whatever the input size.
    Quirks kept on purpose: ``\\s*`` after the colon may cross a newline ("Answer:\\n42" reads "42"), and
    ``findall`` does not overlap, so "Answer: Answer: 5" yields "Answer: 5".
    """
    tail = check_str("completion", completion)[-TAIL_CHARS:]
    matches = _ANSWER_RE.findall(tail)
    return matches[-1] if matches else INVALID_PRED


def math_dapo_score(completion: str, ground_truth: str) -> dict[str, Any]:
    """Score one completion with the DAPO rule (Eq. 7): +1.0 if the normalised answers match exactly, else -1.0.

    Args:
        completion: the model's response text (any length; only its last 300 characters are read).
        ground_truth: the reference answer; normalised with the same ``normalize_final_answer``.

    Returns:
        ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` -- ``pred`` is the normalised extracted answer,
        "[INVALID]" when no "Answer:" line is in the tail. Bit-compatible with the reference, including its
        quirk that a ground truth normalising to "[INVALID]" matches a completion without an answer line.

    Raises:
        TypeError: if ``completion`` or ``ground_truth`` is not a ``str``.
    """
    check_str("completion", completion)
    check_str("ground_truth", ground_truth)
    pred = normalize_final_answer(extract_answer(completion))
    acc = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
