"""Prefect tasks of the data stage: raw-data generation, source reading, curation, writing, DVC + MLflow records.

One task per side-effect boundary; the work is ``dapo_core.data`` (pure curation, loaders, card). Nothing is
cached by Prefect (the inputs are large, the outputs are files that DVC tracks); the tasks pass ``SourceRows``
and ``CurationResult`` in-process.

Config: the main config (``data.template``, ``data.max_prompt_length``, ``model.tokenizer_path``, tracking) plus
the ``curation:`` section (``dapo_core.config.curation.CurationConfig``), read from the same YAML file or recipe.
``--set curation.val_size=100`` overrides it like any other key; a missing section means all defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig, load_config
from dapo_core.config.curation import CurationConfig, SyntheticDataConfig
from dapo_core.data.card import CARD_JSON, CARD_MD, build_card, render_markdown, write_card
from dapo_core.data.curate import curate
from dapo_core.data.curate_report import CurationResult
from dapo_core.data.freshness import check_unchanged
from dapo_core.data.loaders import SourceRows, SourceSpec, file_md5, load_source
from dapo_core.data.schema import write_rl_parquet
from dapo_core.data.templates import CHAR_TOKENIZER, load_token_counter

logger = logging.getLogger(__name__)

SECTION = "curation"
DATA_DVC = "data.dvc"
SPLIT_FILES = {"train": "train.parquet", "val": "val.parquet"}
METRIC_PREFIX = "data/"  # MLflow metrics of a curation: data/rows_in, data/dropped/duplicate, ...


# ---------------- config: the main config + the curation section ----------------


def resolve_curation(
    config_path: str | Path | None = None, recipe: str | None = None, overrides: Sequence[str] = ()
) -> tuple[DapoConfig, CurationConfig]:
    """The main config and its curation section (file or recipe -> environment -> ``--set``)."""
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=list(overrides))
    return cfg, cfg.curation


def tokenizer_spec(cfg: DapoConfig, ccfg: CurationConfig) -> str:
    """The tokenizer that measures prompts: curation.tokenizer, else model.tokenizer_path, else 'char'."""
    return ccfg.tokenizer or cfg.model.tokenizer_path or CHAR_TOKENIZER


def curation_settings(cfg: DapoConfig, ccfg: CurationConfig) -> dict[str, Any]:
    """The knobs that determine the curated bytes (recorded in the card and as MLflow params)."""
    return {
        "template": cfg.data.template,
        "max_prompt_length": cfg.data.max_prompt_length,
        "tokenizer": tokenizer_spec(cfg, ccfg),
        "val_size": ccfg.val_size,
        "seed": ccfg.seed,
    }


# ---------------- DVC bookkeeping (reads files; DVC itself is not imported) ----------------


def dvc_recorded_md5(dvc_file: str | Path = DATA_DVC) -> str:
    """The md5 DVC recorded for the raw data in ``data.dvc`` ("none" when there is no such file)."""
    path = Path(dvc_file)
    if not path.is_file():
        return "none"
    outs = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("outs") or [{}]
    return str(outs[0].get("md5", "none"))


def dvc_dir_md5(directory: str | Path) -> str:
    """DVC's md5 of a directory: md5 of the sorted ``[{"md5", "relpath"}]`` JSON listing, plus ``.dir``
    (dvc-data's tree digest), so it can be compared with ``data.dvc`` without running DVC."""
    root = Path(directory)
    files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).parts)
    listing = [{"md5": file_md5(p), "relpath": p.relative_to(root).as_posix()} for p in files]
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode()).hexdigest() + ".dir"


def dvc_tags(out_paths: Sequence[Path], data_dir: str | Path = "data") -> dict[str, str]:
    """MLflow tags tying a curation to DVC: the raw data's recorded and current md5, and each output's md5."""
    recorded = dvc_recorded_md5(Path(data_dir).with_suffix(".dvc"))
    current = dvc_dir_md5(data_dir) if Path(data_dir).is_dir() else "none"
    tags = {
        "data.dvc_md5": recorded,
        "data.dvc_md5_current": current,
        "data.dvc_matches": str(recorded == current).lower(),
    }
    tags.update({f"dvc.md5.{p.name}": file_md5(p) for p in out_paths})
    return tags


# ---------------- tasks ----------------


@dataclass
class CuratedFiles:
    """Where a curation wrote its outputs, and the digest of their content."""

    train: Path
    val: Path
    card_json: Path
    card_md: Path
    digest: str

    @property
    def paths(self) -> list[Path]:
        return [self.train, self.val, self.card_json, self.card_md]


