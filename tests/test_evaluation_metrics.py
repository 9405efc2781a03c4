"""dapo_core.evaluation.metrics against brute-force enumeration of k-subsets, plus canned texts."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.evaluation.metrics import (
    avg_at_k,
    compile_reflection_pattern,
    length_stats,
    maj_at_k,
    majority_vote,
    pass_at_k,
    pass_ks,
    reflection_rate,
    stop_class,
    stop_metrics,
    truncation_rate,
)

ABSTAIN = {"", "[INVALID]", "[ERROR]"}


def brute_pass_at_k(accs: list[bool], k: int) -> Fraction:
    """Share of k-subsets (of sample positions) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(len(accs)), k))
    return Fraction(sum(any(accs[i] for i in s) for s in subsets), len(subsets))


def brute_vote(preds: list[str], positions: tuple[int, ...]) -> str | None:
    """Majority over the valid answers at ``positions``; ties -> the answer seen first among ALL samples."""
    counts: dict[str, int] = {}
    for i in positions:
        if preds[i] not in ABSTAIN:
            counts[preds[i]] = counts.get(preds[i], 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return min((a for a, c in counts.items() if c == best), key=preds.index)


def brute_maj_at_k(preds: list[str], accs: list[bool], k: int) -> Fraction:
    correct = {p for p, a in zip(preds, accs, strict=True) if a}
    subsets = list(itertools.combinations(range(len(preds)), k))
    return Fraction(sum(brute_vote(preds, s) in correct for s in subsets), len(subsets))


@given(st.lists(st.booleans(), min_size=1, max_size=10), st.data())
def test_pass_at_k_equals_subset_enumeration(accs, data):
    k = data.draw(st.integers(1, len(accs)))
    assert pass_at_k(len(accs), sum(accs), k) == float(brute_pass_at_k(accs, k))


@given(st.integers(1, 3000), st.data())
def test_pass_at_k_large_n_is_the_closed_form_and_monotone(n, data):
    """Against the closed form 1 - C(n-c, k) / C(n, k), in exact integers (no float overflow at n = 3000), and the
    unbiased estimator's product form 1 - prod_{i=n-c+1..n} (1 - k/i) (Chen et al. 2021)."""
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    value = pass_at_k(n, c, k)
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert math.isfinite(value) and value == pytest.approx(float(exact), rel=1e-12, abs=1e-12)
    product = 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    assert value == pytest.approx(product, rel=1e-9, abs=1e-9)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the plain accuracy
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value


def test_pass_at_k_known_values():
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    # C(3000, 1500) ~ 1e901 overflows a float; exact integers give 1 - C(2999, 1500) / C(3000, 1500) = 1/2
    assert pass_at_k(3000, 1, 1500) == 0.5
    assert pass_at_k(3000, 2, 1500) == pytest.approx(1 - 1499 / 5998)


@pytest.mark.parametrize(("n", "c", "k", "match"), [(0, 0, 1, "n"), (4, 5, 1, "c"), (4, 1, 5, "k"), (4, 1, 0, "k")])
def test_pass_at_k_rejects_bad_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=rf"^{match} \("):
        pass_at_k(n, c, k)


answers = st.sampled_from(["1", "2", "3", "[INVALID]", "[ERROR]"])


@given(st.lists(answers, min_size=1, max_size=8), st.data())
def test_maj_at_k_equals_subset_enumeration(preds, data):
    truth = data.draw(st.sampled_from(["1", "2"]))
    accs = [p == truth for p in preds]
    k = data.draw(st.integers(1, len(preds)))
    assert maj_at_k(preds, accs, k) == float(brute_maj_at_k(preds, accs, k))


@given(st.lists(answers, min_size=1, max_size=7), st.data())
def test_maj_at_k_with_several_correct_answer_forms(preds, data):
    # a verifier may accept two forms of one answer ("1" and "3"): either winning counts as correct
    accs = [p in ("1", "3") for p in preds]
    k = data.draw(st.integers(1, len(preds)))
    assert maj_at_k(preds, accs, k) == float(brute_maj_at_k(preds, accs, k))


def test_maj_ties_go_to_the_answer_seen_first():
    # one "7" (correct) and one "5": the tie goes to whichever appears first in the sample order
    assert maj_at_k(["7", "5"], [True, False], 2) == 1.0
    assert maj_at_k(["5", "7"], [False, True], 2) == 0.0
    assert majority_vote(["5", "7", "7", "5"]) == "5"
    assert majority_vote(["[INVALID]", "7", "5", "5", "7"]) == "7"
    # deterministic: the same samples always give the same value
    preds, accs = ["3", "4", "4", "3", "[INVALID]", "9"], [False, True, True, False, False, False]
    assert len({maj_at_k(preds, accs, k) for _ in range(5) for k in [4]}) == 1
    assert maj_at_k(preds, accs, 6) == 0.0  # "3" and "4" tie at 2; "3" came first


