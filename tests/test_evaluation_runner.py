"""The evaluation runner with a scripted executor (canned completions) on the published AIME-2024 file."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import pytest
from _tiny import plain_sampling
from conftest_data import aime_path

from dapo_core.algorithm.metric_names import val_metric
from dapo_core.data.schema import ProblemRecord, read_rl_parquet
from dapo_core.engines.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutResult, SamplingConfig
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.evaluation import dedupe_problems, encode_prompt, evaluate
from dapo_core.rewards import score_batch

K = 4
MAX_NEW = 64


@pytest.fixture(scope="module")
def aime() -> list[ProblemRecord]:
    return read_rl_parquet(aime_path())  # skips (fails under CI) when the file is missing


def script(index: int, sample: int, truth: str) -> tuple[str, bool]:
    """Canned completion j of problem ``index``: the first ``index % 5`` samples are right; the wrong ones all say
    truth+1 (even index) or give no answer and run out of tokens (odd index). Sample 0 of every third problem
    reflects."""
    right = index % 5
    prefix = "Wait, let me check. " if index % 3 == 0 and sample == 0 else ""
    if sample < right:
        return f"{prefix}So\nAnswer: {truth}", False
    if index % 2 == 0:
        return f"{prefix}So\nAnswer: {int(truth) + 1}", False
    return f"{prefix}I am not sure", True


class ScriptedExecutor:
    """Returns ``script(...)`` for each (prompt, sample); remembers the prompts it was asked to sample."""

    def __init__(self, problems_by_prompt: dict[tuple[int, ...], ProblemRecord]) -> None:
        self.tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
        self.by_prompt = problems_by_prompt
        self.calls: list[tuple[int, SamplingConfig]] = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        out = []
        for i, ids in enumerate(prompts):
            rec = self.by_prompt[tuple(ids)]
            for j in range(sampling.n):
                text, cut = script(rec.index, j, rec.ground_truth)
                length = sampling.max_new_tokens if cut else len(text) + 1
                out.append(
                    RolloutResult(
                        prompt_index=i, sample_index=j, prompt_ids=list(ids), response_ids=[5] * length,
                        response_length=length, truncated=cut, finish_reason=FINISH_LENGTH if cut else FINISH_STOP,
                        log_probs=None, text=text,
                    )
                )  # fmt: skip
        return out[::-1]  # any order: the runner sorts by (prompt, sample)

    def score(self, completions, ground_truths):
        return score_batch("math_dapo", completions, ground_truths)


def brute_maj(preds: list[str], correct: str, k: int) -> Fraction:
    """Majority vote over every k-subset; ties -> the answer first seen among all samples."""
    hits = 0
    subsets = list(itertools.combinations(range(len(preds)), k))
    for s in subsets:
        votes = [preds[i] for i in s if preds[i] is not None]
        if votes:
            best = max(votes.count(v) for v in votes)
            winner = min({v for v in votes if votes.count(v) == best}, key=preds.index)
            hits += winner == correct
    return Fraction(hits, len(subsets))


def expected_for(rec: ProblemRecord, k: int) -> dict[str, float]:
    right = rec.index % 5
    texts = [script(rec.index, j, rec.ground_truth) for j in range(K)]
    preds = [rec.ground_truth if j < right else (None if cut else "x") for j, (_, cut) in enumerate(texts)]
    return {
        "mean": right / K,
        "pass": 1 - comb(K - right, k) / comb(K, k),
        "maj": float(brute_maj(preds, rec.ground_truth, k)),
    }


def test_aime_is_deduplicated_to_30_problems(aime):
    assert len(aime) == 960
    unique = dedupe_problems(aime)
    assert len(unique) == 30 and {u.copies for u in unique} == {32}
    assert sorted(u.record.index for u in unique) == list(range(30))


def test_scripted_rollouts_give_exact_metrics(aime):
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    unique = [u.record for u in dedupe_problems(aime)]
    by_prompt = {tuple(encode_prompt(tok, r.prompt)[0]): r for r in unique}
    assert len(by_prompt) == 30
    ex = ScriptedExecutor(by_prompt)
    sampling = plain_sampling(n=99, temperature=1.0, top_p=0.7, max_new_tokens=MAX_NEW, seed=0)
    report = evaluate(ex, aime, k=K, sampling=sampling, seed=1234, ks=[1, 2, 8])

    # one generate call with the 30 unique prompts x k samples (not 960 x k), at the given seed and top_p
    assert [(n, s.n, s.seed, s.top_p) for n, s in ex.calls] == [(30, K, 1234, 0.7)]
    assert report.ks == [1, 2, 4] and report.n == K and report.num_rows == 960 and len(report.problems) == 30
    m = report.metrics
    exp = {rec.index: {k: expected_for(rec, k) for k in report.ks} for rec in unique}
    mean = lambda kind, k: sum(e[k][kind] for e in exp.values()) / 30  # noqa: E731
    assert m[val_metric("math_dapo", "mean", K)] == pytest.approx(mean("mean", K), abs=1e-12)
    assert m[val_metric("math_dapo", "mean", K)] == pytest.approx((0 + 1 + 2 + 3 + 4) / 5 / K, abs=1e-12)
    for k in report.ks:
        assert m[val_metric("math_dapo", "pass", k)] == pytest.approx(mean("pass", k), abs=1e-12)
        assert m[val_metric("math_dapo", "maj", k)] == pytest.approx(mean("maj", k), abs=1e-12)
    # hand-checked maj@4: even index -> correct iff >= 2 right of 4 (2-2 ties go to the first-seen right answer);
    # odd index -> wrong ones abstain, correct iff >= 1 right
    maj4 = sum((i % 5 >= 2) if i % 2 == 0 else (i % 5 >= 1) for i in range(30)) / 30
    assert m[val_metric("math_dapo", "maj", K)] == pytest.approx(maj4, abs=1e-12)

    # per problem: ground truth, counts, majority answer
    for p in report.problems:
        index = int(p.uid.split(":")[1])
        assert p.num_correct == index % 5 and p.copies == 32 and p.n == K
        assert p.pass_at[1] == pytest.approx(exp[index][1]["pass"])
    # lengths, truncation (odd index, wrong samples run out of tokens) and reflection (sample 0 of every 3rd)
    cut = sum(K - i % 5 for i in range(30) if i % 2 == 1)
    assert m["val/math_dapo/response_length/clip_ratio"] == pytest.approx(cut / (30 * K))
    assert m["val/math_dapo/response_length/max"] == MAX_NEW
    assert m["val/math_dapo/reflection_rate"] == pytest.approx(10 / (30 * K))
    assert m["val/math_dapo/num_problems"] == 30
    # the stop split: every scripted answer ends its response (none runs on); the cut ones give no answer line
    answered = 30 * K - cut
    assert m["val/math_dapo/stop/stopped_rate"] == pytest.approx(answered / (30 * K))
    assert m["val/math_dapo/stop/run_on_rate"] == 0.0 and "val/math_dapo/stop/acc_when_run_on" not in m
    assert m["val/math_dapo/stop/acc_when_stopped"] == pytest.approx(sum(i % 5 for i in range(30)) / answered)
    rows = report.rows()
    assert len(rows) == 30 and {"uid", "pass_at_1", "maj_at_4", "maj_pred", "sample_text"} <= set(rows[0])


def test_reward_fn_override_and_prompt_ids(aime):
    """A named reward replaces executor.score; pre-tokenized prompts (the train flow's) skip encoding."""
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    records = aime[:64]
    ids = [encode_prompt(tok, r.prompt)[0] for r in records]
    by_prompt = {tuple(i): r for i, r in zip(ids, records, strict=True)}
    ex = ScriptedExecutor(by_prompt)
    ex.score = None  # must not be called
    sampling = plain_sampling(max_new_tokens=MAX_NEW)
    report = evaluate(ex, records, k=2, sampling=sampling, reward_fn="math_dapo", seed=0, prompt_ids=ids)
    assert len(report.problems) == len(dedupe_problems(records))


def test_prompts_are_left_truncated():
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    full, cut = encode_prompt(tok, [{"role": "user", "content": "Q: 12+30"}])
    assert not cut and tok.decode(full) == "Q: 12+30<|im_end|><|im_start|>"
    short, cut = encode_prompt(tok, [{"role": "user", "content": "Q: 12+30"}], max_prompt_length=4)
    assert cut and short == full[-4:]


def test_conflicting_duplicates_and_empty_input_are_errors():
    a = ProblemRecord("src", [{"role": "user", "content": "Q"}], "1", index=0, raw_problem="what is x")
    b = ProblemRecord("src", [{"role": "user", "content": "Q"}], "2", index=1, raw_problem="what is x")
    with pytest.raises(ValueError, match="another ground truth"):
        dedupe_problems([a, b])
    with pytest.raises(ValueError, match="records is empty"):
        evaluate(ScriptedExecutor({}), [], k=2, sampling=plain_sampling(), seed=0)
