"""Evaluate a policy on a problem set: sample k responses per unique problem, score them, compute the metrics.

Used by the evaluate flow (a model on a file) and by the train flow's periodic validation (the live policy):

    report = evaluate(executor, read_rl_parquet("aime-2024.parquet"), k=32,
                      sampling=SamplingConfig.from_config(cfg.rollout, max_new_tokens=20480, seed=0, validation=True),
                      seed=1234)
    report.metrics["val/math_dapo/acc/mean_at_32"]      # avg@32, the paper's AIME number
    report.rows()                                      # one dict per problem (an MLflow table)

Problems are de-duplicated first: AIME-2024 as published by the DAPO authors repeats each of its 30 problems 32
times (960 rows), so evaluating rows would cost 960 x k generations for the same avg@k. A problem's identity is
its data source plus its raw problem text (``extra_info.raw_problem``), or its prompt messages when the raw text
is missing; uids (``data_source:index``) are not used alone because indices restart in every file. Copies must
agree on the ground truth.

Metric names (per data source; docs/design.md, "Metric names"): ``val/<ds>/acc/mean_at_<n>``, ``pass_at_<k>`` and
``maj_at_<k>`` for each reported k, and ``val/<ds>/response_length/{mean,max,min,clip_ratio}``,
``val/<ds>/reflection_rate``, ``val/<ds>/num_problems``, and the stop split ``val/<ds>/stop/{stopped_rate,
run_on_rate,acc_when_stopped,acc_when_run_on}`` (``metrics.stop_metrics``: how much of the accuracy is stopping at
the answer line and how much is arithmetic).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dapo_core.algorithm.metric_names import key_segment, val_metric
from dapo_core.data.schema import ProblemRecord
from dapo_core.engines.rollout.base import RolloutResult, SamplingConfig
from dapo_core.evaluation.metrics import (
    DEFAULT_PASS_KS,
    DEFAULT_REFLECTION_PHRASES,
    avg_at_k,
    compile_reflection_pattern,
    has_reflection,
    length_stats,
    maj_at_k,
    majority_vote,
    pass_at_k,
    pass_ks,
    stop_metrics,
    truncation_rate,
)
from dapo_core.evaluation.problems import UniqueProblem, dedupe_problems, encode_problems
from dapo_core.rewards import ScoredBatch, score_batch

logger = logging.getLogger(__name__)

SAMPLE_TEXT_CHARS = 2000
"""Characters of the first response kept per problem for the results table."""


class EvalExecutor(Protocol):
    """What evaluation needs from an executor (``LocalExecutor`` and the Ray one provide it; tests script it)."""

    @property
    def tokenizer(self) -> Any: ...

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> list[RolloutResult]: ...

    def score(self, completions: Sequence[str], ground_truths: Sequence[str]) -> ScoredBatch: ...


@dataclass
class ProblemResult:
    """Outcome of the n samples of one unique problem."""

    uid: str
    data_source: str
    ground_truth: str
    copies: int
    n: int
    num_correct: int
    mean_acc: float  # avg@n of this problem
    pass_at: dict[int, float]
    maj_at: dict[int, float]
    maj_pred: str | None
    preds: list[str]
    mean_response_length: float
    truncation_rate: float
    reflection_rate: float
    sample_text: str  # the first response, cut to SAMPLE_TEXT_CHARS

    def row(self) -> dict[str, Any]:
        """Flat dict for a results table (one column per pass@k / maj@k)."""
        out: dict[str, Any] = {
            "uid": self.uid,
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "copies": self.copies,
            "n": self.n,
            "num_correct": self.num_correct,
            "mean_acc": self.mean_acc,
        }
        out.update({f"pass_at_{k}": v for k, v in self.pass_at.items()})
        out.update({f"maj_at_{k}": v for k, v in self.maj_at.items()})
        out.update(
            maj_pred=self.maj_pred if self.maj_pred is not None else "",
            preds=json.dumps(self.preds),
            mean_response_length=self.mean_response_length,
            truncation_rate=self.truncation_rate,
            reflection_rate=self.reflection_rate,
            sample_text=self.sample_text,
        )
        return out


@dataclass
class EvalReport:
    """Per-problem results and per-data-source metrics (full MLflow keys) of one evaluation."""

    problems: list[ProblemResult]
    metrics: dict[str, float]
    n: int
    ks: list[int]
    seed: int
    num_rows: int
    num_failed: int = 0
    num_prompts_truncated: int = 0
    data_sources: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [p.row() for p in self.problems]

    def mean_acc(self, data_source: str | None = None) -> float:
        """avg@n over the problems of ``data_source`` (all problems when None)."""
        chosen = [p.mean_acc for p in self.problems if data_source in (None, p.data_source)]
        if not chosen:
            raise ValueError(f"no problems of data source {data_source!r}; present: {self.data_sources}")
        return sum(chosen) / len(chosen)


def val_key(data_source: str, name: str) -> str:
    """``val/<data_source>/<name>`` for the non-accuracy validation metrics (any data source name gives a valid
    MLflow key: ``metric_names.key_segment``)."""
    return f"val/{key_segment(data_source)}/{name}"


def _problem_result(
    problem: UniqueProblem,
    results: Sequence[RolloutResult],
    scores: Sequence[dict[str, Any]],
    ks: Sequence[int],
    reflective: Sequence[bool],
) -> ProblemResult:
    accs = [bool(s["acc"]) for s in scores]
    preds = [str(s.get("pred", "")) for s in scores]
    n = len(results)
    rec = problem.record
    return ProblemResult(
        uid=rec.uid,
        data_source=rec.data_source,
        ground_truth=rec.ground_truth,
        copies=problem.copies,
        n=n,
        num_correct=sum(accs),
        mean_acc=avg_at_k(accs),
        pass_at={k: pass_at_k(n, sum(accs), k) for k in ks},
        maj_at={k: maj_at_k(preds, accs, k) for k in ks},
        maj_pred=majority_vote(preds),
        preds=preds,
        mean_response_length=length_stats([r.response_length for r in results])["mean"],
        truncation_rate=truncation_rate([r.truncated for r in results]),
        reflection_rate=sum(reflective) / n,
        sample_text=results[0].text[:SAMPLE_TEXT_CHARS],
    )


def source_metrics(
    problems: Sequence[ProblemResult],
    results: Sequence[RolloutResult],
    reflective: Sequence[bool],
    *,
    data_source: str,
    n: int,
    ks: Sequence[int],
    accs: Sequence[bool] | None = None,
) -> dict[str, float]:
    """Metrics of one data source: problem means of avg@n / pass@k / maj@k, response-level length stats; with
    ``accs`` (one per response), the stop split ``val/<ds>/stop/*`` (``metrics.stop_metrics``)."""
    num = len(problems)

    def mean(values: Iterable[float]) -> float:
        return sum(values) / num

    out = {val_metric(data_source, "mean", n): mean(p.mean_acc for p in problems)}
    for k in ks:
        out[val_metric(data_source, "pass", k)] = mean(p.pass_at[k] for p in problems)
        out[val_metric(data_source, "maj", k)] = mean(p.maj_at[k] for p in problems)
    stats = length_stats([r.response_length for r in results])
    for name in ("mean", "max", "min"):
        out[val_key(data_source, f"response_length/{name}")] = stats[name]
    out[val_key(data_source, "response_length/clip_ratio")] = truncation_rate([r.truncated for r in results])
    out[val_key(data_source, "reflection_rate")] = sum(reflective) / len(reflective)
    out[val_key(data_source, "num_problems")] = float(num)
    if accs is not None:
        split = stop_metrics([r.text for r in results], accs)
        out.update({val_key(data_source, f"stop/{name}"): v for name, v in split.items()})
    return out


def _sample(executor: EvalExecutor, prompts: list[list[int]], sampling: SamplingConfig) -> list[RolloutResult]:
    """``sampling.n`` responses per prompt, ordered prompt-major; checks that each (prompt, sample) came back once."""
    results = sorted(executor.generate(prompts, sampling), key=lambda r: (r.prompt_index, r.sample_index))
    expected = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
    if [(r.prompt_index, r.sample_index) for r in results] != expected:
        raise RuntimeError(
            f"executor returned {len(results)} responses that are not samples 0..{sampling.n - 1} of prompts "
            f"0..{len(prompts) - 1} (expected {len(expected)}); this is a bug in the rollout backend"
        )
    return results


def evaluate(
    executor: EvalExecutor,
    records: Sequence[ProblemRecord],
    *,
    k: int,
    sampling: SamplingConfig,
    reward_fn: str | None = None,
    seed: int,
    ks: Iterable[int] = DEFAULT_PASS_KS,
    reflection_phrases: Sequence[str] = DEFAULT_REFLECTION_PHRASES,
    max_prompt_length: int | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> EvalReport:
    """Sample ``k`` responses per unique problem and score them; per-problem results + per-source metrics.

    Args:
        executor: generates (``generate``), scores (``score``) and tokenizes (``tokenizer``).
        records: problems in the verl schema; repeated problems are evaluated once (see the module docstring).
        k: responses per problem (the paper: 32); overrides ``sampling.n``.
        sampling: temperature, top_p, top_k, max_new_tokens (paper: 1.0, 0.7, -1, 20480).
        reward_fn: a registered reward name to score with here; None -> ``executor.score`` (the configured one).
        seed: sampling seed (overrides ``sampling.seed``); sample j of problem i depends only on (seed, i, j).
        ks: k values for pass@k / maj@k; those above ``k`` are dropped and ``k`` itself is always added.
        reflection_phrases: phrases that count a response as reflective.
        max_prompt_length: keep only the last this-many prompt tokens (None: no limit).
        prompt_ids: already tokenized prompts, one per record (e.g. the train flow's); None -> ``encode_prompt``.
    """
    if not records:
        raise ValueError("records is empty: pass at least one problem (check data.val_files)")
    problems = dedupe_problems(records)
    report_ks = pass_ks(k, ks)
    pattern = compile_reflection_pattern(reflection_phrases)
    encoded = encode_problems(executor.tokenizer, problems, records, prompt_ids, max_prompt_length)
    sampling = dataclasses.replace(sampling, n=k, seed=seed)
    logger.info("evaluating %d unique problems (%d rows) x %d samples", len(problems), len(records), k)
    results = _sample(executor, [ids for ids, _ in encoded], sampling)  # (P*k,) prompt-major
    scored = _score(executor, reward_fn, problems, results)
    reflective = [has_reflection(r.text, pattern) for r in results]

    per_problem = [
        _problem_result(p, results[i * k : (i + 1) * k], scored.results[i * k : (i + 1) * k], report_ks, reflective[i * k : (i + 1) * k])
        for i, p in enumerate(problems)
    ]  # fmt: skip
    metrics, sources = _metrics_by_source(per_problem, results, reflective, scored, k=k, ks=report_ks)
    return EvalReport(
        problems=per_problem,
        metrics=metrics,
        n=k,
        ks=report_ks,
        seed=seed,
        num_rows=len(records),
        num_failed=scored.num_failed,
        num_prompts_truncated=sum(cut for _, cut in encoded),
        data_sources=sources,
    )


def _score(
    executor: EvalExecutor, reward_fn: str | None, problems: Sequence[UniqueProblem], results: Sequence[RolloutResult]
) -> ScoredBatch:
    """Each response scored against its problem's ground truth: by the registered ``reward_fn`` here, or (None) by
    the executor's configured reward; a failure is logged and scored wrong."""
    texts = [r.text for r in results]
    truths = [problems[r.prompt_index].record.ground_truth for r in results]
    scored = score_batch(reward_fn, texts, truths) if reward_fn is not None else executor.score(texts, truths)
    if scored.num_failed:
        logger.warning("the reward function failed on %d of %d responses (scored wrong)", scored.num_failed, len(texts))
    return scored


def _metrics_by_source(
    per_problem: Sequence[ProblemResult],
    results: Sequence[RolloutResult],
    reflective: Sequence[bool],
    scored: ScoredBatch,
    *,
    k: int,
    ks: Sequence[int],
) -> tuple[dict[str, float], list[str]]:
    """``source_metrics`` of each data source in order of first appearance, merged, and the sources; ``results``,
    ``reflective`` and ``scored`` hold the k samples of each problem, prompt-major."""
    sources = list(dict.fromkeys(p.data_source for p in per_problem))
    metrics: dict[str, float] = {}
    for ds in sources:
        rows = [i for i, p in enumerate(per_problem) if p.data_source == ds]
        samples = [i * k + j for i in rows for j in range(k)]
        metrics.update(
            source_metrics(
                [per_problem[i] for i in rows],
                [results[s] for s in samples],
                [reflective[s] for s in samples],
                data_source=ds,
                n=k,
                ks=ks,
                accs=[bool(scored.results[s]["acc"]) for s in samples],
            )
        )
    return metrics, sources


def stop_split(metrics: dict[str, float]) -> dict[str, float]:
    """The stop split over every data source of an evaluation's ``metrics`` (``val/<ds>/stop/*``), as
    ``{"stop/stopped_rate", "stop/run_on_rate", "stop/acc_when_stopped", "stop/acc_when_run_on"}``: rates weighted
    by each source's problems (every problem has n responses), accuracies by each source's responses in the
    class. Empty when the metrics hold no stop split; a class no response fell in is left out."""
    sources = [k[len("val/") : -len("/stop/stopped_rate")] for k in metrics if k.endswith("/stop/stopped_rate")]
    out: dict[str, float] = {}
    weights = {ds: metrics.get(val_key(ds, "num_problems"), 1.0) for ds in sources}
    total = sum(weights.values())
    for cls in ("stopped", "run_on"):
        in_class = {ds: weights[ds] * metrics[f"val/{ds}/stop/{cls}_rate"] for ds in sources}
        if not sources:
            continue
        out[f"stop/{cls}_rate"] = sum(in_class.values()) / total
        accs = {
            ds: metrics[f"val/{ds}/stop/acc_when_{cls}"] for ds in sources if f"val/{ds}/stop/acc_when_{cls}" in metrics
        }
        if accs and sum(in_class[ds] for ds in accs) > 0:
            out[f"stop/acc_when_{cls}"] = sum(in_class[ds] * a for ds, a in accs.items()) / sum(
                in_class[ds] for ds in accs
            )
    return out
