"""The synthetic arithmetic task of the CPU default: integer answers, worked solutions, seeded and byte-stable.

A problem is an expression of 1-4 operations over ``+ - *`` (e.g. ``71-57*6``). Its worked solution does the
multiplications first, then the additions/subtractions left to right, one line per operation, and ends with the
DAPO answer line::

    57*6=342
    71-342=-271
    Answer: -271

So the solution length grows with the number of operations (the difficulty), which gives the length-dependent
conditions DAPO's token-level loss and overlong shaping act on.

Rules (from the feasibility probe): operands 1-99, the right operand of ``*`` (the multiplier) 2-9, every
intermediate result within +-999 (draws that break it are redrawn). Only ``random.Random(seed)`` is used (no
``hash()``, no global state), so ``generate_problems(n, seed=s)`` is the same list on every platform, and
``write_raw_jsonl`` writes the same bytes.

Generate and write the raw file that ``dapo data generate`` / curation read::

    problems = generate_problems(1000, seed=42)
    write_raw_jsonl(problems, "data/synthetic.jsonl")
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dapo_core.data.schema import ProblemRecord

logger = logging.getLogger(__name__)

OPERATORS: tuple[str, ...] = ("+", "-", "*")
OPERAND_RANGE: tuple[int, int] = (1, 99)  # left operands and the operands of + and -
MULTIPLIER_RANGE: tuple[int, int] = (2, 9)  # the right operand of every *
MAX_ABS_INTERMEDIATE = 999  # every step's result stays within +-999
ANSWER_PREFIX = "Answer: "  # the DAPO answer line the math_dapo scorer reads
_MAX_DRAWS_PER_PROBLEM = 10_000  # redraws are rare (a few percent); this only guards against a broken range


@dataclass(frozen=True)
class SyntheticProblem:
    """One arithmetic problem: the bare expression, its worked solution (ending in ``Answer: N``) and N."""

    question: str
    solution: str
    answer: int

    @property
    def num_ops(self) -> int:
        """Number of operations (= solution lines before the answer line)."""
        return sum(self.question.count(op) for op in OPERATORS)


def _tokenize(question: str) -> tuple[list[int], list[str]]:
    """Split ``"71-57*6"`` into operands ``[71, 57, 6]`` and operators ``["-", "*"]``; strict, never eval."""
    operands: list[int] = []
    ops: list[str] = []
    digits = ""
    for pos, ch in enumerate(question):
        if ch.isdigit() and ch.isascii():
            digits += ch
        elif ch in OPERATORS and digits:
            operands.append(int(digits))
            ops.append(ch)
            digits = ""
        else:
            raise ValueError(
                f"question {question!r}: unexpected {ch!r} at position {pos}; expected non-negative integers "
                f"joined by one of {''.join(OPERATORS)} (e.g. '71-57*6'), no spaces or brackets"
            )
    if not digits:
        raise ValueError(f"question {question!r} must end with an integer operand (e.g. '71-57*6')")
    operands.append(int(digits))
    return operands, ops


def _steps(operands: list[int], ops: list[str]) -> tuple[list[tuple[int, str, int, int]], int]:
    """The solution's steps ``(left, op, right, result)``: each product left to right, then +/- left to right."""
    steps: list[tuple[int, str, int, int]] = []
    terms: list[int] = [operands[0]]  # one value per additive term, after its multiplications
    signs: list[str] = []
    for op, right in zip(ops, operands[1:], strict=True):
        if op == "*":
            left = terms[-1]
            terms[-1] = left * right
            steps.append((left, op, right, terms[-1]))
        else:
            signs.append(op)
            terms.append(right)
    value = terms[0]
    for op, right in zip(signs, terms[1:], strict=True):
        result = value + right if op == "+" else value - right
        steps.append((value, op, right, result))
        value = result
    return steps, value


def _format_solution(steps: list[tuple[int, str, int, int]], answer: int) -> str:
    lines = [f"{left}{op}{right}={result}" for left, op, right, result in steps]
    lines.append(f"{ANSWER_PREFIX}{answer}")
    return "\n".join(lines)