@task(name="generate-synthetic-data", cache_policy=NO_CACHE)
def generate_synthetic(cfg: SyntheticDataConfig, force: bool = False) -> dict[str, Any]:
    """Write the seeded synthetic raw file (skipped when it exists, unless ``force``). Same config, same bytes."""
    from dapo_core.data.synthetic import generate_problems, write_raw_jsonl

    path = Path(cfg.path)
    created = force or not path.is_file()
    if created:
        problems = generate_problems(cfg.n, seed=cfg.seed, min_ops=cfg.min_ops, max_ops=cfg.max_ops)
        write_raw_jsonl(problems, path)
    else:
        logger.info("%s exists: kept (use --force to rewrite it)", path)
    return {"path": str(path), "created": created, "md5": file_md5(path), "n": cfg.n, "seed": cfg.seed}


@task(name="load-source", cache_policy=NO_CACHE)
def read_source(spec: SourceSpec) -> SourceRows:
    return load_source(spec)


@task(name="curate", cache_policy=NO_CACHE)
def curate_sources(
    train: Sequence[SourceRows], val: Sequence[SourceRows], settings: Mapping[str, Any]
) -> tuple[CurationResult, dict[str, Any]]:
    """Validate, de-duplicate, normalise and split (pure ``dapo_core.data.curate``); returns the result and card."""
    result = curate(
        train,
        val,
        template=settings["template"],
        max_prompt_length=settings["max_prompt_length"],
        count_tokens=load_token_counter(settings["tokenizer"]),
        val_size=settings["val_size"],
        seed=settings["seed"],
    )
    return result, build_card(result, settings=settings)


@task(name="write-curated", cache_policy=NO_CACHE)
def write_curated(
    result: CurationResult, card: Mapping[str, Any], output_dir: str | Path, sources: Sequence[SourceRows] = ()
) -> CuratedFiles:
    """Write train/val parquet and the card; each file lands by rename, so a failure leaves the old ones whole.

    ``sources`` (the rows the result came from) are checked first: one whose file changed since it was read is a
    ``SourceChangedError`` and nothing is written."""
    check_unchanged(sources)
    out = Path(output_dir)
    train = write_rl_parquet(result.train, out / SPLIT_FILES["train"])
    val = write_rl_parquet(result.val, out / SPLIT_FILES["val"])
    card_json, card_md = write_card(card, out)
    logger.info("wrote %s (%d rows), %s (%d rows) and the card", train, len(result.train), val, len(result.val))
    return CuratedFiles(train, val, card_json, card_md, str(card["dataset_digest"]))


def curation_metrics(card: Mapping[str, Any]) -> dict[str, float]:
    """The card's numbers as MLflow metrics (``data/rows_in``, ``data/dropped/duplicate``, ...)."""
    counts = card["counts"]
    metrics = {f"{METRIC_PREFIX}{k}": float(counts[k]) for k in ("rows_in", "kept", "train", "val")}
    metrics.update({f"{METRIC_PREFIX}dropped/{k}": float(v) for k, v in counts["dropped"].items()})
    metrics[f"{METRIC_PREFIX}conflicting_answers"] = float(counts["conflicting_answers"])
    for split, stats in card["splits"].items():
        for k, v in stats["prompt_tokens"].items():
            metrics[f"{METRIC_PREFIX}{split}/prompt_tokens/{k}"] = float(v)
    return metrics


@task(name="log-curation", cache_policy=NO_CACHE)
def log_curation(cfg: DapoConfig, settings: Mapping[str, Any], card: Mapping[str, Any], files: CuratedFiles) -> str:
    """One MLflow run for the curation: settings as params, counts as metrics, the card, digest and DVC md5s."""
    import mlflow

    from tasks import tracking

    tags = {
        **tracking.git_tags(),
        "stage": "curate",
        "recipe": cfg.recipe,
        "data.digest": files.digest,
        **dvc_tags(files.paths),
    }
    # nested: inside a pipeline's run it becomes a child run (start_run ignores it when no run is active)
    with tracking.start_run(cfg, run_name="curate", tags=tags, nested=True) as run:
        mlflow.log_params({f"{SECTION}.{k}": v for k, v in settings.items()})
        tracking.log_metrics(curation_metrics(card), step=0)
        tracking.log_json(dict(card), f"data_card/{CARD_JSON}")
        tracking.log_text(render_markdown(card), f"data_card/{CARD_MD}")
        return str(run.info.run_id)
