"""Curation core (dapo_core.data.curate): drop reasons with exact counts, de-duplication, splits, invariants."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from conftest_data import (
    MESSY_JSONL_REASONS,
    MESSY_VERL_REASONS,
    char_count,
    messy_jsonl,
    messy_verl,
    rows,
)
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.data.curate import (
    INTEGER_ANSWER,
    curate,
    integer_ground_truth,
    normalize_problem,
    problem_key,
)
from dapo_core.data.curate_report import DROP_REASONS
from dapo_core.data.loaders import load_source
from dapo_core.data.templates import DAPO_TEMPLATE, TINY_TEMPLATE

MAX_LEN = 150  # characters (char_count) with the dapo template: the LONG problem is over, the others under


def _expected(*reason_lists: list[str | None]) -> dict[str, int]:
    counts = Counter(r for reasons in reason_lists for r in reasons if r is not None)
    return {r: counts.get(r, 0) for r in DROP_REASONS}


def test_messy_sources_exact_counts_by_reason(tmp_path):
    jsonl = load_source(messy_jsonl(tmp_path / "messy.jsonl"))
    verl = load_source(messy_verl(tmp_path / "messy.parquet"))
    result = curate([jsonl, verl], template="tiny", max_prompt_length=100, count_tokens=char_count)
    report = result.report
    assert [s.dropped for s in report.sources] == [_expected(MESSY_JSONL_REASONS), _expected(MESSY_VERL_REASONS)]
    assert report.dropped == _expected(MESSY_JSONL_REASONS, MESSY_VERL_REASONS)
    assert report.rows_in == len(MESSY_JSONL_REASONS) + len(MESSY_VERL_REASONS)
    assert report.rows_in == report.kept + sum(report.dropped.values())
    assert sorted(r.raw_problem for r in result.train) == ["1+2", "What is 6 times 7?"]
    # every reason has an example naming the source and row
    by_reason: dict = {}
    for example in report.examples:
        by_reason.setdefault(example.reason, example)
    assert set(by_reason) == set(DROP_REASONS)
    assert by_reason["non_integer_answer"].row == 5 and "1/2" in by_reason["non_integer_answer"].detail
    assert "empty" in by_reason["empty_problem"].detail
    assert report.sources[1].templates == {"dapo": 6, "none": 1}  # the unreadable row has no text


def test_records_are_normalised_to_the_configured_template(tmp_path):
    verl = load_source(messy_verl(tmp_path / "messy.parquet"))
    result = curate([verl], template="tiny", max_prompt_length=MAX_LEN, count_tokens=char_count)
    (record,) = result.train
    assert record.prompt == [{"role": "user", "content": "Q: What is 6 times 7?"}]
    assert record.ground_truth == "42" and record.style == "rule-lighteval/MATH_v2"
    assert (record.index, record.split, record.data_source) == (0, "train", "math_dapo")
    assert result.prompt_lengths["train"] == [len("Q: What is 6 times 7?")]


def test_hundredfold_duplicates_keep_one_of_each():
    problems, answers = [], []
    for copy in range(100):
        for k in range(37):
            text = f"Compute {k} plus {k}."
            variant = [text, text.upper(), f"  {text}\n", DAPO_TEMPLATE.apply(text), TINY_TEMPLATE.apply(text)][
                copy % 5
            ]
            problems.append(variant)
            answers.append(str(2 * k))
    order = list(range(len(problems)))
    random.Random(0).shuffle(order)
    src = rows([problems[i] for i in order], [answers[i] for i in order], templated=True)
    result = curate([src], template="dapo", max_prompt_length=10**6, count_tokens=char_count)
    assert len(result.train) == 37
    assert result.report.dropped["duplicate"] == 3700 - 37
    assert result.report.conflicting_answers == 0
    assert {normalize_problem(r.raw_problem) for r in result.train} == {f"compute {k} plus {k}." for k in range(37)}


def test_conflicting_answers_are_counted():
    src = rows(["1+1", "1+1", "1 + 1", "1+1"], ["2", "3", "2", "2"])
    result = curate([src], template="tiny", max_prompt_length=99, count_tokens=char_count)
    assert result.report.dropped["duplicate"] == 2  # "1 + 1" is another problem (whitespace collapsed, not removed)
    assert result.report.conflicting_answers == 1
    assert [r.ground_truth for r in result.train] == ["2", "2"]


def test_validation_sources_win_over_train_and_split_is_deterministic():
    val = rows(["p1", "p2"], ["1", "2"], source="val")
    train = rows([f"p{i}" for i in range(40)], [str(i) for i in range(40)], source="train")
    result = curate([train], [val], template="tiny", max_prompt_length=99, count_tokens=char_count, val_size=5)
    assert result.report.sources[0].dropped["duplicate"] == 2  # p1, p2 belong to validation only
    assert [r.raw_problem for r in result.val[:2]] == ["p1", "p2"]
    assert len(result.val) == 7 and len(result.train) == 40 - 2 - 5
    assert {r.raw_problem for r in result.val}.isdisjoint(r.raw_problem for r in result.train)
    assert [r.index for r in result.val] == list(range(7))
    assert {r.split for r in result.train} == {"train"}

    shuffled = list(range(40))
    random.Random(1).shuffle(shuffled)
    again = rows([f"p{i}" for i in shuffled], [str(i) for i in shuffled])
    other = curate([again], [val], template="tiny", max_prompt_length=99, count_tokens=char_count, val_size=5)
    assert {r.raw_problem for r in other.val} == {r.raw_problem for r in result.val}  # input order does not matter
    reseeded = curate(
        [train], [val], template="tiny", max_prompt_length=99, count_tokens=char_count, val_size=5, seed=7
    )
    assert {r.raw_problem for r in reseeded.val} != {r.raw_problem for r in result.val}


def test_val_size_must_leave_train_problems():
    src = rows(["a", "b", "c"], ["1", "2", "3"])
    with pytest.raises(ValueError, match=r"curation.val_size \(3\) must be smaller .* \(3\)"):
        curate([src], template="tiny", max_prompt_length=99, count_tokens=char_count, val_size=3)
    with pytest.raises(ValueError, match="must be >= 0"):
        curate([src], template="tiny", max_prompt_length=99, count_tokens=char_count, val_size=-1)


def test_only_kept_distinct_prompts_are_tokenised():
    seen: list[str] = []

    def counting(texts):
        seen.extend(texts)
        return [len(t) for t in texts]

    src = rows(["a", "a", "A", "b", "c"], ["1", "1", "1", "x", "3"])
    curate([src], template="tiny", max_prompt_length=99, count_tokens=counting)
    assert seen == ["Q: a", "Q: c"]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("42", "42"),
        ("-7", "-7"),
        ("$1,000$", "1000"),
        ("\\boxed{12}", "12"),
        ("x = 5", "5"),
        ("033", "033"),  # kept as the scorer normalises it (AIME style), never re-formatted
        ("3/4", None),
        ("\\frac{1}{2}", None),
        ("1.5", None),
        ("٤٢", None),  # non-ASCII digits: the scorer keeps them, DAPO's integer rule does not
        ("", None),
    ],
)
def test_integer_ground_truth(answer, expected):
    assert integer_ground_truth(answer) == expected


@given(st.text(alphabet="aAbB 1+\t\n", max_size=20), st.sampled_from([str.upper, str.lower, str.title]))
def test_problem_key_ignores_case_and_whitespace_runs(text, recase):
    assert problem_key(recase(text)) == problem_key(text)
    assert problem_key(f"  {text.replace(' ', '   ')}\n") == problem_key(text)


_values = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(["", " ", "1+1", "1 + 1", "ONE", "one", "Q: 2"]))
_answers = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(["1", "-2", "x", "1/2", " 3 ", "$4$", "1,000"]))


@given(st.lists(st.tuples(_values, _answers), max_size=40), st.integers(0, 3), st.integers(1, 8))
def test_counts_always_add_up_and_kept_rows_are_valid(pairs, val_size, max_len):
    problems, answers = [p for p, _ in pairs], [a for _, a in pairs]
    src = rows(problems, answers, templated=True)
    try:
        result = curate([src], template="tiny", max_prompt_length=max_len, count_tokens=char_count, val_size=val_size)
    except ValueError as exc:  # too few kept problems for the validation draw
        assert "val_size" in str(exc)
        return
    report = result.report
    assert report.rows_in == len(pairs) == len(result.train) + len(result.val) + sum(report.dropped.values())
    kept = result.train + result.val
    assert len({problem_key(r.raw_problem) for r in kept}) == len(kept)
    assert all(INTEGER_ANSWER.fullmatch(r.ground_truth) for r in kept)
    assert all(n <= max_len for n in result.prompt_lengths["train"] + result.prompt_lengths["val"])
    assert len(result.val) == val_size