def solve(question: str) -> tuple[str, int]:
    """The worked solution and the integer answer of ``question`` (``"71-57*6"`` -> (``"57*6=342\\n..."``, -271)).

    Multiplication binds tighter than ``+``/``-``, which associate to the left (ordinary arithmetic). Raises
    ``ValueError`` for text that is not such an expression.
    """
    operands, ops = _tokenize(question)
    steps, answer = _steps(operands, ops)
    return _format_solution(steps, answer), answer


def _draw(rng: random.Random, num_ops: int) -> tuple[list[int], list[str]]:
    ops = [rng.choice(OPERATORS) for _ in range(num_ops)]
    operands = [rng.randint(*OPERAND_RANGE)]
    for op in ops:
        operands.append(rng.randint(*(MULTIPLIER_RANGE if op == "*" else OPERAND_RANGE)))
    return operands, ops


def _one_problem(rng: random.Random, num_ops: int) -> SyntheticProblem:
    for _ in range(_MAX_DRAWS_PER_PROBLEM):
        operands, ops = _draw(rng, num_ops)
        steps, answer = _steps(operands, ops)
        if all(abs(result) <= MAX_ABS_INTERMEDIATE for *_, result in steps):
            question = "".join(f"{a}{op}" for a, op in zip(operands, ops, strict=False)) + str(operands[-1])
            return SyntheticProblem(question=question, solution=_format_solution(steps, answer), answer=answer)
    raise RuntimeError(  # unreachable with the module's ranges; kept so a bad edit fails loudly
        f"no expression with {num_ops} operations kept intermediates within +-{MAX_ABS_INTERMEDIATE} "
        f"after {_MAX_DRAWS_PER_PROBLEM} draws: widen MAX_ABS_INTERMEDIATE or narrow the operand ranges"
    )


def generate_problems(n: int, *, seed: int, min_ops: int = 1, max_ops: int = 4) -> list[SyntheticProblem]:
    """``n`` problems drawn from ``random.Random(seed)``; the operation count is uniform on [min_ops, max_ops].

    Deterministic for (n, seed, min_ops, max_ops), and a prefix-stable stream: the first k problems of
    ``generate_problems(n, ...)`` are ``generate_problems(k, ...)``. Duplicates are possible (curation removes
    them); callers that need problems disjoint from a set filter by ``question``.
    """
    if n < 0:
        raise ValueError(f"n ({n}) must be >= 0: it is the number of problems to generate")
    if not 1 <= min_ops <= max_ops:
        raise ValueError(
            f"min_ops ({min_ops}) and max_ops ({max_ops}) must satisfy 1 <= min_ops <= max_ops: "
            "every problem has at least one operation (the default range is 1-4)"
        )
    rng = random.Random(seed)
    return [_one_problem(rng, rng.randint(min_ops, max_ops)) for _ in range(n)]


def synthetic_records(problems: Iterable[SyntheticProblem], data_source: str = "synthetic") -> list[ProblemRecord]:
    """verl records of ``problems``, prompted with the ``tiny`` template (``Q: <question>``) and indexed in order,
    as the curated synthetic data is (for fixtures and probe sets written without a curation run)."""
    return [
        ProblemRecord(
            data_source=data_source,
            prompt=[{"role": "user", "content": f"Q: {p.question}"}],
            ground_truth=str(p.answer),
            index=i,
            raw_problem=p.question,
        )
        for i, p in enumerate(problems)
    ]


def problem_to_json_line(problem: SyntheticProblem) -> str:
    """One raw-file line: ``{"answer": "-271", "problem": "71-57*6", "solution": "..."}`` (sorted keys, ASCII)."""
    row = {"answer": str(problem.answer), "problem": problem.question, "solution": problem.solution}
    return json.dumps(row, sort_keys=True, ensure_ascii=True, separators=(", ", ": ")) + "\n"


def write_raw_jsonl(problems: Iterable[SyntheticProblem], path: str | os.PathLike[str]) -> Path:
    """Write one JSON object per line (sorted keys: answer as a string, problem, solution); same input, same bytes.

    The file is written through a temporary sibling and renamed, so a crash never leaves a half-written raw file
    that DVC would record. Returns the path.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    count = 0
    with open(tmp, "wb") as f:
        for problem in problems:
            f.write(problem_to_json_line(problem).encode("ascii"))
            count += 1
    os.replace(tmp, out)
    logger.info("wrote %d synthetic problems to %s", count, out)
    return out
