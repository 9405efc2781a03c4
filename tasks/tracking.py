"""MLflow bookkeeping used by every flow: one place for the tracking URI, runs, params, batched metrics, tags.

All tracking code lives in ``tasks/`` (dapo_core never imports MLflow); reading runs back (metric histories,
tags, status) and the resume's metric truncation are in ``tasks.tracking_store``. Defaults (docs/design.md,
"Tracking defaults"): a SQLite store ``sqlite:///mlflow.db`` and artifacts under ``./mlartifacts``, overridden by
``MLFLOW_TRACKING_URI`` / ``tracking.uri``. Metrics of one step go in one ``log_batch`` call (1,000 single calls
take ~3.5 s here).

Experiments are created as model-training experiments (tag ``mlflow.experimentKind`` =
``custom_model_development``). MLflow 3.17's UI picks its view from a global "GenAI / Model training" switch
instead (the URL's ``workflowType`` or the choice the browser saved, GenAI when none), so the run links built here
ask for the model-training view (runs table, metric charts) in the URL.
A run started inside a Prefect flow run is linked both ways: a link artifact on the flow run points at the run in
the MLflow UI (``$DAPO_MLFLOW_UI_URL``, default: the tracking server when it is http(s), else
http://127.0.0.1:5000), and the run carries the flow run's id (tags ``prefect.flow_run_*``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from dapo_core.config import DapoConfig, flatten_config
from dapo_core.config.schema import resolved_artifact_location, resolved_tracking_uri
from tasks import spool
from tasks.redact import redact, redact_items
from tasks.spool import Outbox
from tasks.tracking_send import send as _send

logger = logging.getLogger(__name__)

# MLflow's per-call limits for log_batch
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_PARAM_VALUE = 6000

# The experiment's kind as MLflow 3 records it (values from its UI): model training, not GenAI.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MLFLOW_UI_ENV = "DAPO_MLFLOW_UI_URL"
DEFAULT_MLFLOW_UI_URL = "http://127.0.0.1:5000"
# The query that opens a page of the MLflow UI (3.x) in its model-training view rather than the GenAI one.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def _artifact_uri(location: str | None) -> str | None:
    if location is None or "://" in location or location.startswith("file:"):
        return location
    return Path(location).expanduser().resolve().as_uri()


# An HTTP tracking server that is down must fail a write in seconds (it then waits in the outbox, tasks/spool.py),
# not after MLflow's default 7 retries with exponential backoff (minutes per write). A user's own values win.
_HTTP_FAIL_FAST = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
OUTBOX_DIR = ".mlflow-outbox"  # under trainer.output_dir
_outbox: Outbox | None = None


def outbox() -> Outbox:
    """This process's tracking outbox (configure_mlflow sets its directory; ./outputs before that)."""
    global _outbox
    if _outbox is None:
        _outbox = Outbox(Path("outputs") / OUTBOX_DIR, _send)
    return _outbox


