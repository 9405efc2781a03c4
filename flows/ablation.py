"""The ablation flow: DAPO's Table 1 in miniature, in two optimisation regimes, against a supervised control.

Run it::

    dapo ablation                                   # tiny-dapo-table1, both regimes, 3 seeds, recipe's steps
    dapo ablation --regimes tuned --seeds 5 --steps 48 --out benchmarks/results
    dapo ablation --quick                           # 1 seed, 2 steps, both regimes -> outputs/ablation-quick/
    dapo ablation --resume --eval-k 64              # the journaled runs scored again at avg@64, none trained again
    dapo ablation --regimes tuned --rungs dapo,gspo,cispo,gmpo,dr-grpo --name successors   # DAPO's successors

Steps: curate + base model (reused when up to date; or ``--base DIR``) -> evaluate the base model -> for each
regime (``tuned``: the recipe's lr; ``aggressive``: 4x, where GRPO collapses) and each cumulative rung of the ladder
(``dapo_core.config.ablation``) and seed: train (a nested MLflow run tagged ``ablation.*``) and score the final
model at held-out avg@32 (``--eval-k``; the curves keep the runs' own avg@``rollout.val_n`` validation) -> the
supervised control of each regime and seed: continue the warm start for the dapo rung's training time ->
``ablation.json`` / ``.md`` / ``.png`` (``dapo_core.evaluation.ablation_report``), logged to the parent run.
Every evaluation uses the same config, hence the same fixed sampling seed, on ``data.val_files``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from dapo_core.config import DapoConfig, load_config
from dapo_core.config.ablation import (
    ALL_RUNGS,
    CONTROL_RUNGS,
    EVIDENCE_KEYS,
    SFT_CONTROL_CLEAN,
    Regime,
    Rung,
    build_ladder,
    build_regimes,
    parse_rungs,
    run_name,
    run_overrides,
)
from dapo_core.evaluation.ablation_journal import AblationJournal, code_digest, file_digest
from dapo_core.evaluation.ablation_report import report_stem, summarize_rung, write_report
from dapo_core.evaluation.runner import stop_split
from flows.ablation_runs import (
    announce_code_changes,
    config_view,
    control_budget,
    evaluate_final,
    provenance,
    reuse_journaled,
    run_control,
    run_keys,
    scored_record,
    tags_of,
    warm_start_steps,
)
from flows.base_model import base_model_flow, warm_start_settings
from flows.controls import STEP_CPU_KEY, STEP_TIME_KEY  # their sums: the controls' budgets
from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.train import train_flow
from tasks import flow_runs, tracking, tracking_store
from tasks.base_model import read_exclusions
from tasks.evaluate import load_run_histories

logger = logging.getLogger(__name__)

DEFAULT_RECIPE = "tiny-dapo-table1"  # tiny-dapo at batch 64 (the recipe says why)
DEFAULT_OUT_DIR = "benchmarks/results"
QUICK_OUT_DIR = "outputs/ablation-quick"
DEFAULT_SEEDS = 3
# Final scores: avg@32, as Table 1 scores AIME 2024: half the sampling noise of avg@8 (the recipe's rollout.val_n,
# which the curves keep). Measured: it moved the ladder's verdicts by under a point; the seed spread is the runs' own.
DEFAULT_EVAL_K = 32
QUICK_SEEDS, QUICK_STEPS = 1, 2
_VAL_KEY = re.compile(r"^val/[^/]+/acc/mean_at_(\d+)$")


def _run_histories(cfg: DapoConfig, run_id: str, keys: list[str] | None) -> dict[str, list[tuple[int, float]]]:
    histories = load_run_histories(cfg, [run_id], keys)
    return next(iter(histories.values()), {})


def _curve(val: dict[str, list[tuple[int, float]]], k: int) -> list[list[float]]:
    """[[step, val avg@k]] from the training run's validation keys (the mean over data sources)."""
    keys = [key for key in val if (m := _VAL_KEY.match(key)) and int(m.group(1)) == k] or [
        key for key in val if _VAL_KEY.match(key)
    ]
    by_step: dict[int, list[float]] = {}
    for key in keys:
        for step, value in val[key]:
            by_step.setdefault(int(step), []).append(float(value))
    return [[step, sum(v) / len(v)] for step, v in sorted(by_step.items())]


def _evidence(hist: dict[str, list[tuple[int, float]]]) -> dict[str, float | None]:
    return {key: (sum(v for _, v in hist[key]) / len(hist[key]) if hist.get(key) else None) for key in EVIDENCE_KEYS}


