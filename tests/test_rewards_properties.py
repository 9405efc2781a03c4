"""Property tests (hypothesis) of the reward functions.

The strongest check is bit-compatibility: ``REFERENCE_*`` below re-state the reference scorer (verl
``utils/reward_score/math_dapo.py``, default path) at the level of its regular expressions -- the very
``re.sub`` / ``re.findall`` calls it makes -- and our linear-time implementation must agree with it on inputs
built from the characters and tokens those expressions react to.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.rewards import available_rewards, boxed_score, get_reward_fn, math_dapo_score
from dapo_core.rewards import math_dapo as mdapo
from dapo_core.rewards.boxed import last_boxed_content
from dapo_core.rewards.math_dapo import REMOVED_EXPRESSIONS, SUBSTITUTIONS, normalize_final_answer

# --------------------------------------------------------------------------------------------------------
# The reference, regex by regex (the oracle; quadratic in places, so only fed short strings)
# --------------------------------------------------------------------------------------------------------


def reference_normalize(answer: str) -> str:
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def reference_score(solution: str, ground_truth: str) -> dict[str, Any]:
    solution = solution[-300:]
    matches = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", solution)
    pred = reference_normalize(matches[-1] if matches else "[INVALID]")
    correct = pred == reference_normalize(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def reference_last_boxed_content(text: str) -> str | None:
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx + len("\\boxed{") : i]
    return None


# Tokens every rule reacts to, plus a little noise: random text alone would almost never hit "\text{".
TOKENS = [
    "$", "\n", "{", "}", "\\", " ", "=", ",", ".", "^", "1", "2", "0", "a", "an ", "a ", "x", "s", "m",
    "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "\\mbox{", "frac", "sqrt", "\\$", "\\ ", ".$",
    "\\text{and}", "\\text{m}", "\\text{\ns}", "\\text{}", "^\\circ", ",\\!", "{,}", "cm", "degrees",
    "Answer:", "answer :", "ANSWER", "[INVALID]", "\u00b2", "\u0663", "\x00", "\r", "\t",
]  # fmt: skip
token_text = st.lists(st.sampled_from(TOKENS) | st.sampled_from(TOKENS[:6]) | st.text(max_size=2), max_size=24).map(
    "".join
)


# Each single-pass rewrite against the one regex it replaces, on a tiny alphabet so that every structure
# (several lines, openers without a "}", a "}" behind a newline, shorthand at the very end) shows up often.
STEP_CASES = [
    (mdapo._keep_first_dollar_pair, r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", ["$", "\n", "x", "y"]),
    (partial(mdapo._unwrap_lazy, opener="\\text{"), r"(\\text\{)(.*?)(\})", "\\2", ["\\text{", "}", "{", "\n", "x"]),
    (partial(mdapo._unwrap_lazy, opener="\\overline{"), r"(\\overline\{)(.*?)(\})", "\\2", ["\\overline{", "}", "\n", "x"]),
    (mdapo._unwrap_boxed_greedy, r"(\\boxed\{)(.*)(\})", "\\2", ["\\boxed{", "}", "{", "\n", "x"]),
    (mdapo._fix_frac_shorthand, r"(frac)([^{])(.)", "frac{\\2}{\\3}", ["frac", "{", "\n", "x", "f"]),
    (mdapo._fix_sqrt_shorthand, r"(sqrt)([^{])", "sqrt{\\2}", ["sqrt", "{", "\n", "x", "s"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("step", "pattern", "template", "alphabet"),
    STEP_CASES,
    ids=["dollars", "text", "overline", "boxed", "frac", "sqrt"],
)
@settings(max_examples=100)
@given(data=st.data())
def test_each_rewrite_matches_its_regex(
    step: Callable[[str], str], pattern: str, template: str, alphabet: list[str], data: st.DataObject
) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(alphabet), max_size=16)))
    assert step(text) == re.sub(pattern, template, text)


@settings(max_examples=150)
@given(token_text)
def test_normalize_matches_reference(text: str) -> None:
    assert normalize_final_answer(text) == reference_normalize(text)


@settings(max_examples=150)
@given(token_text, token_text)
def test_math_dapo_score_matches_reference(completion: str, ground_truth: str) -> None:
    assert math_dapo_score(completion, ground_truth) == reference_score(completion, ground_truth)


@settings(max_examples=100)
@given(st.text(max_size=400), token_text, st.sampled_from(["Answer: ", "answer:", "Answer :\n"]), token_text)
def test_math_dapo_score_matches_reference_near_the_cut(padding: str, before: str, marker: str, after: str) -> None:
    completion = padding + before + marker + after  # answer lines near the 300-character boundary
    assert math_dapo_score(completion, after) == reference_score(completion, after)


@settings(max_examples=150)
@given(token_text)
def test_last_boxed_content_matches_reference(text: str) -> None:
    assert last_boxed_content(text) == reference_last_boxed_content(text)


# --------------------------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------------------------

no_answer_prefix = st.text(max_size=500).filter(lambda s: re.search(r"(?i)answer", s) is None)


@given(no_answer_prefix, st.integers(min_value=-(10**200), max_value=10**200))
def test_answer_line_with_integer_scores_plus_one(prefix: str, n: int) -> None:
    out = math_dapo_score(f"{prefix}\nAnswer: {n}", str(n))
    assert out["score"] == 1.0 and out["acc"] is True


@given(no_answer_prefix, st.integers(min_value=-(10**50), max_value=10**50))
def test_boxed_integer_scores_plus_one(prefix: str, n: int) -> None:
    assert boxed_score(f"{prefix} \\boxed{{{n}}}", str(n))["acc"] is True


@pytest.mark.parametrize("fn", [math_dapo_score, boxed_score], ids=["math_dapo", "boxed"])
@given(completion=st.text(max_size=2000), ground_truth=st.text(max_size=50))
def test_scores_are_binary_and_consistent_on_arbitrary_text(fn: Any, completion: str, ground_truth: str) -> None:
    out = fn(completion, ground_truth)  # never raises on any str
    assert set(out) == {"score", "acc", "pred"}
    assert out["score"] in (1.0, -1.0)
    assert out["acc"] is (out["score"] > 0)
    assert isinstance(out["pred"], str)


@given(st.text(min_size=1, max_size=30))
def test_unknown_reward_name_error_lists_every_valid_name(name: str) -> None:
    valid = available_rewards()
    if name in valid:
        return
    with pytest.raises(ValueError) as info:
        get_reward_fn(name)
    listed = str(info.value).split("valid names: ", 1)[1].split(" (", 1)[0].split(", ")
    assert listed == valid
