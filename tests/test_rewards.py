"""Example-based tests of the reward functions and registry.

Every expected value below was derived by hand-running the reference scorer (verl
``utils/reward_score/math_dapo.py``, default path) step by step; "quirk" marks a case where the reference does
something surprising that we keep for bit-compatibility. ``test_rewards_properties.py`` checks the same
functions against a regex-level re-statement of the reference on generated inputs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from dapo_core.rewards import (
    ScoredBatch,
    available_rewards,
    boxed_score,
    get_reward_fn,
    math_dapo_score,
    normalize_final_answer,
    register_reward,
    registry,
    score_batch,
)
from dapo_core.rewards.boxed import MAX_BOXED_CHARS, last_boxed_content
from dapo_core.rewards.math_dapo import REMOVED_EXPRESSIONS, SUBSTITUTIONS, TAIL_CHARS, extract_answer

FIVE_MB = 5 * 1024 * 1024


def _dapo(completion: str, ground_truth: str) -> tuple[float, bool, str]:
    out = math_dapo_score(completion, ground_truth)
    return out["score"], out["acc"], out["pred"]


# --------------------------------------------------------------------------------------------------------
# math_dapo_score: the "Answer:" rule
# --------------------------------------------------------------------------------------------------------

CORRECT_42 = [
    "Answer: 42",
    "answer: 42",
    "ANSWER:42",
    "Answer :   42",
    "The sum is 6*7.\nAnswer: 42\n",
    "Answer: $42$",
    "Answer: \\boxed{42}",
    "Answer: $\\boxed{42}$",
    "Answer: $42.$",  # ".$" -> "$" is the only trailing-period rule
    "Answer: 42 degrees",  # spaces dropped, then "degrees" removed
    "Answer: 42^\\circ",
    "Answer: 42^{\\circ}",
    "Answer: 42 \\text{ cm}",  # "42\text{cm}" -> "cm" removed -> "\text{}" removed
    "Answer: 42 \\text{ m}",  # "\text{m}" -> "\text{}" (substitution), then removed
    "Answer: \\$42",  # "\$" (escaped dollar) is dropped
    "Answer: x = 42",  # only the text after the last "=" is kept
    "Answer: \\text{42}",
    "Answer: \\textbf{42}",
    "Answer: a 42",  # quirk: the article substitution "a " -> "" applies anywhere
    "Answer:\n42",  # quirk: \s* after the colon crosses the newline
]


@pytest.mark.parametrize("completion", CORRECT_42)
def test_answer_line_variants_score_plus_one(completion: str) -> None:
    assert _dapo(completion, "42") == (1.0, True, "42")


@pytest.mark.parametrize(
    ("completion", "pred"),
    [
        ("Answer: 42.", "42."),  # quirk: a bare trailing period is kept, so 42. != 42
        ("Answer: 42 (final)", "42(final)"),
        ("Answer: 10%", "10%"),  # "%" is in neither list
        ("Answer: 42 apples", "42apples"),  # only the listed units are removed
        ("Answer: Answer: 42", "Answer:42"),  # quirk: findall does not overlap; the first match eats the line
        ("Answer: forty-two", "forty-two"),
    ],
)
def test_answer_forms_that_do_not_match(completion: str, pred: str) -> None:
    assert _dapo(completion, "42") == (-1.0, False, pred)


def test_return_keys_and_types() -> None:
    out = math_dapo_score("Answer: 7", "7")
    assert list(out) == ["score", "acc", "pred"]
    assert type(out["score"]) is float and type(out["acc"]) is bool and type(out["pred"]) is str
    out = math_dapo_score("Answer: 8", "7")
    assert (out["score"], out["acc"]) == (-1.0, False)


@pytest.mark.parametrize(
    ("completion", "ground_truth", "expected"),
    [
        ("Answer: 1,000", "1000", 1.0),  # commas dropped: the rest is all digits
        ("Answer: 1000", "1,000", 1.0),  # the ground truth is normalised the same way
        ("Answer: 1,000,000", "1000000", 1.0),
        ("Answer: 1,\\!000", "1000", 1.0),  # ",\!" removed
        ("Answer: 1{,}000", "1000", 1.0),  # "{,}" removed
        ("Answer: 1,000.5", "1000.5", -1.0),  # quirk: not all digits, so the comma stays
        ("Answer: -7", "-7", 1.0),
        ("Answer: $-7$", "-7", 1.0),
        ("Answer: -7", "7", -1.0),
        ("Answer: 3.14", "3.14", 1.0),
        ("Answer: 3.140", "3.14", -1.0),  # exact string match, no numeric equivalence
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # \fracab shorthand expanded
        ("Answer: \\frac{1}{2}", "$\\frac{1}{2}$", 1.0),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", -1.0),  # quirk: \dfrac is not normalised
        ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),
        ("Answer: \\text{(B)}", "(B)", 1.0),
        ("Answer: \\text{(B)}", "B", -1.0),
        ("Answer: 5", "\\boxed{5}", 1.0),  # the ground truth's \boxed{} is unwrapped by the normaliser
        ("Answer: 5", "x = 5", 1.0),
        ("Answer: \u0661,\u0662\u0663", "\u0661\u0662\u0663", 1.0),  # quirk: str.isdigit accepts Arabic digits
    ],
)
def test_normalisation_cases(completion: str, ground_truth: str, expected: float) -> None:
    assert math_dapo_score(completion, ground_truth)["score"] == expected


def test_last_answer_line_wins() -> None:
    text = "Answer: 1\nthinking again...\nAnswer: 2"
    assert _dapo(text, "2") == (1.0, True, "2")
    assert _dapo(text, "1") == (-1.0, False, "2")


def test_only_the_last_300_characters_are_read() -> None:
    line = "Answer: 42"
    seen = line + "\n" + "x" * (TAIL_CHARS - len(line) - 1)  # "A" is exactly the 300th character from the end
    assert len(seen) == TAIL_CHARS
    assert _dapo("padding " * 50 + seen, "42") == (1.0, True, "42")
    unseen = line + "\n" + "x" * (TAIL_CHARS - len(line))  # one character more: the "A" falls off
    assert _dapo(unseen, "42") == (-1.0, False, "[INVALID]")
    # A cut inside the line leaves "nswer: 42" -- no longer an answer line.
    assert extract_answer(unseen) == "[INVALID]"


@pytest.mark.parametrize("completion", ["", "I think it is 42.", "The answer is 42", "Answer:"])
def test_missing_answer_line_is_invalid(completion: str) -> None:
    assert _dapo(completion, "42") == (-1.0, False, "[INVALID]")


def test_empty_answer_quirks() -> None:
    # Quirk: "Answer: " with a trailing space captures " " (\s* backtracks), which normalises to "".
    assert _dapo("Answer: ", "") == (1.0, True, "")
    # Quirk: the "[INVALID]" placeholder is compared like any prediction, so this ground truth matches.
    assert _dapo("no answer line", "[INVALID]") == (1.0, True, "[INVALID]")


def test_ground_truth_is_normalised() -> None:
    assert normalize_final_answer("$\\boxed{1,000}$") == "1000"
    assert normalize_final_answer("  12 \\text{ inches} ") == "12"
    assert normalize_final_answer("\\text{(C)}") == "(C)"
    assert normalize_final_answer("x=\\frac{3}{4}") == "\\frac{3}{4}"
    assert math_dapo_score("Answer: 12", "  12 \\text{ inches} ")["acc"] is True


def test_reference_tables_are_carried_over() -> None:
    # Pins the specification data: sizes, order at both ends, and the entries holding a real newline.
    assert len(SUBSTITUTIONS) == 10 and len(REMOVED_EXPRESSIONS) == 41
    assert SUBSTITUTIONS[0] == ("an ", "") and SUBSTITUTIONS[-1] == ("\\text{m}", "\\text{}")
    assert REMOVED_EXPRESSIONS[0] == "square" and REMOVED_EXPRESSIONS[-1] == "\\dots"
    assert "\\text{\ns}" in REMOVED_EXPRESSIONS and "\\text{\n}" in REMOVED_EXPRESSIONS
    assert REMOVED_EXPRESSIONS.index("\\text{s}") < REMOVED_EXPRESSIONS.index("\\text{}")


@pytest.mark.parametrize("fn", [math_dapo_score, boxed_score])
def test_non_str_inputs_raise_type_error_naming_the_argument(fn: Any) -> None:
    with pytest.raises(TypeError, match="completion must be a str, got NoneType"):
        fn(None, "1")
    with pytest.raises(TypeError, match="completion must be a str, got bytes"):
        fn(b"Answer: 1", "1")
    with pytest.raises(TypeError, match="ground_truth must be a str, got int"):
        fn("Answer: 1", 1)


# --------------------------------------------------------------------------------------------------------
# Hostile inputs: each must return (pytest-timeout guards against hangs; no timing asserts)
# --------------------------------------------------------------------------------------------------------

HOSTILE = {
    "5mb_text_then_answer": "lorem ipsum " * (FIVE_MB // 12) + "\nAnswer: 42",
    "5mb_answer_lines": "Answer: 1\n" * (FIVE_MB // 10),
    "5mb_one_dollar_line": "$" + "x" * FIVE_MB,  # quadratic for the reference's (.*?)(\$)(.*?)(\$)(.*)
    "nested_open_braces": "\\boxed{" + "{" * 100_000,
    "nested_balanced_braces": "\\boxed{" + "{" * 100_000 + "}" * 100_001,
    "many_boxed_openers": "\\boxed{" * 100_000,
    "many_text_openers": "\\text{\n" * 100_000 + "}",
    "frac_sqrt_spam": "fracsqrt" * 125_000,  # 250k shorthand fixes: linear, one Python step each
    "nul_bytes": "\x00" * FIVE_MB + "Answer: 4\x002",
    "huge_number": "Answer: " + "9" * 1_000_000,
    "unicode": "Ａｎｓｗｅｒ：４２ 🤖" * 200_000 + "\nAnswer: \u0664\u0662 \U0001f600",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("fn", [math_dapo_score, boxed_score], ids=["math_dapo", "boxed"])
def test_hostile_inputs_return(name: str, fn: Any) -> None:
    text = HOSTILE[name]
    for completion, ground_truth in [(text, "42"), ("Answer: 42", text)]:
        out = fn(completion, ground_truth)
        assert out["score"] in (1.0, -1.0) and out["acc"] is (out["score"] > 0)


def test_hostile_predictions_are_what_the_rule_says() -> None:
    assert _dapo(HOSTILE["5mb_text_then_answer"], "42") == (1.0, True, "42")
    assert math_dapo_score(HOSTILE["nul_bytes"], "4\x002")["acc"] is True  # NUL is an ordinary character
    # Huge numbers are compared as text, never converted. The last 300 characters of a 1M-digit answer are
    # all nines -- no "Answer:" left -- so it is invalid; 292 digits still fit beside "Answer: ".
    assert _dapo(HOSTILE["huge_number"], "9" * 1_000_000) == (-1.0, False, "[INVALID]")
    nines = "9" * (TAIL_CHARS - len("Answer: "))
    assert _dapo("x" * 1000 + "Answer: " + nines, nines) == (1.0, True, nines)
    assert normalize_final_answer(HOSTILE["5mb_one_dollar_line"]) == HOSTILE["5mb_one_dollar_line"][1:]


# --------------------------------------------------------------------------------------------------------
# boxed_score
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "ground_truth", "expected", "pred"),
    [
        ("so \\boxed{42}.", "42", 1.0, "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0, "\\frac{1}{2}"),  # nested braces balanced
        ("\\boxed{1} then \\boxed{2}", "2", 1.0, "2"),  # the last box wins
        ("\\boxed{1} then \\boxed{2", "1", -1.0, "[INVALID]"),  # an unclosed last box is not skipped
        ("\\boxed{1,000 \\text{ cm}}", "1000", 1.0, "1000"),
        ("no box here. Answer: 42", "42", -1.0, "[INVALID]"),
        ("\\boxed{}", "", 1.0, ""),
    ],
)
def test_boxed_score_cases(completion: str, ground_truth: str, expected: float, pred: str) -> None:
    assert boxed_score(completion, ground_truth) == {"score": expected, "acc": expected > 0, "pred": pred}


def test_boxed_reads_the_whole_completion_but_bounds_the_box() -> None:
    # Unlike the DAPO rule, the box may sit anywhere: here 1000 characters before the end.
    assert boxed_score("\\boxed{7}" + "." * 1000, "7")["acc"] is True
    fits = "\\boxed{" + "1" * (MAX_BOXED_CHARS - 8) + "}"
    assert len(fits) == MAX_BOXED_CHARS and last_boxed_content(fits) == "1" * (MAX_BOXED_CHARS - 8)
    too_long = "\\boxed{" + "1" * (MAX_BOXED_CHARS - 7) + "}"
    assert last_boxed_content(too_long) is None


# --------------------------------------------------------------------------------------------------------
# Registry and score_batch
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A private copy of the registry, so registrations in a test do not leak."""
    fns = dict(registry.REWARD_FNS)
    monkeypatch.setattr(registry, "REWARD_FNS", fns)
    return fns