def _train_key(common: dict[str, Any], overrides: list[str], base: dict[str, Any]) -> tuple[str, str]:
    """The training run's journal key (its resolved config, the base model, the data and the code) and its key
    without the code (``run_keys``)."""
    run_cfg = load_config(config_path=common["config_path"], recipe=common["recipe"], overrides=overrides)
    return run_keys({"kind": "train", "run": config_view(run_cfg), **base["digests"]}, base["code"])


def _train_and_score(
    common: dict[str, Any],
    cfg: DapoConfig,
    rung: Rung,
    regime: Regime,
    seed: int,
    steps: int,
    base: dict[str, Any],
    journal: AblationJournal,
    k: int,
) -> dict[str, Any]:
    """One (regime, rung, seed): train, score the final model at held-out avg@k, read the curve and the evidence
    back (or the journaled record of an identical run, with ``--resume``, scored at k)."""
    tags = tags_of(regime.name, rung.name, seed, "train")
    overrides = run_overrides(common["overrides"], rung, regime, seed, steps, model_path=base["dir"])
    key, config_key = _train_key(common, overrides, base)
    name = run_name(regime.name, rung.name, seed)
    default_dir = Path(cfg.trainer.output_dir) / name / "final"
    reused = reuse_journaled(
        common, cfg, journal, key=key, default_model_dir=default_dir, k=k, run_name=name, tags=tags,
        config_key=config_key, code=base["code"],
    )  # fmt: skip
    if reused is not None:
        return reused
    t0 = time.perf_counter()
    trained = train_flow(
        config_path=common["config_path"], recipe=common["recipe"], overrides=overrides, nested=True, extra_tags=tags
    )
    wall = time.perf_counter() - t0
    ev = evaluate_final(common, trained["final_model"], k, f"{name}-eval", tags)
    val = _run_histories(cfg, trained["run_id"], None)
    hist = _run_histories(cfg, trained["run_id"], [*EVIDENCE_KEYS, STEP_TIME_KEY, STEP_CPU_KEY])
    record = {
        "seed": seed,
        "wall_s": wall,
        "train_s": sum(v for _, v in hist.get(STEP_TIME_KEY, [])),
        "train_cpu_s": sum(v for _, v in hist.get(STEP_CPU_KEY, [])),
        "curve": [[0, base["curve_acc"]], *_curve(val, cfg.rollout.val_n)],  # step 0: the base model's evaluation
        **_evidence(hist),
        "run_id": trained["run_id"],
        **provenance(base["code"]),  # code_digest, git_sha, git_dirty
    }
    return journal.put(key, scored_record(record, ev, k, trained["final_model"]), config_key=config_key)


