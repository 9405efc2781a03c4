"""Hostile model output: every registered scorer, fed >= 10,000 generated strings and crafted worst cases, never
raises, never takes more than 2 s on one item, never executes anything, and always answers +1/-1.

Worst case measured before this test: 0.27 s for a 1M-character ground truth (the bound keeps a wide margin on a
busy 2-core machine). Per-item times of the crafted cases are printed (``pytest -s``) for
benchmarks/results/reliability.md.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.rewards import available_rewards, get_reward_fn

pytestmark = pytest.mark.slow

ITEM_LIMIT_S = 2.0
EXAMPLES = 10_000
# the shipped scorers (tests register toy rewards named test_* in the same registry: not what model output meets)
SCORERS = [name for name in available_rewards() if not name.startswith("test_")]
FRAGMENTS = [
    "Answer:", "answer :", "Answer: ", "\\boxed{", "\\fbox{", "{", "}", "$", "\\frac", "sqrt", "\\text{", "=",
    "^", "10^10^10", "1e999999", "-", ",", ".", "0", "9" * 40, "\n", "\x00", "\x1b[31m", "\u202e", "\ud7ff", "π",
    "__import__('os').system('touch PWNED')", "${jndi:ldap://x}", "`rm -rf /`", "eval(", "\\\\", "\\left(", ")",
]  # fmt: skip
hostile_text = st.one_of(
    st.text(max_size=400),  # any code points, NUL and control characters included
    st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=8), max_size=60).map("".join),
)


def _check(fn, completion: str, ground_truth: str) -> float:
    t0 = time.perf_counter()
    out = fn(completion, ground_truth)
    took = time.perf_counter() - t0
    assert out["score"] in (1.0, -1.0) and out["acc"] is (out["score"] > 0) and isinstance(out["pred"], str)
    assert took < ITEM_LIMIT_S, f"{took:.2f}s on a {len(completion)}-char completion / {len(ground_truth)}-char truth"
    return took


# a right answer in the scorer's own format, after hostile text: the answer is an integer or a LaTeX fraction
answers = st.integers(-(10**30), 10**30).map(str) | st.tuples(st.integers(1, 999), st.integers(1, 999)).map(
    lambda ab: f"\\frac{{{ab[0]}}}{{{ab[1]}}}"
)
_MARKERS = re.compile(r"(?i)answer|\\boxed")  # the prefix must not carry an answer of its own


def right_answer(name: str, prefix: str, answer: str) -> str:
    """``prefix`` (hostile text, its answer markers cut out) then ``answer`` the way ``name`` reads it: the last
    ``Answer:`` line (math_dapo) or the last ``\\boxed{}`` (boxed)."""
    while _MARKERS.search(prefix):  # cutting one out may join the text around it into another
        prefix = _MARKERS.sub("", prefix)
    return f"{prefix}\nAnswer: {answer}" if name == "math_dapo" else f"{prefix} so \\boxed{{{answer}}}"


@pytest.mark.parametrize("name", SCORERS)
@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(completion=hostile_text, ground_truth=hostile_text, answer=answers, right=st.booleans())
def test_generated_hostile_strings(name, completion, ground_truth, answer, right):
    """Half the generated items hide a right answer behind hostile text: those must score +1 (a scorer answering
    -1 to everything fails here), and the same completion against another truth -1 (one answering +1 fails)."""
    fn = get_reward_fn(name)
    if not right:
        _check(fn, completion, ground_truth)
        return
    text = right_answer(name, completion, answer)
    assert _check(fn, text, answer) >= 0 and fn(text, answer)["score"] == 1.0, (text[-80:], answer)
    assert fn(text, answer + "1")["score"] == -1.0, (text[-80:], answer)


def crafted_cases() -> dict[str, tuple[str, str]]:
    five_mb = "Answer: 7\n" * (5 * 2**20 // 10)
    return {
        "huge number": ("Answer: " + "9" * 100_000, "9" * 100_000),
        "10^10^10": ("Answer: 10^10^10", "10^10^10"),
        "1e999999999": ("Answer: 1e999999999", "1e999999999"),
        "deep boxed nesting": ("\\boxed{" * 100_000 + "1" + "}" * 100_000, "1"),
        "unbalanced braces": ("\\boxed{" + "{" * 200_000 + "Answer: {", "}" * 1000),
        "NUL and control bytes": ("Answer: \x00\x01\x02\x1b[2J\x7f" * 10_000, "\x00"),
        "5 MB completion": (five_mb, "7"),
        "5 MB of one line": ("Answer: " + "x" * 5 * 2**20, "x"),
        "1M-char ground truth": ("Answer: 1", "1" * 2**20),
        "code-like text": ("Answer: __import__('os').system('touch PWNED')", "__import__('os').system('touch PWNED')"),
        "many answer lines": ("Answer: 1\n" * 500_000, "1"),
        "latex soup": ("Answer: " + "\\frac{\\sqrt{" * 50_000 + "}}" * 50_000, "\\frac12"),
    }


@pytest.mark.parametrize("name", SCORERS)
def test_crafted_worst_cases(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a scorer that executed "touch PWNED" would leave the file here
    fn = get_reward_fn(name)
    times = {case: _check(fn, c, g) for case, (c, g) in crafted_cases().items()}
    assert not (Path(tmp_path) / "PWNED").exists()
    with capsys.disabled():
        worst = max(times, key=times.get)
        print(
            f"\n{name}: worst crafted case {worst!r} {times[worst]:.3f}s; "
            + ", ".join(f"{k} {v:.3f}s" for k, v in times.items())
        )
    # the scorer still works after all that: a right answer scores +1, a wrong one -1 (it is not refusing everything)
    right = "blah\nAnswer: 42" if name == "math_dapo" else "so \\boxed{42}"
    assert fn(right, "42")["score"] == 1.0 and fn(right, "43")["score"] == -1.0