def test_builtin_rewards_registered() -> None:
    assert {"math_dapo", "boxed"} <= set(available_rewards())
    assert available_rewards() == sorted(available_rewards())
    assert get_reward_fn("math_dapo") is math_dapo_score
    assert get_reward_fn("boxed") is boxed_score


def test_unknown_reward_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'; valid names: .*boxed.*math_dapo"):
        get_reward_fn("nope")


def test_register_reward_rejects_a_taken_name(scratch_registry: dict[str, Any]) -> None:
    register_reward("math_dapo")(math_dapo_score)  # same function again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math_dapo")(boxed_score)
    with pytest.raises(ValueError, match="non-empty str"):
        register_reward("")


def test_math_verify_is_registered_lazily_when_importable(
    scratch_registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch_registry.pop("math_verify", None)
    monkeypatch.setattr(registry, "_math_verify_importable", lambda: False)
    assert "math_verify" not in available_rewards()
    with pytest.raises(ValueError, match="math-verify"):
        get_reward_fn("math_verify")

    class FakeMathVerify:  # stands in for the package: parse -> [expr, str], verify -> bool
        @staticmethod
        def parse(text: str, parsing_timeout: Any = 5) -> list[str]:
            assert parsing_timeout is None  # signal-based timeouts must stay off
            digits = "".join(ch for ch in text if ch.isdigit())
            return [digits, digits] if digits else []

        @staticmethod
        def verify(gold: list[str], answer: list[str], timeout_seconds: Any = 5) -> bool:
            assert timeout_seconds is None
            return gold[0] == answer[0]

    monkeypatch.setitem(sys.modules, "math_verify", FakeMathVerify)
    monkeypatch.setattr(registry, "_math_verify_importable", lambda: True)
    assert "math_verify" in available_rewards()
    fn = get_reward_fn("math_verify")
    assert fn("so it is 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert fn("no digits", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def test_score_batch_matches_per_item_calls() -> None:
    completions = ["Answer: 1", "Answer: 2", "nothing", "\\boxed{3}"]
    truths = ["1", "1", "1", "3"]
    batch = score_batch("math_dapo", completions, truths)
    assert isinstance(batch, ScoredBatch) and batch.num_failed == 0
    assert batch.results == [math_dapo_score(c, g) for c, g in zip(completions, truths, strict=True)]
    results, num_failed = score_batch("boxed", completions, truths)
    assert [r["score"] for r in results] == [-1.0, -1.0, -1.0, 1.0] and num_failed == 0


def test_score_batch_guards_each_item(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dapo_core.rewards.registry"):
        results, num_failed = score_batch("math_dapo", ["Answer: 1", "Answer: 2", None], ["1", 2, "1"])  # type: ignore[list-item]
    assert num_failed == 2
    assert results[0] == {"score": 1.0, "acc": True, "pred": "1"}
    assert results[1] == results[2] == {"score": -1.0, "acc": False, "pred": "[ERROR]"}
    assert "item 1: TypeError: ground_truth must be a str" in caplog.text
    assert "item 2: TypeError: completion must be a str" in caplog.text


def test_score_batch_guards_a_raising_reward_fn(scratch_registry: dict[str, Any]) -> None:
    @register_reward("flaky")
    def flaky(completion: str, ground_truth: str) -> dict[str, Any]:
        if completion == "boom":
            raise RuntimeError("boom")
        return math_dapo_score(completion, ground_truth)

    results, num_failed = score_batch("flaky", ["boom", "Answer: 5"], ["5", "5"])
    assert num_failed == 1 and [r["pred"] for r in results] == ["[ERROR]", "5"]


def test_score_batch_errors() -> None:
    with pytest.raises(ValueError, match=r"completions \(2\) and ground_truths \(1\) must have the same length"):
        score_batch("math_dapo", ["a", "b"], ["a"])
    with pytest.raises(ValueError, match="valid names"):
        score_batch("nope", [], [])
    assert score_batch("math_dapo", [], []) == ScoredBatch([], 0)