def check_eval_k(k: int) -> int:
    """``k`` when it is a usable number of samples per problem, else ``ValueError`` naming the fix."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--eval-k ({k!r}) must be an integer >= 1 (samples per held-out problem), e.g. --eval-k 32")
    return k


def journal_path(out_dir: str | Path, name: str) -> Path:
    """Where the ablation journals its finished runs (beside the report; benchmarks/results/'s are committed so a later checkout can --resume)."""
    return Path(out_dir) / f"{name}.journal.jsonl"


def _prepare_base(common: dict[str, Any], cfg: DapoConfig, base: str | None) -> dict[str, Any]:
    """Curate, then the base model directory (the warm start unless given) and what the control needs."""
    curate_flow(**common)  # the RL data is needed either way (reused when up to date)
    if base is None:
        base = str(base_model_flow(**common, nested=True)["output_dir"])
    elif not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(
            f"--base {base}: not a model directory (no config.json). Pass an HF model directory such as "
            "outputs/base_model (made by `dapo base-model`), or leave --base out to build it"
        )
    files = [*cfg.data.train_files, *cfg.data.val_files]
    return {
        "dir": base,
        "ws": warm_start_settings(cfg),
        "exclude": read_exclusions(files),
        "skip_steps": warm_start_steps(base),
        # what a journaled result depends on besides its config: the base weights and the data (and the evaluation)
        "digests": {"base": file_digest(base), "data": {f: file_digest(f) for f in files}, "eval": config_view(cfg)},
        "code": code_digest(),  # ... and the code that trains and evaluates it (in the key apart: run_keys)
    }


@dataclass(frozen=True)
class _Parent:
    run_id: str
    resumed: str | None  # the parent run taken up again (--resume), or None for a new one


@contextmanager
def _parent_run(cfg: DapoConfig, journal: AblationJournal, name: str, resume: bool) -> Iterator[_Parent]:
    """The ablation's parent MLflow run: the journal's, when resuming and it still exists (the killed ablation's
    flow run is then marked CRASHED, naming this one), else a new one."""
    tags = {"stage": "ablation", "recipe": cfg.recipe or "", **tracking.git_tags()}
    parent_name = f"ablation-{cfg.recipe}" if name == "ablation" else f"{name}-{cfg.recipe}"
    parent_id = journal.parent_run_id if resume and tracking_store.run_exists(cfg, journal.parent_run_id) else None
    interrupted = tracking_store.run_tag(cfg, parent_id, "prefect.flow_run_id") if parent_id else None
    with tracking.start_run(cfg, run_name=parent_name, run_id=parent_id, tags=tags) as parent:
        journal.set_parent(parent.info.run_id)
        if flow_runs.mark_resumed(interrupted):
            tracking.set_tags({"prefect.resumed_flow_run_id": str(interrupted)})
        yield _Parent(parent.info.run_id, parent_id)


def _scored_base(
    common: dict[str, Any], cfg: DapoConfig, base: str | None, k: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The base model (``_prepare_base``) with its held-out score at ``k`` and at the runs' validation k (where
    their curves start); returns it and its evaluation at ``k``."""
    prepared = _prepare_base(common, cfg, base)
    base_eval = evaluate_flow(
        **common, model=prepared["dir"], k=k, metrics_path=None, nested=True, run_name="ablation-eval-base_model"
    )
    curve_k = cfg.rollout.val_n
    base_curve = base_eval if curve_k == k else evaluate_flow(
        **common, model=prepared["dir"], k=curve_k, metrics_path=None, nested=True,
        run_name=f"ablation-eval-base_model-k{curve_k}",
    )  # fmt: skip
    return {**prepared, "acc": base_eval["mean_acc"], "curve_acc": base_curve["mean_acc"]}, base_eval


def _regime_rows(
    common: dict[str, Any], cfg: DapoConfig, regime: Any, ladder: list[Any], rung_names: list[str], seeds: int,
    n_steps: int, prepared: dict[str, Any], journal: AblationJournal, k: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """One regime: every rung of the ladder over the seeds, then each control given the dapo rung's training time
    (its steps' time, not validations or checkpoints); one summary row per rung, in the order asked."""
    plog = get_run_logger()
    rows = []
    for rung in ladder:
        plog.info("ablation %s / %s (lr %g): %d seed(s) x %d steps", regime.name, rung.name, regime.lr, seeds, n_steps)
        records = [
            _train_and_score(common, cfg, rung, regime, seed, n_steps, prepared, journal, k)
            for seed in range(1, seeds + 1)
        ]
        rows.append(summarize_rung(rung.name, records))
    for control in [n for n in rung_names if n in CONTROL_RUNGS]:
        dapo = next(r for r in rows if r["name"] == "dapo")
        budgets = [control_budget(dapo, s, cfg.resources.executor) for s in range(1, seeds + 1)]
        controls = [
            run_control(common, cfg, regime, s, b, prepared, journal, k, clean=control == SFT_CONTROL_CLEAN)
            for s, b in enumerate(budgets, start=1)
        ]
        rows.append(summarize_rung(control, controls))
    rows.sort(key=lambda r: rung_names.index(r["name"]))
    return rows


def _base_record(base_eval: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """The base model's lines of the report: its score, the seed that scored it, its stop split, where it is."""
    return {
        "eval_seed": base_eval.get("seed"),
        "base_acc": base_eval["mean_acc"],
        "base_stop": stop_split(base_eval.get("metrics", {})),
        "base_model": base_dir,
    }


def _config_record(common: dict[str, Any], ladder: list[Any]) -> dict[str, Any]:
    """The report's config: the user's overrides and each rung's. tracking.* is left out: a store URI may carry
    credentials, and the report may be committed."""
    return {
        "overrides": [o for o in common["overrides"] if not o.startswith("tracking.")],
        "ladder": {r.name: r.overrides() for r in ladder},
    }


@flow(name="dapo-ablation", log_prints=False, validate_parameters=True)
def ablation_flow(
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    regimes: list[str] | None = None,
    tuned_lr: float | None = None,
    aggressive_lr: float | None = None,
    steps: int | None = None,
    seeds: int = DEFAULT_SEEDS,
    base: str | None = None,
    out_dir: str = DEFAULT_OUT_DIR,
    rungs: list[str] | None = None,
    name: str = "ablation",
    resume: bool = False,
    eval_k: int | None = None,
) -> dict[str, Any]:
    """Run the ladder x regimes x seeds (+ the supervised control), write and log the report; returns the results.

    Defaults: recipe ``tiny-dapo-table1`` (when no config file is given either), both regimes, the recipe's
    ``trainer.total_steps``, seeds 1..3, the Table-1 ladder and ``sft-control`` (``rungs``: any of
    ``dapo_core.config.ablation.KNOWN_RUNGS``, successors included). ``name``: the report files' stem.
    Every finished run is journaled in ``<out_dir>/<name>.journal.jsonl``; ``resume`` reuses the runs whose
    config, base model, data and code (``code_digest``) are unchanged, under the same parent MLflow run; a journaled
    run that other code trained is trained again, and the log says how many. ``eval_k``: samples per held-out
    problem of each final score (default ``DEFAULT_EVAL_K``, Table 1's avg@32); a journaled run scored at another k
    is scored again at this one, not trained again.

    Long because its signature takes the stage's 14 parameters and this docstring explains them; the body (checks,
    journal, parent run, base model, regimes, report) is ~50 lines.
    """
    plog = get_run_logger()
    if config_path is None and recipe is None:
        recipe = DEFAULT_RECIPE
    common: dict[str, Any] = {"config_path": config_path, "recipe": recipe, "overrides": list(overrides or [])}
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=common["overrides"])
    if seeds < 1:
        raise ValueError(f"--seeds ({seeds}) must be >= 1 (seeds 1..N go to trainer.seed), e.g. --seeds 3")
    k = check_eval_k(DEFAULT_EVAL_K if eval_k is None else eval_k)
    rung_names = parse_rungs(rungs or list(ALL_RUNGS))
    ladder = build_ladder(cfg, rung_names)
    plan = build_regimes(cfg, regimes or ["tuned", "aggressive"], tuned_lr=tuned_lr, aggressive_lr=aggressive_lr)
    n_steps = steps if steps is not None else cfg.trainer.total_steps
    report_stem(name)  # a bad --name fails here, before any work
    run_overrides([], ladder[0], plan[0], 1, n_steps)  # a bad --steps fails here, before any work
    t0 = time.perf_counter()
    journal = AblationJournal.open(journal_path(out_dir, name), resume=resume)
    plog.info(
        "journal %s: %d finished run(s) to reuse%s", journal.path, len(journal),
        "" if resume else " (after an interruption, rerun with --resume to keep the finished runs)",
    )  # fmt: skip
    code = code_digest()
    if resume:
        announce_code_changes(journal, code)
    with _parent_run(cfg, journal, name, resume) as parent:
        if parent.resumed is None:
            tracking.log_params_flat(cfg)
        tracking.set_tags(
            {
                "ablation.steps": n_steps,
                "ablation.seeds": seeds,
                "ablation.regimes": ",".join(r.name for r in plan),
                "ablation.rungs": ",".join(rung_names),
            }
        )
        prepared, base_eval = _scored_base(common, cfg, base, k)
        results: dict[str, Any] = {"regimes": {}}
        for regime in plan:
            rows = _regime_rows(common, cfg, regime, ladder, rung_names, seeds, n_steps, prepared, journal, k)
            results["regimes"][regime.name] = {"lr": regime.lr, "rungs": rows}
            tracking.log_metrics({f"ablation/{regime.name}/{r['name']}/mean": r["mean"] for r in rows}, step=n_steps)
        results.update(
            {
                "recipe": cfg.recipe, "steps": n_steps, "num_seeds": seeds, "k": k, "curve_k": cfg.rollout.val_n,
                **_base_record(base_eval, prepared["dir"]), "config": _config_record(common, ladder),
                "date": datetime.now().isoformat(timespec="seconds"), "parent_run_id": parent.run_id,
                "wall_s": time.perf_counter() - t0, "reused_runs": journal.reused,
                "retrained_for_code": journal.retrained_for_code, "code_digest": code,
            }
        )  # fmt: skip
        paths = write_report(results, out_dir, name=name)
        for path in (paths.json, paths.md, paths.png):
            tracking.log_artifact(path, "ablation")
    plog.info("ablation done in %.0fs: %s, %s, %s", results["wall_s"], paths.json, paths.md, paths.png)
    return {**results, "paths": {"json": str(paths.json), "md": str(paths.md), "png": str(paths.png)}}