def test_abstentions_do_not_vote():
    assert maj_at_k(["[INVALID]", "[INVALID]", "7"], [False, False, True], 3) == 1.0
    assert maj_at_k(["[INVALID]", "[ERROR]", ""], [False, False, False], 3) == 0.0
    assert majority_vote(["[INVALID]", "[ERROR]"]) is None
    # k=1: the single drawn sample must be a valid correct answer
    assert maj_at_k(["[INVALID]", "7", "7", "5"], [False, True, True, False], 1) == 0.5


def test_avg_and_ks():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32]
    assert pass_ks(8, [1, 4, 16, 32]) == [1, 4, 8]
    assert pass_ks(5) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match=r"ks \[0\] must be >= 1"):
        pass_ks(8, [0, 2])
    with pytest.raises(ValueError, match="at least one"):
        avg_at_k([])


CANNED = [
    ("Wait, that is wrong. 3+4=7\nAnswer: 7", True),
    ("Let me check: 12 - 5 = 7.\nAnswer: 7", True),
    ("We should verify the sum.\nAnswer: 9", True),
    ("I will re-examine the second step.", True),
    ("LET   ME\nCHECK again", True),  # any case, any whitespace between the words
    ("Let's double-check.", True),
    ("3+4=7\nAnswer: 7", False),
    ("We await the result; it was verified.", False),  # "await" and "verified" are other words
    ("The waiter checked the bill.", False),
    ("", False),
]


@pytest.mark.parametrize(("text", "reflective"), CANNED)
def test_reflection_pattern_on_canned_texts(text, reflective):
    assert bool(compile_reflection_pattern().search(text)) is reflective


def test_reflection_rate_and_custom_phrases():
    texts = [t for t, _ in CANNED]
    assert reflection_rate(texts) == pytest.approx(6 / 10)
    assert reflection_rate(texts, ["the waiter", "verified"]) == pytest.approx(2 / 10)
    assert reflection_rate([]) == 0.0
    with pytest.raises(ValueError, match="non-empty strings"):
        reflection_rate(texts, ["wait", "  "])


def test_length_and_truncation():
    assert length_stats([4, 8, 6]) == {"mean": 6.0, "max": 8.0, "min": 4.0}
    assert truncation_rate([True, False, False, False]) == 0.25
    with pytest.raises(ValueError, match="at least one response"):
        length_stats([])


@pytest.mark.parametrize(
    ("text", "cls"),
    [
        ("4+5=9\nAnswer: 9", "stopped"),
        ("4+5=9\nAnswer: 9\n", "stopped"),
        ("Answer:\n42", "stopped"),  # the scorer's \s* crosses the newline: 42 is the answer line's
        ("4+5=9\nAnswer: 9\nQ: 2+2?\nAnswer: 4", "run_on"),  # the scorer reads 4: the wrong question's
        ("Answer: 9 and then some more words", "stopped"),  # the rest of the answer line is the answer line
        ("Answer: 9\n2*3=6", "run_on"),
        ("4+5=9\nthe answer is 9", "no_answer"),
        ("", "no_answer"),
    ],
)
def test_stop_class_on_canned_texts(text, cls):
    assert stop_class(text) == cls


FORMS = {
    "stopped": "3*4=12\nAnswer: 12",
    "run_on": "3*4=12\nAnswer: 12\nQ: 1+1?\nAnswer: 2",
    "no_answer": "3*4=12",
}


@given(st.lists(st.tuples(st.sampled_from(sorted(FORMS)), st.booleans()), min_size=1, max_size=40))
def test_stop_metrics_split_the_accuracy(samples):
    """The rates are the classes' shares; accuracy = stopped_rate * acc_when_stopped + run_on_rate *
    acc_when_run_on when a response without an answer line is wrong (as the scorer has it)."""
    texts = [FORMS[c] for c, _ in samples]
    accs = [a and c != "no_answer" for c, a in samples]
    m = stop_metrics(texts, accs)
    n = len(samples)
    for cls in ("stopped", "run_on"):
        members = [a for (c, _), a in zip(samples, accs, strict=True) if c == cls]
        assert m[f"{cls}_rate"] == pytest.approx(len(members) / n)
        if members:
            assert m[f"acc_when_{cls}"] == pytest.approx(sum(members) / len(members))
        else:
            assert f"acc_when_{cls}" not in m
    split = sum(m[f"{c}_rate"] * m.get(f"acc_when_{c}", 0.0) for c in ("stopped", "run_on"))
    assert split == pytest.approx(sum(accs) / n)


def test_stop_metrics_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one entry per response"):
        stop_metrics(["Answer: 1"], [True, False])
    with pytest.raises(ValueError, match="at least one response"):
        stop_metrics([], [])
