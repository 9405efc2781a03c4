"""The evaluate flow (avg@k, pass@k, maj@k, reflection rate, lengths) and the compare flow.

Run it::

    dapo evaluate                                         # model.path on data.val_files, k = rollout.val_n
    dapo evaluate --model outputs/tiny-dapo/final --data data/aime-2024.parquet --k 32
    dapo evaluate --model runs:/<run_id>/model            # or models:/tiny-dapo/1, or an HF hub id
    dapo compare tiny-dapo tiny-grpo --out outputs/compare

Steps of ``evaluate_flow``: resolve the model URI -> read the problems -> (own MLflow run, tagged with the
evaluated model's run id when known) sample k responses per unique problem and score them -> log metrics
``val/<data_source>/acc/{mean,pass,maj}_at_<k>``, a per-problem table and a summary -> write ``metrics/eval.json``
(``dvc metrics show``). Sampling follows the config's validation settings (paper: T=1.0, top_p=0.7) with a fixed
seed derived from ``trainer.seed``, so evaluating two models compares them on the same random numbers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from dapo_core.config import load_config
from dapo_core.evaluation import DEFAULT_PASS_KS, DEFAULT_REFLECTION_PHRASES
from tasks import evaluate as T
from tasks import tracking
from tasks.data import dvc_recorded_md5
from tasks.train_logging import file_digest

# the evaluate stage's fixed output (docs/design.md, "Stage outputs and raw data")
DEFAULT_METRICS_PATH = "metrics/eval.json"
DEFAULT_COMPARE_DIR = "outputs/compare"


def default_run_name(model: T.ResolvedModel) -> str:
    """``eval-<what>``: the directory name (``<run>-step_N`` for a checkpoint), else the URI without scheme."""
    if model.kind == "local":
        path = Path(model.path).resolve()
        what = f"{path.parent.parent.name}-{path.name}" if path.parent.name == "checkpoints" else path.name
    else:
        what = model.uri.split(":/", 1)[-1]
    return "eval-" + re.sub(r"[^A-Za-z0-9_.@-]+", "-", what).strip("-")


def _eval_tags(cfg: Any, resolved: T.ResolvedModel, files: list[str], k: int, seed: int) -> dict[str, str]:
    """What an evaluation run is of: the model, the data (DVC's and the files' digests), k and the seed."""
    return {
        **tracking.git_tags(),
        "stage": "evaluate",
        "recipe": cfg.recipe,
        "model.id": resolved.uri,
        "data.dvc_md5": dvc_recorded_md5(),
        "data.eval_digest": file_digest(files),
        "eval.k": str(k),
        "eval.seed": str(seed),
        **resolved.tags(),
    }


@flow(name="dapo-evaluate", log_prints=False, validate_parameters=True)
def evaluate_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    model: str | None = None,
    data: list[str] | None = None,
    k: int | None = None,
    ks: list[int] | None = None,
    reflection_phrases: list[str] | None = None,
    seed: int | None = None,
    metrics_path: str | None = DEFAULT_METRICS_PATH,
    run_name: str | None = None,
    nested: bool = False,
    extra_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (default ``model.path``) on ``data`` (default ``data.val_files``) with k samples each.

    Returns the summary (metrics, run id, model run id, ``mean_acc`` = avg@k over all problems, paths).
    ``metrics_path=None`` skips ``metrics/eval.json`` (e.g. evaluating a second model in the pipeline).
    """
    plog = get_run_logger()
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    files = list(data) if data else list(cfg.data.val_files)
    n = k if k is not None else cfg.rollout.val_n
    ev = cfg.evaluation
    sample_seed = seed if seed is not None else (ev.seed if ev.seed is not None else T.eval_seed(cfg))
    resolved = T.resolve_model(cfg, model or cfg.model.path)
    records = T.load_problems(files)
    tags = {**_eval_tags(cfg, resolved, files, n, sample_seed), **(extra_tags or {})}
    with tracking.start_run(cfg, run_name=run_name or default_run_name(resolved), nested=nested, tags=tags) as run:
        run_id = run.info.run_id
        tracking.log_params_flat(cfg, run_id=run_id)
        report = T.run_evaluation(
            cfg,
            resolved,
            records,
            k=n,
            seed=sample_seed,
            ks=ks or list(ev.ks or DEFAULT_PASS_KS),
            reflection_phrases=reflection_phrases or list(ev.reflection_phrases or DEFAULT_REFLECTION_PHRASES),
        )
        summary = T.summary_of(report, resolved, files)
        T.log_evaluation(report, summary, run_id=run_id)
    out = str(T.write_eval_json(report, metrics_path)) if metrics_path else None
    mean_acc = report.mean_acc()
    plog.info(
        "evaluated %s: %d problems (%d rows) x %d samples, avg@%d = %.4f (MLflow run %s)",
        resolved.uri, len(report.problems), report.num_rows, n, n, mean_acc, run_id,
    )  # fmt: skip
    return {**summary, "run_id": run_id, "mean_acc": mean_acc, "metrics_path": out}


@flow(name="dapo-compare", log_prints=False, validate_parameters=True)
def compare_flow(
    runs: list[str],
    out_dir: str = DEFAULT_COMPARE_DIR,
    metrics: list[str] | None = None,
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    title: str | None = None,
    track: bool = True,
) -> dict[str, Any]:
    """Overlay the curves of MLflow runs (ids or names) into ``<out_dir>/compare.png`` + ``compare.md``; with
    ``track``, also log both to a ``compare-...`` MLflow run (tag ``stage=compare``, artifacts under ``compare/``)."""
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    histories = T.load_run_histories(cfg, runs, metrics)
    result = T.write_comparison(histories, out_dir, metrics, title)
    run_id = None
    if track:
        name = ("compare-" + " vs ".join(histories))[:250]
        tags = {"stage": "compare", "compare.runs": ", ".join(runs), **tracking.git_tags()}
        with tracking.start_run(cfg, run_name=name, tags=tags) as run:
            tracking.log_artifact(result.png, "compare")
            tracking.log_artifact(result.table_path, "compare")
            run_id = run.info.run_id
    get_run_logger().info(
        "compared %d runs: %s, %s (MLflow run %s)", len(histories), result.png, result.table_path, run_id
    )
    return {
        "png": str(result.png),
        "table_path": str(result.table_path),
        "table": result.table,
        "runs": list(histories),
        "run_id": run_id,
    }