def configure_mlflow(cfg: DapoConfig) -> str:
    """Point MLflow at the configured store and experiment (created with the configured artifact root)."""
    global _outbox
    uri = resolved_tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        for key, value in _HTTP_FAIL_FAST.items():
            os.environ.setdefault(key, value)
    root = Path(cfg.trainer.output_dir) / OUTBOX_DIR
    if _outbox is None or _outbox.root != root:
        if _outbox is not None and len(_outbox):
            _outbox.flush()
        _outbox = Outbox(root, _send)
    mlflow.set_tracking_uri(uri)
    name = cfg.tracking.experiment
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            client.create_experiment(
                name,
                artifact_location=_artifact_uri(resolved_artifact_location(cfg)),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        except mlflow.exceptions.MlflowException:  # created concurrently by another process
            if client.get_experiment_by_name(name) is None:
                raise
    elif not _explicit_kind(exp.tags):
        # an experiment made before this tag existed (or one the UI only guessed a kind for): a training experiment
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    mlflow.set_experiment(name)
    return uri


def _explicit_kind(tags: Mapping[str, str]) -> bool:
    """True when the experiment's kind was chosen (by a user or a tool), not missing or inferred by the UI."""
    kind = tags.get(EXPERIMENT_KIND_TAG, "")
    return bool(kind) and not kind.endswith("_inferred") and kind != "no_inferred_type"


@contextmanager
def start_run(
    cfg: DapoConfig,
    *,
    run_name: str | None = None,
    nested: bool = False,
    run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> Iterator[mlflow.ActiveRun]:
    """Start (or, with ``run_id``, resume) an MLflow run; ends it FINISHED, or FAILED on an exception.

    Inside an active run (the pipeline's parent run) the new run is always nested under it, so stage flows
    called from ``dapo pipeline`` become its children without each needing to know.
    """
    configure_mlflow(cfg)
    nested = mlflow.active_run() is not None
    run = mlflow.start_run(
        run_id=run_id,
        run_name=None if run_id else run_name,
        nested=nested,
        tags=redact_items({k: str(v) for k, v in (tags or {}).items()}),
        log_system_metrics=cfg.tracking.log_system_metrics,
    )
    try:
        link_flow_run(run)
        yield run
    except BaseException:
        _end_run(run.info.run_id, "FAILED")
        raise
    else:
        _end_run(run.info.run_id, "FINISHED")


def _end_run(run_id: str, status: str) -> None:
    """End the active run; first deliver what waits in the outbox (waiting for the server up to
    ``DAPO_TRACKING_OUTAGE_WAIT_S``). If the server is still unreachable the end waits in the outbox too."""
    box = outbox()
    if len(box) and not box.flush(spool.wait_s()):
        logger.warning("tracking server still unreachable: %d MLflow write(s) wait in %s", len(box), box.path)
    try:
        mlflow.end_run(status=status)  # pops the run off MLflow's stack first, then tells the server
    except Exception as exc:
        if not spool.unreachable(exc):
            raise
        box.queue({"kind": "end", "run_id": run_id, "status": status})
        from mlflow.tracking import fluent

        monitor = getattr(fluent, "run_id_to_system_metrics_monitor", {}).pop(run_id, None)
        if monitor is not None:
            with contextlib.suppress(Exception):
                monitor.finish()


def mlflow_ui_url(tracking_uri: str | None = None) -> str:
    """Base URL of the MLflow UI showing this store: ``$DAPO_MLFLOW_UI_URL``, else the tracking server itself when
    it is one (http/https), else http://127.0.0.1:5000 (where ``make ui`` and ``mlflow ui`` serve by default)."""
    explicit = os.environ.get(MLFLOW_UI_ENV, "").strip()
    if explicit:
        return explicit.rstrip("/")
    uri = tracking_uri if tracking_uri is not None else mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    return DEFAULT_MLFLOW_UI_URL


def run_ui_url(experiment_id: str, run_id: str, tracking_uri: str | None = None) -> str:
    """The MLflow UI page of one run, in the model-training view."""
    return f"{mlflow_ui_url(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def link_flow_run(run: mlflow.ActiveRun) -> str | None:
    """Inside a Prefect flow run: a link artifact on it to ``run`` in the MLflow UI, and its id as MLflow tags.

    Returns the run's MLflow UI URL (None outside a flow run). Never raises: a failed link costs a warning only.
    """
    if "prefect" not in sys.modules:  # no flow run without Prefect loaded; skip importing it
        return None
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    info, flow_run = run.info, ctx.flow_run
    url = run_ui_url(info.experiment_id, info.run_id)
    try:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(
            link=url,
            link_text=f"MLflow run {info.run_name or info.run_id}",
            description=f"MLflow run `{info.run_id}` (experiment `{info.experiment_id}`). The MLflow UI is assumed "
            f"at {mlflow_ui_url()}; set {MLFLOW_UI_ENV} when it is elsewhere.",
        )
        tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": flow_run.name}
        ui = os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
        if ui:  # a real server (an ephemeral one is gone when the command ends: no link to it)
            tags["prefect.flow_run_url"] = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}"
        set_tags(tags, run_id=info.run_id)
    except Exception as exc:  # the link is a convenience: never fail a run over it
        logger.warning("could not link MLflow run %s to Prefect flow run %s: %s", info.run_id, flow_run.id, exc)
    return url


def _run_id(run_id: str | None) -> str:
    if run_id is not None:
        return run_id
    active = mlflow.active_run()
    if active is None:
        raise RuntimeError("no active MLflow run: call inside `with start_run(cfg):` or pass run_id")
    return active.info.run_id


def log_params_flat(cfg: DapoConfig, *, run_id: str | None = None) -> dict[str, str]:
    """Log the whole config as flattened dotted params (``trainer.lr``...). Returns what was logged."""
    flat = redact_items(flatten_config(cfg))  # a tracking URI with a password, a token in an override: masked
    rid = _run_id(run_id)
    client = MlflowClient()
    existing = client.get_run(rid).data.params
    params = [
        [k, v[:_MAX_PARAM_VALUE]] for k, v in sorted(flat.items()) if k not in existing
    ]  # a resumed run already has them (MLflow forbids changing a param)
    for i in range(0, len(params), _MAX_PARAMS):
        outbox().submit({"kind": "params", "run_id": rid, "params": params[i : i + _MAX_PARAMS]})
    return flat


def log_metrics(
    metrics: Mapping[str, float], step: int, *, run_id: str | None = None, timestamp_ms: int | None = None
) -> None:
    """Log one step's metrics in one batched call (non-finite values are dropped with a warning). ``timestamp_ms``:
    the points' time (default now); logging the same points again with the same time adds nothing to an SQL-backed
    store, local or behind ``mlflow server`` (MLflow skips a point whose key, step, time and value it holds)."""
    rid = _run_id(run_id)
    now = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
    items = []
    for k, v in sorted(metrics.items()):
        value = float(v)
        if not math.isfinite(value):
            logger.warning("metric %s=%s at step %d is not finite; not logged", k, value, step)
            continue
        items.append([k, value, now, int(step)])
    for i in range(0, len(items), _MAX_METRICS):
        outbox().submit({"kind": "metrics", "run_id": rid, "metrics": items[i : i + _MAX_METRICS]})


def set_tags(tags: Mapping[str, Any], *, run_id: str | None = None) -> None:
    rid = _run_id(run_id)
    items = [[k, v] for k, v in redact_items({k: str(v) for k, v in tags.items()}).items()]
    for i in range(0, len(items), _MAX_TAGS):
        outbox().submit({"kind": "tags", "run_id": rid, "tags": items[i : i + _MAX_TAGS]})


def git_tags(repo: str | Path = ".") -> dict[str, str]:
    """``git.sha`` and ``git.dirty`` of the working tree (``unknown`` outside a git checkout). Dirty: any change
    ``git status --porcelain`` lists, untracked files that are not ignored included (a new module changes the code
    that runs as much as an edited one)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=normal"))
    except (OSError, subprocess.SubprocessError):
        return {"git.sha": "unknown", "git.dirty": "unknown"}
    return {"git.sha": sha, "git.dirty": str(dirty).lower()}


def log_json(obj: Any, artifact_file: str, *, run_id: str | None = None) -> None:
    _log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file, run_id)


def log_text(text: str, artifact_file: str, *, run_id: str | None = None) -> None:
    _log_text(text, artifact_file, run_id)


def _log_text(text: str, artifact_file: str, run_id: str | None) -> None:
    outbox().submit({"kind": "text", "run_id": _run_id(run_id), "text": redact(text), "artifact_file": artifact_file})


def log_table(rows: list[dict[str, Any]], artifact_file: str, *, run_id: str | None = None) -> None:
    """Log rows as an MLflow table (shown in the UI's artifact view / ``mlflow.load_table``)."""
    if not rows:
        return
    columns: dict[str, list[Any]] = {k: [] for k in rows[0]}
    for r in rows:
        for k in columns:
            columns[k].append(r.get(k))
    outbox().submit({"kind": "table", "run_id": _run_id(run_id), "columns": columns, "artifact_file": artifact_file})


def wait_for_delivery() -> bool:
    """Deliver what waits in the outbox, waiting for an unreachable server up to ``DAPO_TRACKING_OUTAGE_WAIT_S``
    (before reading the run back from the server, e.g. for the end-of-run plots). True when all was delivered."""
    box = outbox()
    return not len(box) or box.flush(spool.wait_s())


def log_artifacts(local_dir: str | Path, artifact_path: str | None = None, *, run_id: str | None = None) -> None:
    item = {"kind": "artifacts", "run_id": _run_id(run_id), "local": str(local_dir), "artifact_path": artifact_path}
    outbox().submit(item, stash=local_dir)


def holds_artifacts(local_dir: str | Path, artifact_path: str, *, run_id: str | None = None) -> bool:
    """Whether the run's ``artifact_path`` on the tracking server has every file of ``local_dir``, each of the same
    size; False when it lacks one, or when the server cannot say (unreachable: a new upload then waits in the
    outbox like any other write)."""
    local = {p.relative_to(local_dir).as_posix(): p.stat().st_size for p in Path(local_dir).rglob("*") if p.is_file()}
    client, rid, held = MlflowClient(), _run_id(run_id), {}
    try:
        todo = [artifact_path]
        while todo:
            for info in client.list_artifacts(rid, todo.pop()):
                if info.is_dir:
                    todo.append(info.path)
                else:
                    held[info.path.removeprefix(f"{artifact_path}/")] = info.file_size
    except Exception as exc:  # the errors vary by store and transport; a re-send is always safe
        logger.info("could not list %s on the tracking server (%s): sending it again", artifact_path, exc)
        return False
    return all(held.get(name) == size for name, size in local.items())


REDACTED_SUFFIXES = (".log", ".txt", ".md", ".json", ".yaml", ".yml")  # text artifacts that may quote a secret
_MAX_REDACTED_BYTES = 64 * 2**20


def log_artifact(local_file: str | Path, artifact_path: str | None = None, *, run_id: str | None = None) -> None:
    """Log one file; text files (logs, reports, configs) go up with their secrets masked (tasks/redact.py)."""
    path = Path(local_file)
    if path.suffix in REDACTED_SUFFIXES and path.stat().st_size <= _MAX_REDACTED_BYTES:
        text = path.read_text(encoding="utf-8", errors="replace")
        if redact(text) != text:
            _log_text(text, f"{artifact_path}/{path.name}" if artifact_path else path.name, run_id)
            return
    item = {"kind": "artifact", "run_id": _run_id(run_id), "local": str(path), "artifact_path": artifact_path}
    outbox().submit(item, stash=path)


def register_hf_model(
    local_dir: str | Path, name: str, *, artifact_path: str = "model", run_id: str | None = None
) -> str:
    """Log an HF model directory as run artifacts and register it in the Model Registry under ``name``.

    Returns ``models:/<name>/<version>``; ``mlflow.artifacts.download_artifacts`` of that URI gives back a
    directory that ``from_pretrained`` loads."""
    rid = _run_id(run_id)
    item = {"kind": "register", "run_id": rid, "local": str(local_dir), "artifact_path": artifact_path, "name": name}
    uri = outbox().submit(item, stash=local_dir)
    # queued (tracking server unreachable): the version is made when the outbox delivers the registration
    return uri if uri != spool.QUEUED else f"models:/{name}/latest"
