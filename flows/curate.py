"""The data flows: the seeded raw file (``dapo data generate``) and curation (``dapo curate``).

    dapo data generate                    # data/synthetic/problems.jsonl; kept if present (--force rewrites)
    dapo curate                           # outputs/curated/{train,val}.parquet + card.json/card.md + MLflow run
    dapo curate --set curation.val_size=100 --set data.max_prompt_length=24
    dvc repro                             # the curate stage of dvc.yaml runs `dapo curate` (venv active)

Raw layout: everything under ``data/`` is input, tracked by ``data.dvc`` (``dvc add data``); no stage writes
there. The default input is ``data/synthetic/problems.jsonl`` (``curation.synthetic``: 20,000 seeded problems),
re-created bit-identically by ``dapo data generate`` -- so a fresh clone needs no DVC remote::

    dapo data generate && dvc repro       # a fresh clone, offline; `dvc status` then shows data.dvc matched

Other inputs (a DAPO-Math-17k parquet, an AIME parquet, a jsonl/csv with problem + answer) go anywhere under
``data/`` (then ``dvc add data``) and are listed in ``curation.sources`` / ``curation.val_sources``; a Hugging
Face id is written ``hf:BytedTsinghua-SIA/DAPO-Math-17k`` (needs ``pip install datasets``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.utilities.annotations import quote

from dapo_core.config import DapoConfig
from dapo_core.config.curation import CurationConfig
from dapo_core.data.curate import DEFAULT_OUTPUT_DIR
from tasks.data import (
    curate_sources,
    curation_settings,
    generate_synthetic,
    log_curation,
    read_source,
    resolve_curation,
    write_curated,
)

logger = logging.getLogger(__name__)


@flow(name="dapo-data-generate", log_prints=False, validate_parameters=True)
def generate_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Write the synthetic raw file of ``curation.synthetic`` (kept when present unless ``force``)."""
    _, ccfg = resolve_curation(config_path, recipe, overrides or [])
    return generate_synthetic(ccfg.synthetic, force=force)


@flow(name="dapo-curate", log_prints=False, validate_parameters=True)
def curate_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    output_dir: str = DEFAULT_OUTPUT_DIR,
    generate_missing: bool = True,
    track: bool = True,
) -> dict[str, Any]:
    """Curate the configured sources into ``output_dir`` (train/val parquet + data card); see the module doc."""
    cfg, ccfg = resolve_curation(config_path, recipe, overrides or [])
    return run_curation(cfg, ccfg, output_dir=output_dir, generate_missing=generate_missing, track=track)


def run_curation(
    cfg: DapoConfig, ccfg: CurationConfig, *, output_dir: str, generate_missing: bool, track: bool
) -> dict[str, Any]:
    """The flow body, callable from other flows (e.g. the pipeline) with configs already resolved."""
    specs, val_specs = ccfg.train_specs(), list(ccfg.val_sources)
    synthetic = Path(ccfg.synthetic.path)
    if generate_missing and not synthetic.is_file() and any(Path(s.path) == synthetic for s in specs + val_specs):
        generate_synthetic(ccfg.synthetic)
    train = [read_source(s) for s in specs]
    val = [read_source(s) for s in val_specs]
    settings = curation_settings(cfg, ccfg)
    # quote(): Prefect would otherwise walk these large in-memory inputs (millions of rows) looking for futures.
    result, card = curate_sources(quote(train), quote(val), settings)  # type: ignore[call-overload]
    files = write_curated(quote(result), card, output_dir, quote([*train, *val]))  # type: ignore[call-overload]
    run_id = log_curation(cfg, settings, card, files) if track else None
    counts = card["counts"]
    return {
        "output_dir": output_dir,
        "files": [str(p) for p in files.paths],
        "digest": files.digest,
        "rows_in": counts["rows_in"],
        "train": counts["train"],
        "val": counts["val"],
        "dropped": counts["dropped"],
        "mlflow_run_id": run_id,
    }
