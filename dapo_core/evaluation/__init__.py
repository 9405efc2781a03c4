"""Evaluation: avg@k / pass@k / maj@k, reflection rate and length metrics, the evaluation runner, run comparison.

- ``metrics``: pure functions (exact unbiased pass@k, exact maj@k over k-subsets, reflection rate, lengths).
- ``runner``: ``evaluate(executor, records, k=..., sampling=..., seed=...)`` -> ``EvalReport`` (de-duplicates
  problems, so AIME-2024's 960 rows are 30 problems: ``problems``, with the prompts' encoding).
- ``compare``: overlay the curves of several runs into one PNG and a markdown table (no MLflow here).
"""

from dapo_core.evaluation.compare import CompareResult, compare_runs, default_metrics, final_metrics_table, plot_curves
from dapo_core.evaluation.metrics import (
    DEFAULT_PASS_KS,
    DEFAULT_REFLECTION_PHRASES,
    avg_at_k,
    length_stats,
    maj_at_k,
    majority_vote,
    pass_at_k,
    pass_ks,
    reflection_rate,
    truncation_rate,
)
from dapo_core.evaluation.problems import UniqueProblem, dedupe_problems, encode_prompt
from dapo_core.evaluation.runner import EvalExecutor, EvalReport, ProblemResult, evaluate, val_key

__all__ = [
    "DEFAULT_PASS_KS",
    "DEFAULT_REFLECTION_PHRASES",
    "CompareResult",
    "EvalExecutor",
    "EvalReport",
    "ProblemResult",
    "UniqueProblem",
    "avg_at_k",
    "compare_runs",
    "dedupe_problems",
    "default_metrics",
    "encode_prompt",
    "evaluate",
    "final_metrics_table",
    "length_stats",
    "maj_at_k",
    "majority_vote",
    "pass_at_k",
    "pass_ks",
    "plot_curves",
    "reflection_rate",
    "truncation_rate",
    "val_key",
]
