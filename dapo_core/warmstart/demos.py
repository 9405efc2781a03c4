"""The warm start's problems: held-out and probe sets, and the stream of demonstrations it trains on.

A problem never trained on stays that way: every set is drawn from its own seeded stream and honours an exclusion
set of (normalised) questions. The demonstration stream is unlimited by default; ``sft_batches`` can limit it to a
fixed set, make the hard part scarce, or give a share of it a habit (``base_model.demos``: ``DemosConfig``, which
also checks the knobs' ranges). Prompt and target
token ids use the ``tiny`` template through the chat template, as the curated RL prompts do.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from dapo_core.config import DemosConfig
from dapo_core.data.synthetic import SyntheticProblem, generate_problems
from dapo_core.seeding import derive_seed

TINY_PROMPT = "Q: {question}"  # the `tiny` prompt template of the curated data (data.template = "tiny")
_STREAM_CHUNK = 1024  # problems drawn per derived seed in the SFT stream


def normalize_question(text: str) -> str:
    """The bare expression of a question: ``" Q: 71 - 57*6 "`` -> ``"71-57*6"`` (for exclusion matching)."""
    bare = "".join(text.split())
    return bare[2:] if bare.startswith("Q:") else bare


def exclusion_digest(exclude: Iterable[str]) -> str:
    """sha256 of the sorted, normalised, de-duplicated exclusion set (part of the stage's cache stamp)."""
    items = sorted({normalize_question(q) for q in exclude})
    return hashlib.sha256("\n".join(items).encode("utf-8")).hexdigest()


def _stream(seed: int, tag: str, min_ops: int, max_ops: int) -> Iterator[SyntheticProblem]:
    """An endless seeded stream of problems, drawn in chunks from seeds derived from (seed, tag, chunk)."""
    chunk = 0
    while True:
        yield from generate_problems(
            _STREAM_CHUNK, seed=derive_seed(seed, tag, chunk), min_ops=min_ops, max_ops=max_ops
        )
        chunk += 1


def heldout_problems(
    n: int,
    *,
    seed: int,
    min_ops: int,
    max_ops: int,
    exclude: Collection[str] = (),
    stream: str = "heldout",
) -> list[SyntheticProblem]:
    """``n`` distinct problems with ``min_ops`` to ``max_ops`` operations from the ``stream`` ("heldout", or
    "probe" for the target check) of ``seed``, none of them in ``exclude``."""
    banned = {normalize_question(q) for q in exclude}
    out: list[SyntheticProblem] = []
    seen: set[str] = set()
    for p in _stream(seed, stream, min_ops, max_ops):
        if len(out) >= n:
            break
        if p.question in banned or p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def demonstration_set(
    n: int, *, seed: int, min_ops: int, max_ops: int, exclude: Collection[str] = ()
) -> list[SyntheticProblem]:
    """The fixed set of ``n`` distinct demonstrations (worked solutions) a limited warm start may see: the first
    ``n`` distinct problems of the ``sft`` stream outside ``exclude``."""
    return heldout_problems(n, seed=seed, exclude=exclude, min_ops=min_ops, max_ops=max_ops, stream="sft")


def _epochs(pool: Sequence[SyntheticProblem], seed: int) -> Iterator[SyntheticProblem]:
    """The pool again and again, each epoch in its own seeded order."""
    epoch = 0
    while True:
        order = list(pool)
        random.Random(derive_seed(seed, "sft_epoch", epoch)).shuffle(order)
        yield from order
        epoch += 1


def _with_scarce(
    source: Iterator[SyntheticProblem],
    from_ops: int,
    count: int,
    *,
    seed: int,
    exclude: Collection[str],
    max_ops: int,
) -> Iterator[SyntheticProblem]:
    """``source`` with each problem of ``from_ops`` or more operations swapped for the next of a fixed pool of
    ``count`` (``DemosConfig`` checks ``from_ops <= max_ops`` and ``count >= 1``)."""
    pool = heldout_problems(count, seed=seed, exclude=exclude, min_ops=from_ops, max_ops=max_ops, stream="sft_scarce")
    scarce = _epochs(pool, derive_seed(seed, "scarce"))
    for p in source:
        yield next(scarce) if p.num_ops >= from_ops else p


SHORTCUT_STYLES = ("answer_only", "answer_first")


def shortcut_demo(problem: SyntheticProblem, style: str) -> SyntheticProblem:
    """The same problem demonstrated with its answer given before (or without) the work.

    ``answer_only``: the response is the answer line alone. ``answer_first``: the answer line first, then the
    worked lines (the answer is stated before it is worked out; the scorer reads that line)."""
    *work, answer = problem.solution.splitlines()
    if style == "answer_only":
        return replace(problem, solution=answer)
    if style == "answer_first":
        return replace(problem, solution="\n".join([answer, *work]))
    raise ValueError(f"unknown shortcut style {style!r}; valid: {', '.join(SHORTCUT_STYLES)}")


def _with_shortcuts(
    source: Iterator[SyntheticProblem], frac: float, *, seed: int, style: str
) -> Iterator[SyntheticProblem]:
    """``source`` with a seeded share ``frac`` of its problems turned into shortcut demonstrations."""
    rng = random.Random(derive_seed(seed, "shortcut"))
    for p in source:
        yield shortcut_demo(p, style) if rng.random() < frac else p


RUN_ON_STYLES = ("worked", "answer_only")


def run_on_demo(problem: SyntheticProblem, following: SyntheticProblem, style: str) -> SyntheticProblem:
    """``problem`` demonstrated as a worksheet goes on: after its answer line come the next question (in the prompt
    template) and that question's worked solution (``worked``) or only its answer line (``answer_only``). The
    scorer reads the last answer line, so a policy that writes this is scored on the wrong question (or runs into
    the length limit)."""
    tail = TINY_PROMPT.format(question=following.question)
    if style == "worked":
        rest = following.solution
    elif style == "answer_only":
        rest = following.solution.splitlines()[-1]
    else:
        raise ValueError(f"unknown run_on_style {style!r}; valid: {', '.join(RUN_ON_STYLES)}")
    return replace(problem, solution=f"{problem.solution}\n{tail}\n{rest}")


def _with_run_ons(
    source: Iterator[SyntheticProblem], frac: float, *, seed: int, style: str
) -> Iterator[SyntheticProblem]:
    """``source`` with a seeded share ``frac`` of its problems going on to the problem that follows them."""
    rng = random.Random(derive_seed(seed, "run_on"))
    for p in source:
        yield run_on_demo(p, next(source), style) if rng.random() < frac else p


CHECK_PREFIX = "check "  # starts a check line, e.g. "check 6*57=342" for "57*6=342" (see ``check_line``)


def check_line(step_line: str) -> str:
    """The check of one worked line ``"l op r=res"``: its inverse (``res-r=l`` for +, ``res+r=l`` for -) or, for
    a product, the factors swapped (``r*l=res``); e.g. ``"57*6=342"`` -> ``"check 6*57=342"``."""
    expr, eq, res = step_line.partition("=")
    for op, inverse in (("*", None), ("+", "-"), ("-", "+")):
        left, sep, right = expr.rpartition(op)
        if eq and sep and left and left[-1].isdigit():  # the operator between the operands (not a leading minus sign)
            if inverse is None:
                return f"{CHECK_PREFIX}{right}*{left}={res}"
            return f"{CHECK_PREFIX}{res}{inverse}{right}={left}"
    raise ValueError(f"not a worked step line {step_line!r} (expected e.g. '57*6=342')")


def check_demo(problem: SyntheticProblem) -> SyntheticProblem:
    """The same problem demonstrated with a check of every worked line before the answer line: the answer is
    unchanged, the response about twice as long, so how long to write is the policy's choice: with checks a
    4-operation answer is 95-133 tokens and a 3-operation one 73-101 (93% over 80), against at most 61 without."""
    *work, answer = problem.solution.splitlines()
    return replace(problem, solution="\n".join([*work, *(check_line(line) for line in work), answer]))


def _with_checks(source: Iterator[SyntheticProblem], frac: float, *, seed: int) -> Iterator[SyntheticProblem]:
    """``source`` with a seeded share ``frac`` of its problems demonstrated with check lines (``check_demo``)."""
    rng = random.Random(derive_seed(seed, "check"))
    for p in source:
        yield check_demo(p) if rng.random() < frac else p


def sft_batches(
    batch_size: int, demos: DemosConfig, *, seed: int, exclude: Collection[str] = ()
) -> Iterator[list[SyntheticProblem]]:
    """Endless seeded batches of training problems as ``demos`` (``base_model.demos``) describes them; questions
    in ``exclude`` (normalised) never appear. Each problem has ``min_ops`` to ``max_ops`` operations.

    ``num_demos`` None: a fresh problem every time (an unlimited supply of demonstrations). ``num_demos`` N: the
    fixed ``demonstration_set`` of N problems, cycled in seeded epochs (a limited supply, as in the paper's
    setting where RL has problems and a verifier but no worked solutions).

    ``scarce_from_ops`` K: every problem with K or more operations is replaced by the next of a fixed set of
    ``scarce_demos`` such problems (cycled in seeded epochs): the hard part of the task has only a few worked
    solutions, seen as often as the rest of the range, while the easier part has an unlimited supply.

    ``shortcut_frac`` f: a seeded share f of the demonstrations state the answer line (``Answer: N``) without
    working it out first: the answer alone (``shortcut_style`` ``answer_only``) or the answer line followed by
    the worked lines (``answer_first``); see ``shortcut_demo``.

    ``run_on_frac`` r: a seeded share r of the demonstrations do not stop after their answer line but go on to the
    next problem of the stream, as worksheets and documents of many problems do: its question, then its worked
    solution (``run_on_style`` ``worked``) or its answer line only (``answer_only``); see ``run_on_demo``. The
    problem they go on to is used up there.

    ``check_frac`` c: a seeded share c of the (worked) demonstrations check each worked line before the answer line
    (``check_demo``): their length is a choice the policy inherits, and with checks hard problems pass the length
    limit. Applied before shortcuts and run-ons."""
    d = demos
    if d.num_demos is not None:
        pool = demonstration_set(d.num_demos, seed=seed, exclude=exclude, min_ops=d.min_ops, max_ops=d.max_ops)
        source: Iterator[SyntheticProblem] = _epochs(pool, seed)
    else:
        banned = {normalize_question(q) for q in exclude}
        source = (p for p in _stream(seed, "sft", d.min_ops, d.max_ops) if p.question not in banned)
    if d.scarce_from_ops is not None:
        source = _with_scarce(source, d.scarce_from_ops, d.scarce_demos, seed=seed, exclude=exclude, max_ops=d.max_ops)
    if d.check_frac > 0:
        source = _with_checks(source, d.check_frac, seed=seed)
    if d.shortcut_frac > 0:
        source = _with_shortcuts(source, d.shortcut_frac, seed=seed, style=d.shortcut_style)
    if d.run_on_frac > 0:
        source = _with_run_ons(source, d.run_on_frac, seed=seed, style=d.run_on_style)
    batch: list[SyntheticProblem] = []
    for p in source:
        batch.append(p)
        if len(batch) == batch_size:
            yield batch
            batch = []


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Token ids of the chat-templated ``tiny`` prompt, e.g. ``"Q: 71-57*6<|im_end|><|im_start|>"``."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": TINY_PROMPT.format(question=question)}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def response_ids(tokenizer: PreTrainedTokenizerBase, solution: str) -> list[int]:
    """Token ids of the target response: the worked solution, then EOS (so the model learns to stop)."""
    return [*tokenizer.encode(solution, add_special_tokens=False), int(tokenizer.eos_token_id)]
