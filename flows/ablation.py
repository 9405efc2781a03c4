"""The ablation flow: DAPO's Table 1 in miniature, in two optimisation regimes, against a supervised control.

Run it::

    dapo ablation                                   # tiny-dapo, both regimes, 3 seeds, recipe's steps
    dapo ablation --regimes tuned --seeds 5 --steps 48 --out benchmarks/results
    dapo ablation --quick                           # 1 seed, 2 steps, both regimes -> outputs/ablation-quick/
    dapo ablation --regimes tuned --rungs dapo,gspo,cispo,gmpo,dr-grpo --name successors   # DAPO's successors

Steps: curate + base model (reused when up to date; or ``--base DIR``) -> evaluate the base model -> for each
regime (``tuned``: the recipe's lr; ``aggressive``: 3x, where GRPO collapses) and each cumulative rung of the ladder
(``dapo_core.config.ablation``) and seed: train (a nested MLflow run tagged ``ablation.*``) and evaluate the final
model -> the supervised control of each regime and seed: continue the warm start for the dapo rung's training time
-> ``ablation.json`` / ``.md`` / ``.png`` (``dapo_core.evaluation.ablation_report``), logged to the parent run.
Every evaluation uses the same config, hence the same fixed sampling seed, on ``data.val_files``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from dapo_core.config import DapoConfig, load_config
from dapo_core.config.ablation import (
    ALL_RUNGS,
    EVIDENCE_KEYS,
    SFT_CONTROL,
    Regime,
    Rung,
    build_ladder,
    build_regimes,
    parse_rungs,
    run_name,
    run_overrides,
)
from dapo_core.engines.sft import WarmStartConfig
from dapo_core.engines.sft_control import continue_warm_start, stream_offset
from dapo_core.evaluation.ablation_journal import AblationJournal, file_digest, fingerprint
from dapo_core.evaluation.ablation_report import report_stem, summarize_rung, write_report
from flows.base_model import base_model_flow, warm_start_settings
from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.train import train_flow
from tasks import flow_runs, tracking
from tasks.base_model import STAMP_FILE, read_exclusions
from tasks.evaluate import load_run_histories

logger = logging.getLogger(__name__)

DEFAULT_RECIPE = "tiny-dapo"
DEFAULT_OUT_DIR = "benchmarks/results"
QUICK_OUT_DIR = "outputs/ablation-quick"
DEFAULT_SEEDS = 3
QUICK_SEEDS, QUICK_STEPS = 1, 2
STEP_TIME_KEY = "timing_s/step"  # per-step training wall time
# per-step CPU seconds of the training process: their sum is the control's budget (other jobs inflate it less than wall time)
STEP_CPU_KEY = "perf/cpu_time_per_step"
_VAL_KEY = re.compile(r"^val/[^/]+/acc/mean_at_(\d+)$")


@task(name="sft-control", cache_policy=NO_CACHE)
def sft_control(
    cfg: DapoConfig,
    ws: WarmStartConfig,
    base_dir: str,
    *,
    budget_s: float,
    budget_kind: str,
    exclude: list[str],
    skip_steps: int | None,
    output_dir: str,
    seed: int = 1,
) -> dict[str, Any]:
    """Continue the warm start for ``budget_s`` seconds of ``budget_kind`` ("cpu": this process's CPU time, or
    "wall") on the demonstrations of ``seed`` (``continue_warm_start``); returns steps, wall and CPU time, last
    loss, model dir."""
    budget = {"cpu_budget_s": budget_s} if budget_kind == "cpu" else {"time_budget_s": budget_s}
    res = continue_warm_start(
        cfg, ws, base_dir, exclude=exclude, skip_steps=skip_steps, output_dir=output_dir, seed=seed, **budget
    )
    return {
        "steps": res.steps, "wall_s": res.wall_s, "cpu_s": res.cpu_s, "final_loss": res.final_loss,
        "output_dir": str(res.output_dir),
    }  # fmt: skip


def _warm_start_steps(base_dir: str) -> int | None:
    """SFT steps the warm start ran (its stamp), so the control continues the stream right after them."""
    stamp = Path(base_dir) / STAMP_FILE
    try:
        return int(json.loads(stamp.read_text(encoding="utf-8"))["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("no readable %s: the control skips base_model.steps batches of the SFT stream", stamp)
        return None


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


def _tags(regime: str, rung: str, seed: int, kind: str) -> dict[str, str]:
    return {"ablation.regime": regime, "ablation.rung": rung, "ablation.seed": str(seed), "ablation.kind": kind}


# knobs added after runs were journaled, at the value that keeps the behaviour those runs had: left out of the
# fingerprint at that value, so a journal written before the knob existed still resumes (any other value counts)
# (rollout.hf_decode: the static loop samples generate's tokens up to float ties, but over a whole run one flipped
# near-tie is enough to change a result by a sample, so a run decoded the other way is another run)
FINGERPRINT_NEUTRAL: dict[tuple[str, str], Any] = {
    ("rollout", "mode"): "sync",
    ("rollout", "max_staleness"): 1,
    ("rollout", "hf_decode"): "generate",
}


def _config_view(cfg: DapoConfig) -> dict[str, Any]:
    """The config as it determines results: tracking (where results go, maybe credentials) left out, and the
    ``FINGERPRINT_NEUTRAL`` knobs at their neutral values."""
    view = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "tracking"}
    for (section, key), neutral in FINGERPRINT_NEUTRAL.items():
        if view.get(section, {}).get(key, neutral) == neutral:
            view.get(section, {}).pop(key, None)
    return view


def _train_key(common: dict[str, Any], overrides: list[str], base: dict[str, Any]) -> str:
    run_cfg = load_config(config_path=common["config_path"], recipe=common["recipe"], overrides=overrides)
    return fingerprint({"kind": "train", "run": _config_view(run_cfg), **base["digests"]})


def _train_and_score(
    common: dict[str, Any],
    cfg: DapoConfig,
    rung: Rung,
    regime: Regime,
    seed: int,
    steps: int,
    base: dict[str, Any],
    journal: AblationJournal,
) -> dict[str, Any]:
    """One (regime, rung, seed): train, evaluate the final model, read the curve and the evidence back (or the
    journaled record of an identical run, with ``--resume``)."""
    tags = _tags(regime.name, rung.name, seed, "train")
    overrides = run_overrides(common["overrides"], rung, regime, seed, steps, model_path=base["dir"])
    key = _train_key(common, overrides, base)
    if (done := journal.get(key)) is not None:
        get_run_logger().info(
            "%s: reusing the journaled run %s", run_name(regime.name, rung.name, seed), done["run_id"]
        )
        return done
    t0 = time.perf_counter()
    trained = train_flow(
        config_path=common["config_path"], recipe=common["recipe"], overrides=overrides, nested=True, extra_tags=tags
    )
    wall = time.perf_counter() - t0
    name = run_name(regime.name, rung.name, seed)
    ev = evaluate_flow(
        **common, model=trained["final_model"], metrics_path=None, nested=True, run_name=f"{name}-eval",
        extra_tags={**tags, "ablation.kind": "eval"},
    )  # fmt: skip
    val = _run_histories(cfg, trained["run_id"], None)
    hist = _run_histories(cfg, trained["run_id"], [*EVIDENCE_KEYS, STEP_TIME_KEY, STEP_CPU_KEY])
    record = {
        "seed": seed,
        "acc": ev["mean_acc"],
        "wall_s": wall,
        "train_s": sum(v for _, v in hist.get(STEP_TIME_KEY, [])),
        "train_cpu_s": sum(v for _, v in hist.get(STEP_CPU_KEY, [])),
        "curve": [[0, base["acc"]], *_curve(val, cfg.rollout.val_n)],  # step 0: the base model's evaluation
        **_evidence(hist),
        "run_id": trained["run_id"],
        "eval_run_id": ev["run_id"],
        "git_sha": tracking.git_tags().get("git.sha", "unknown"),
    }
    return journal.put(key, record)


def _control_budget(dapo: dict[str, Any], seed: int, executor: str) -> tuple[float, str]:
    """The control's budget for ``seed``: the dapo rung's summed per-step CPU seconds (local executor: the
    training process did all the work, and other jobs on the machine inflate CPU time less than wall time), else its summed
    per-step wall time (Ray workers' CPU time is not the driver's), else the run's whole wall time."""
    i = dapo["seed_ids"].index(seed)
    cpu = (dapo.get("train_cpu_s") or [None] * len(dapo["seed_ids"]))[i]
    if executor == "local" and cpu:
        return float(cpu), "cpu"
    return float(dapo["train_s"][i] or dapo["wall_s_seeds"][i]), "wall"


