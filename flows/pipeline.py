"""The whole mission on the configured recipe: curate -> base model -> train -> evaluate (``dapo pipeline``).

One parent Prefect flow with the four stage flows as subflows, and one parent MLflow run with the stages' runs
nested under it. The stages write the fixed output paths that ``dvc.yaml`` declares; at the end the pipeline
records them with ``dvc commit`` so ``dvc status`` is clean and ``dvc repro`` is a no-op.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from dapo_core.config import load_config
from dapo_core.config.schema import resolved_run_name, resolved_tracking_uri
from flows.base_model import base_model_flow
from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.train import train_flow
from tasks import tracking
from tasks.data import dvc_recorded_md5

logger = logging.getLogger(__name__)

DVC_STAGES = ("curate", "base_model", "train", "evaluate")


def _dvc_commit(plog: Any) -> bool:
    """Record the stage outputs in dvc.lock (they were produced by the same code the stage commands run) and the
    generated raw data in the DVC cache, so `dvc status` is clean and `dvc repro` a no-op afterwards."""
    # the venv's dvc first: `.venv/bin/dapo pipeline` (make run) does not put .venv/bin on PATH
    beside = Path(sys.executable).parent / "dvc"
    dvc = str(beside) if beside.is_file() else shutil.which("dvc")
    if dvc is None or not Path("dvc.yaml").is_file() or not Path(".dvc").is_dir():
        plog.warning("dvc (or dvc.yaml / .dvc) not found: stage outputs not recorded; run `dvc commit` yourself")
        return False
    # data.dvc too: `dapo data generate` wrote data/ (same content as recorded) but not into the DVC cache, which
    # `dvc status` reports as "not in cache" until it is committed
    raw = ["data.dvc"] if Path("data.dvc").is_file() else []
    proc = subprocess.run([dvc, "commit", "--force", *raw, *DVC_STAGES], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        plog.warning("`dvc commit` failed (exit %d): %s", proc.returncode, proc.stderr.strip()[-2000:])
        return False
    return True


@flow(name="dapo-pipeline", log_prints=False, validate_parameters=True)
def pipeline_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    dvc_commit: bool = True,
) -> dict[str, Any]:
    """Curate -> base model -> train -> evaluate; returns each stage's summary and base -> final accuracy."""
    plog = get_run_logger()
    common = {"config_path": config_path, "recipe": recipe, "overrides": list(overrides or [])}
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    run_name = resolved_run_name(cfg)
    t0 = time.perf_counter()
    with tracking.start_run(
        cfg, run_name=f"pipeline-{run_name}", tags={"stage": "pipeline", "recipe": cfg.recipe}
    ) as run:
        tracking.log_params_flat(cfg)
        tracking.set_tags(tracking.git_tags())
        curated = curate_flow(**common)
        data_tags = {"data.dvc_md5": dvc_recorded_md5(), "data.curated_digest": str(curated.get("digest", ""))}
        tracking.set_tags(data_tags)
        base = base_model_flow(**common, extra_tags=data_tags)
        base_eval = evaluate_flow(
            **common, model=base["output_dir"], metrics_path=None, run_name="evaluate-base_model", extra_tags=data_tags
        )
        trained = train_flow(**common, extra_tags=data_tags)
        final_eval = evaluate_flow(
            **common, model=trained["final_model"], run_name=f"evaluate-{run_name}", extra_tags=data_tags
        )
        summary = {
            "curate": curated,
            "base_model": base,
            "train": {k: v for k, v in trained.items() if k != "final_metrics"},
            "base_acc": base_eval["mean_acc"],
            "final_acc": final_eval["mean_acc"],
            "k": final_eval.get("n"),
            "parent_run_id": run.info.run_id,
            "tracking_uri": resolved_tracking_uri(cfg),
            "wall_s": time.perf_counter() - t0,
        }
        tracking.log_metrics({"pipeline/base_acc": summary["base_acc"], "pipeline/final_acc": summary["final_acc"]}, 0)
    summary["dvc_committed"] = _dvc_commit(plog) if dvc_commit else False
    plog.info(
        "pipeline done in %.0fs: held-out avg@%s %.3f (base model) -> %.3f (after %s)",
        summary["wall_s"],
        summary["k"],
        summary["base_acc"],
        summary["final_acc"],
        run_name,
    )
    return summary
