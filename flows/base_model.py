"""The base-model flow: a cached SFT warm start of the tiny Qwen2, the CPU default's stand-in for a pretrained base.

Run it: ``dapo base-model`` (params.yaml; writes ``outputs/base_model/``), ``dapo base-model --steps 300``,
``dapo base-model --force`` (rebuild even when the stamp matches). Real recipes skip this stage and name an HF
model in ``model.path``.

Steps: read the curated problems to exclude -> stamp the inputs -> reuse the directory if the stamp matches,
else warm-start (SFT on synthetic worked solutions, held-out accuracy) -> log metrics, stamp and model to MLflow.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, get_run_logger

from dapo_core.config import DapoConfig, load_config
from dapo_core.warmstart.sft import WarmStartConfig, exclusion_digest
from tasks import base_model as T
from tasks import tracking

logger = logging.getLogger(__name__)

# the base_model stage's fixed output (docs/design.md, "Stage outputs and raw data")
DEFAULT_OUTPUT_DIR = "outputs/base_model"
RUN_NAME = "base_model"


def warm_start_settings(cfg: DapoConfig, **knobs: Any) -> WarmStartConfig:
    """The config's ``base_model:`` section (seed: ``trainer.seed``), then every knob that is not None."""
    given = {k: v for k, v in knobs.items() if v is not None}
    seed = given.pop("seed", cfg.trainer.seed)
    return WarmStartConfig.from_config(cfg.base_model, seed=seed, max_new_tokens=cfg.data.max_response_length, **given)


@flow(name="dapo-base-model", log_prints=False, validate_parameters=True)
def base_model_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    output_dir: str = DEFAULT_OUTPUT_DIR,
    steps: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    heldout_size: int | None = None,
    heldout_k: int | None = None,
    time_budget_s: float | None = None,
    seed: int | None = None,
    exclude_files: list[str] | None = None,
    force: bool = False,
    nested: bool = False,
    extra_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Warm-start (or reuse) the tiny base model; returns the stage record (stamp, steps, metrics, run id).

    ``exclude_files`` default: ``data.train_files + data.val_files`` (the curated problems never enter SFT).
    Knobs left as None come from the config's ``base_model:`` section (the seed: ``trainer.seed``).
    """
    plog = get_run_logger()
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=overrides or [])
    ws = warm_start_settings(
        cfg, steps=steps, lr=lr, batch_size=batch_size, heldout_size=heldout_size, heldout_k=heldout_k,
        time_budget_s=time_budget_s, seed=seed,
    )  # fmt: skip
    files = exclude_files if exclude_files is not None else [*cfg.data.train_files, *cfg.data.val_files]
    exclude = T.read_exclusions(files)
    stamp = T.stage_stamp(cfg, ws, exclusion_digest(exclude))
    tags = {"stage": "base_model", "recipe": cfg.recipe or "", **tracking.git_tags(), **(extra_tags or {})}
    with tracking.start_run(cfg, run_name=RUN_NAME, nested=nested, tags=tags) as run:
        run_id = run.info.run_id
        tracking.log_params_flat(cfg, run_id=run_id)
        T.log_knobs(ws, run_id)
        record = None if force else T.cached_result(output_dir, stamp)
        cached = record is not None
        if record is None:
            plog.info("warm-starting the base model into %s (stamp %s)", output_dir, stamp["digest"][:12])
            record = T.warm_start(cfg, ws, exclude, output_dir, stamp, run_id)
        else:
            plog.info("base model at %s is up to date (stamp %s): reusing it", output_dir, stamp["digest"][:12])
        T.log_base_model(record, output_dir, run_id, cached=cached)
    summary = {**record, "run_id": run_id, "cached": cached, "output_dir": output_dir}
    heldout = {k: round(v, 4) for k, v in record.get("metrics", {}).items() if k.startswith("heldout/")}
    plog.info("base model ready at %s: %s", output_dir, heldout)
    return summary