def _control(
    common: dict[str, Any],
    cfg: DapoConfig,
    regime: Regime,
    seed: int,
    budget: tuple[float, str],
    base: dict[str, Any],
    journal: AblationJournal,
) -> dict[str, Any]:
    """The supervised control of one (regime, seed): the base model, ``budget`` more seconds of SFT, evaluated."""
    budget_s, kind = budget
    name = run_name(regime.name, SFT_CONTROL, seed)
    key = fingerprint(
        {"kind": "control", "config": _config_view(cfg), "seed": seed, "regime": [regime.name, regime.lr],
         "budget": [round(budget_s, 3), kind], "stream_offset": stream_offset(base["ws"], seed), **base["digests"]}
    )  # fmt: skip
    if (done := journal.get(key)) is not None:
        get_run_logger().info("%s: reusing the journaled run %s", name, done["run_id"])
        return done
    tags = _tags(regime.name, SFT_CONTROL, seed, "control")
    with tracking.start_run(cfg, run_name=name, nested=True, tags=tags) as run:
        res = sft_control(
            cfg, base["ws"], base["dir"], budget_s=budget_s, budget_kind=kind, exclude=base["exclude"],
            skip_steps=base["skip_steps"], output_dir=str(Path(cfg.trainer.output_dir) / name), seed=seed,
        )  # fmt: skip
        metrics = {
            f"control/{kind}_budget_s": budget_s, "control/wall_s": res["wall_s"], "control/cpu_s": res["cpu_s"],
            "control/steps": res["steps"],
        }  # fmt: skip
        tracking.log_metrics({**metrics, "control/final_loss": res["final_loss"]}, step=res["steps"])
        control_run_id = run.info.run_id
    ev = evaluate_flow(
        **common, model=res["output_dir"], metrics_path=None, nested=True, run_name=f"{name}-eval",
        extra_tags={**tags, "ablation.kind": "eval"},
    )  # fmt: skip
    record = {
        "seed": seed,
        "acc": ev["mean_acc"],
        "wall_s": res["wall_s"],
        "cpu_s": res["cpu_s"],
        "budget_s": budget_s,
        "budget_kind": kind,
        "sft_steps": res["steps"],
        "curve": [],
        "run_id": control_run_id,
        "eval_run_id": ev["run_id"],
        "git_sha": tracking.git_tags().get("git.sha", "unknown"),
    }
    return journal.put(key, record)


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
        "skip_steps": _warm_start_steps(base),
        # what a journaled result depends on besides its config: the base weights and the data (and the evaluation)
        "digests": {"base": file_digest(base), "data": {f: file_digest(f) for f in files}, "eval": _config_view(cfg)},
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
) -> dict[str, Any]:
    """Run the ladder x regimes x seeds (+ the supervised control), write and log the report; returns the results.

    Defaults: recipe ``tiny-dapo`` (when no config file is given either), both regimes, the recipe's
    ``trainer.total_steps``, seeds 1..3, the Table-1 ladder and ``sft-control`` (``rungs``: any of
    ``dapo_core.config.ablation.KNOWN_RUNGS``, successors included). ``name``: the report files' stem.
    Every finished run is journaled in ``<out_dir>/<name>.journal.jsonl``; ``resume`` reuses the runs whose
    config, base model and data are unchanged, under the same parent MLflow run.
    """
    plog = get_run_logger()
    if config_path is None and recipe is None:
        recipe = DEFAULT_RECIPE
    common: dict[str, Any] = {"config_path": config_path, "recipe": recipe, "overrides": list(overrides or [])}
    cfg = load_config(config_path=config_path, recipe=recipe, overrides=common["overrides"])
    if seeds < 1:
        raise ValueError(f"--seeds ({seeds}) must be >= 1 (seeds 1..N go to trainer.seed), e.g. --seeds 3")
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
    tags = {"stage": "ablation", "recipe": cfg.recipe or "", **tracking.git_tags()}
    parent_name = f"ablation-{cfg.recipe}" if name == "ablation" else f"{name}-{cfg.recipe}"
    parent_id = journal.parent_run_id if resume and tracking.run_exists(cfg, journal.parent_run_id) else None
    interrupted = tracking.run_tag(cfg, parent_id, "prefect.flow_run_id") if parent_id else None
    with tracking.start_run(cfg, run_name=parent_name, run_id=parent_id, tags=tags) as parent:
        journal.set_parent(parent.info.run_id)
        if flow_runs.mark_resumed(interrupted):  # the killed ablation's flow run: CRASHED, naming this one
            tracking.set_tags({"prefect.resumed_flow_run_id": str(interrupted)})
        if parent_id is None:
            tracking.log_params_flat(cfg)
        tracking.set_tags(
            {
                "ablation.steps": n_steps,
                "ablation.seeds": seeds,
                "ablation.regimes": ",".join(r.name for r in plan),
                "ablation.rungs": ",".join(rung_names),
            }
        )
        prepared = _prepare_base(common, cfg, base)
        base_eval = evaluate_flow(
            **common, model=prepared["dir"], metrics_path=None, nested=True, run_name="ablation-eval-base_model"
        )
        results: dict[str, Any] = {"regimes": {}}
        for regime in plan:
            rungs = []
            for rung in ladder:
                plog.info("ablation %s / %s (lr %g): %d seed(s) x %d steps", regime.name, rung.name, regime.lr, seeds, n_steps)  # fmt: skip
                records = [
                    _train_and_score(
                        common, cfg, rung, regime, seed, n_steps, {**prepared, "acc": base_eval["mean_acc"]}, journal
                    )
                    for seed in range(1, seeds + 1)
                ]
                rungs.append(summarize_rung(rung.name, records))
            if SFT_CONTROL in rung_names:
                # the control's budget: the dapo rung's training steps' time (not validations or checkpoints)
                dapo = next(r for r in rungs if r["name"] == "dapo")
                controls = [
                    _control(
                        common, cfg, regime, s, _control_budget(dapo, s, cfg.resources.executor), prepared, journal
                    )
                    for s in range(1, seeds + 1)
                ]
                rungs.insert(rung_names.index(SFT_CONTROL), summarize_rung(SFT_CONTROL, controls))
            results["regimes"][regime.name] = {"lr": regime.lr, "rungs": rungs}
            tracking.log_metrics({f"ablation/{regime.name}/{r['name']}/mean": r["mean"] for r in rungs}, step=n_steps)
        results.update(
            {
                "recipe": cfg.recipe,
                "steps": n_steps,
                "num_seeds": seeds,
                "k": base_eval.get("n"),
                "eval_seed": base_eval.get("seed"),
                "base_acc": base_eval["mean_acc"],
                "base_model": prepared["dir"],
                # tracking.* left out: a store URI may carry credentials, and the report may be committed
                "config": {
                    "overrides": [o for o in common["overrides"] if not o.startswith("tracking.")],
                    "ladder": {r.name: r.overrides() for r in ladder},
                },
                "date": datetime.now().isoformat(timespec="seconds"),
                "parent_run_id": parent.info.run_id,
                "wall_s": time.perf_counter() - t0,
                "reused_runs": journal.reused,
            }
        )
        paths = write_report(results, out_dir, name=name)
        for path in (paths.json, paths.md, paths.png):
            tracking.log_artifact(path, "ablation")
    plog.info("ablation done in %.0fs: %s, %s, %s", results["wall_s"], paths.json, paths.md, paths.png)
    return {**results, "paths": {"json": str(paths.json), "md": str(paths.md), "png": str(paths.png)}}
