"""Prefect tasks of the evaluate flow (and the validation used by the train flow): resolve a model URI, load the
problems, sample and score, log to MLflow, write ``metrics/eval.json``; plus reading run histories for
``dapo compare``.

Model URIs (``resolve_model_uri``):

- a local HF directory (a checkpoint's ``trainer_state.json`` gives the MLflow run id that trained it);
- ``runs:/<run_id>/<path>``: run artifacts, downloaded with ``mlflow.artifacts.download_artifacts``;
- ``models:/<name>/<version>`` or ``models:/<name>@<alias>``: the Model Registry (the version's run id is known);
- anything else: a Hugging Face hub id, loaded by ``load_model`` (offline: only the local cache).

Downloads land in ``<trainer.output_dir>/eval/models/<uri slug>/`` and are reused when complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig
from dapo_core.data.schema import ProblemRecord, read_rl_files
from dapo_core.engines.executor import Executor, LocalExecutor, sampling_from
from dapo_core.engines.models import ModelNotFoundError
from dapo_core.evaluation import DEFAULT_PASS_KS, DEFAULT_REFLECTION_PHRASES, EvalReport, evaluate
from dapo_core.evaluation.compare import DEFAULT_CURVES, VAL_ACC_PATTERN, CompareResult, compare_runs
from dapo_core.seeding import derive_seed
from tasks import tracking, tracking_store

logger = logging.getLogger(__name__)

RUNS_SCHEME = "runs:/"
MODELS_SCHEME = "models:/"
COMPLETE_MARKER = ".download-complete"
CHECKPOINT_META = "trainer_state.json"  # written by dapo_core.engines.checkpoint (holds mlflow_run_id)
TABLE_FILE = "eval/problems.json"
SUMMARY_FILE = "eval/summary.json"


@dataclass(frozen=True)
class ResolvedModel:
    """A model URI turned into something ``load_model`` takes, plus where it came from."""

    uri: str  # as given
    path: str  # local HF directory, or a hub id
    kind: str  # "local" | "run" | "registry" | "hub"
    run_id: str | None = None  # the MLflow run that produced it, when known

    def tags(self) -> dict[str, str]:
        out = {"eval.model_uri": self.uri, "eval.model_kind": self.kind, "eval.model_path": self.path}
        if self.run_id:
            out["eval.model_run_id"] = self.run_id
        return out


def _slug(uri: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", uri).strip("_")[:60]
    return f"{readable}-{hashlib.sha256(uri.encode()).hexdigest()[:8]}"


def find_hf_dir(root: str | Path) -> Path:
    """``root`` if it holds ``config.json``, else its only sub-directory that does (MLflow flavour layouts)."""
    root = Path(root)
    if (root / "config.json").is_file():
        return root
    found = sorted(p.parent for p in root.glob("*/config.json"))
    if len(found) == 1:
        return found[0]
    raise ModelNotFoundError(
        f"{root} is not an HF model directory: no config.json at its top or in exactly one sub-directory "
        f"(found {len(found)}); point --model at the artifact folder that holds config.json"
    )


def _download(uri: str, cache_dir: Path) -> Path:
    """Download MLflow artifacts once into ``cache_dir/<slug>`` (atomically; reused when complete)."""
    import mlflow

    target = cache_dir / _slug(uri)
    if (target / COMPLETE_MARKER).is_file():
        logger.info("reusing the download of %s at %s", uri, target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp)))
        if not local.is_dir():
            raise ModelNotFoundError(f"model {uri!r} is a single file, not an HF model directory: name its folder")
        (local / COMPLETE_MARKER).write_text(uri)
        if target.exists():
            shutil.rmtree(target)
        os.replace(local, target)  # local is tmp itself or a folder inside it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _registry_run_id(uri: str) -> str | None:
    """The run id behind ``models:/name/version``, ``models:/name@alias`` or ``models:/m-<logged model id>``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    ref = uri[len(MODELS_SCHEME) :].strip("/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return client.get_model_version_by_alias(name, alias).run_id or None
    parts = ref.split("/")
    if len(parts) >= 2 and parts[1].isdigit():
        return client.get_model_version(parts[0], parts[1]).run_id or None
    if len(parts) == 1 and parts[0].startswith("m-"):
        return client.get_logged_model(parts[0]).source_run_id or None
    return None


def _checkpoint_run_id(path: Path) -> str | None:
    meta = path / CHECKPOINT_META
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("mlflow_run_id") or data.get("run_id")
    return str(value) if value else None


def resolve_model_uri(uri: str, *, cache_dir: str | Path) -> ResolvedModel:
    """Resolve a local dir / ``runs:/`` / ``models:/`` / hub id (MLflow must already point at the store).

    Raises:
        ModelNotFoundError: an MLflow run, artifact or registered model that does not exist, or a download that
            holds no HF directory; the message names the URI and the fix.
    """
    from mlflow.exceptions import MlflowException

    if uri.startswith((RUNS_SCHEME, MODELS_SCHEME)):
        registry = uri.startswith(MODELS_SCHEME)
        try:
            run_id = _registry_run_id(uri) if registry else uri[len(RUNS_SCHEME) :].split("/")[0] or None
            local = _download(uri, Path(cache_dir))
        except MlflowException as exc:
            where = "registered model version" if registry else "run artifact"
            raise ModelNotFoundError(
                f"model {uri!r}: no such {where} in the MLflow store ({exc.message.splitlines()[0]}). Fix: check "
                "tracking.uri / MLFLOW_TRACKING_URI, and the id (the MLflow UI lists runs, artifacts and models)"
            ) from exc
        return ResolvedModel(uri, str(find_hf_dir(local)), "registry" if registry else "run", run_id)
    local_path = Path(uri).expanduser()
    if local_path.is_dir():
        return ResolvedModel(uri, str(local_path), "local", _checkpoint_run_id(local_path))
    return ResolvedModel(uri, uri, "hub")  # a hub id, or a missing directory: load_model says which and the fix


@task(name="resolve-model", cache_policy=NO_CACHE)
def resolve_model(cfg: DapoConfig, uri: str) -> ResolvedModel:
    """Point MLflow at the configured store, then resolve ``uri`` (downloads under outputs/eval/models/)."""
    tracking.configure_mlflow(cfg)
    return resolve_model_uri(uri, cache_dir=Path(cfg.trainer.output_dir) / "eval" / "models")


@task(name="load-eval-problems", cache_policy=NO_CACHE)
def load_problems(files: Sequence[str]) -> list[ProblemRecord]:
    """Read verl-schema parquet files (rows, duplicates included: the runner de-duplicates)."""
    if not files:
        raise ValueError("no evaluation data: pass --data FILE or set data.val_files")
    return read_rl_files(list(files))


def make_executor(cfg: DapoConfig, model: ResolvedModel) -> Executor:
    """An in-process executor on the resolved model (its own tokenizer when the directory has one)."""
    if cfg.resources.executor != "local":
        logger.warning("evaluation runs in-process (resources.executor=%s is used by training)", cfg.resources.executor)
    if os.path.isfile(os.path.join(model.path, "tokenizer_config.json")) and cfg.model.tokenizer_path:
        cfg = cfg.model_copy(deep=True)
        cfg.model.tokenizer_path = None  # the evaluated model's own tokenizer, not the config's
    return LocalExecutor(cfg, model_path=model.path)


def eval_seed(cfg: DapoConfig, *parts: int | str) -> int:
    """The fixed evaluation sampling seed: derived from trainer.seed and ``parts`` (default ("evaluate",))."""
    return derive_seed(cfg.trainer.seed, *(parts or ("evaluate",)))


@task(name="sample-and-score", cache_policy=NO_CACHE)
def run_evaluation(
    cfg: DapoConfig,
    model: ResolvedModel,
    records: Sequence[ProblemRecord],
    *,
    k: int,
    seed: int,
    ks: Sequence[int] = DEFAULT_PASS_KS,
    reflection_phrases: Sequence[str] = DEFAULT_REFLECTION_PHRASES,
) -> EvalReport:
    """Load the model, sample k responses per unique problem (validation sampling of the config), score them."""
    with make_executor(cfg, model) as executor:
        return evaluate(
            executor,
            records,
            k=k,
            sampling=sampling_from(cfg, seed=seed, validation=True),
            seed=seed,
            ks=ks,
            reflection_phrases=reflection_phrases,
            max_prompt_length=cfg.data.max_prompt_length,
        )


def evaluate_items(
    executor: Executor,
    items: Sequence[Any],
    cfg: DapoConfig,
    *,
    seed_parts: Sequence[int | str] = ("val",),
    ks: Sequence[int] | None = None,
    reflection_phrases: Sequence[str] | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Validation inside training: ``items`` are tokenized prompts (``.record``, ``.prompt_ids``) of the live
    policy's tokenizer; k = rollout.val_n; ks / phrases default to the config's ``evaluation`` section.
    Returns (``val/<ds>/...`` metrics, per-problem rows)."""
    ks = ks if ks is not None else (cfg.evaluation.ks or DEFAULT_PASS_KS)
    if reflection_phrases is None:
        reflection_phrases = cfg.evaluation.reflection_phrases or DEFAULT_REFLECTION_PHRASES
    seed = eval_seed(cfg, *seed_parts)
    report = evaluate(
        executor,
        [it.record for it in items],
        k=cfg.rollout.val_n,
        sampling=sampling_from(cfg, seed=seed, validation=True),
        seed=seed,
        ks=ks,
        reflection_phrases=reflection_phrases,
        prompt_ids=[list(it.prompt_ids) for it in items],
    )
    return dict(report.metrics), report.rows()


def summary_of(report: EvalReport, model: ResolvedModel, files: Sequence[str]) -> dict[str, Any]:
    return {
        "model": model.uri,
        "model_path": model.path,
        "model_run_id": model.run_id,
        "data_files": list(files),
        "n": report.n,
        "ks": report.ks,
        "seed": report.seed,
        "num_rows": report.num_rows,
        "num_problems": len(report.problems),
        "num_failed": report.num_failed,
        "num_prompts_truncated": report.num_prompts_truncated,
        "metrics": report.metrics,
    }


@task(name="log-evaluation", cache_policy=NO_CACHE)
def log_evaluation(report: EvalReport, summary: dict[str, Any], *, run_id: str, step: int = 0) -> None:
    """Metrics (one batched call), the per-problem table and a JSON summary into the MLflow run ``run_id``."""
    tracking.log_metrics(report.metrics, step=step, run_id=run_id)
    tracking.log_table(report.rows(), TABLE_FILE, run_id=run_id)
    tracking.log_json(summary, SUMMARY_FILE, run_id=run_id)


@task(name="write-eval-metrics", cache_policy=NO_CACHE)
def write_eval_json(report: EvalReport, path: str | Path) -> Path:
    """``metrics/eval.json`` for ``dvc metrics show``: the flat metric dict (numbers only), written atomically."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {key: report.metrics[key] for key in sorted(report.metrics)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------- dapo compare


def _resolve_run(client: Any, experiment_ids: list[str], ref: str) -> Any:
    """A run by id, else the newest run named ``ref`` in the given experiments."""
    from mlflow.exceptions import MlflowException

    if re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            return client.get_run(ref)
        except MlflowException:
            pass
    name = ref.replace("\\", "\\\\").replace("'", "\\'")
    runs = client.search_runs(
        experiment_ids, filter_string=f"tags.`mlflow.runName` = '{name}'", order_by=["start_time DESC"], max_results=1
    )
    if not runs:
        raise ValueError(
            f"no MLflow run with id or name {ref!r} in experiment(s) {experiment_ids}: pass a run id or a run "
            "name shown in the MLflow UI (and the right tracking.uri / tracking.experiment)"
        )
    return runs[0]


def _wanted(key: str, metrics: Sequence[str] | None) -> bool:
    if metrics is not None:
        return key in metrics
    return bool(VAL_ACC_PATTERN.match(key)) or key in DEFAULT_CURVES


@task(name="load-run-histories", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def load_run_histories(
    cfg: DapoConfig, runs: Sequence[str], metrics: Sequence[str] | None = None
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{label: {metric: [(step, value), ...]}}`` for runs given by id or name (label: the run name, plus the
    id prefix when two runs share a name)."""
    from mlflow.tracking import MlflowClient

    tracking.configure_mlflow(cfg)
    client = MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for ref in runs:
        run = _resolve_run(client, experiments, ref)
        label = run.info.run_name or run.info.run_id
        if label in out:
            label = f"{label} ({run.info.run_id[:8]})"
        keys = [key for key in sorted(run.data.metrics) if _wanted(key, metrics)]
        out[label] = {key: tracking_store.metric_history(run.info.run_id, key) for key in keys}
    return out


@task(name="write-comparison", cache_policy=NO_CACHE)
def write_comparison(
    histories: dict[str, dict[str, list[tuple[int, float]]]],
    out_dir: str | Path,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
) -> CompareResult:
    """``compare.png`` (overlaid curves) and ``compare.md`` (final values) under ``out_dir``."""
    return compare_runs(histories, out_dir, metrics, title=title)
