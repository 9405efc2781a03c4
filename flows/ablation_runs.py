"""The ablation's runs: a run's identity in the journal, its final score at held-out avg@k, the supervised control.

A journaled run is scored again, without training it again, when the ablation asks for another k than the one it
was scored at (``score``): its final model is evaluated at the new k and that evaluation journaled under the run.
Before that, the model on disk must be the journaled run's (its digest; for a record from before digests were
journaled, its journaled score must reproduce at the old k); otherwise the caller trains the run again.

A run's journal key holds the code that trains and evaluates it (``code_digest``): ``run_keys`` gives the key and
the key without the code, so a journaled run of the same config, base model and data trained by other code is
found, named in the log and trained again (``reuse_journaled``), never reused.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from dapo_core.config import DapoConfig
from dapo_core.config.ablation import SFT_CONTROL, SFT_CONTROL_CLEAN, Regime, run_name
from dapo_core.evaluation.ablation_journal import (
    PROJECT_ROOT,
    AblationJournal,
    code_digest,
    file_digest,
    fingerprint,
)
from dapo_core.evaluation.runner import stop_split
from dapo_core.warmstart.control import continue_warm_start, stream_offset
from dapo_core.warmstart.sft import WarmStartConfig
from flows.evaluate import evaluate_flow
from tasks import tracking
from tasks.base_model import STAMP_FILE

logger = logging.getLogger(__name__)

# knobs added after runs were journaled, at the value that keeps the behaviour those runs had: left out of the
# fingerprint at that value, so a journal written before the knob existed still resumes (any other value counts)
# (rollout.hf_decode: the static loop samples generate's tokens up to float ties, but over a whole run one flipped
# near-tie is enough to change a result by a sample, so a run decoded the other way is another run)
FINGERPRINT_NEUTRAL: dict[tuple[str, str], Any] = {
    ("rollout", "mode"): "sync",
    ("rollout", "max_staleness"): 1,
    ("rollout", "hf_decode"): "generate",
    ("rollout", "hf_procs"): 1,  # several processes give one process's tokens, but a near-tie may flip: another run
    ("base_model", "check_frac"): 0.0,  # added after the committed journals: at 0 the demonstrations are as before
    ("algorithm", "old_log_probs"): "recompute",  # added after them too: recompute is how those runs trained
}


def config_view(cfg: DapoConfig) -> dict[str, Any]:
    """The config as it determines results: tracking (where results go, maybe credentials) left out, and the
    ``FINGERPRINT_NEUTRAL`` knobs at their neutral values."""
    view = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "tracking"}
    base_model = view.get("base_model", {})
    base_model.update(base_model.pop("demos", {}))  # flat, as journaled before base_model.demos existed (issue 44)
    for (section, key), neutral in FINGERPRINT_NEUTRAL.items():
        if view.get(section, {}).get(key, neutral) == neutral:
            view.get(section, {}).pop(key, None)
    return view


def _log() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger inside a Prefect run, else this module's (the helpers are called outside one in tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logger


def run_keys(parts: dict[str, Any], code: str) -> tuple[str, str]:
    """A run's journal ``key`` (``parts`` and the ``code`` digest: what ``--resume`` reuses) and its ``config_key``
    (``parts`` alone: finds a journaled run of the same config, base model and data that other code trained)."""
    return fingerprint({**parts, "code": code}), fingerprint(parts)


def provenance(code: str | None = None) -> dict[str, Any]:
    """What a record says of the code that made it: ``code_digest`` (default: this checkout's), ``git_sha`` and
    ``git_dirty`` (true/false; "unknown" outside a git checkout)."""
    git = tracking.git_tags(PROJECT_ROOT)  # the checkout the code runs from, wherever the flow's working directory
    dirty = git.get("git.dirty", "unknown")
    return {
        "code_digest": code or code_digest(),
        "git_sha": git.get("git.sha", "unknown"),
        "git_dirty": {"true": True, "false": False}.get(dirty, "unknown"),
    }


def announce_code_changes(journal: AblationJournal, code: str) -> int:
    """Log, once, how many journaled runs other code trained (``--resume`` trains those of this plan again);
    returns that number."""
    counts = journal.runs_by_other_code(code)
    n = sum(counts.values())
    if n:
        others = ", ".join(d[:12] for d in sorted(counts))
        _log().info(
            "%d journaled run(s) were trained by other code (digest %s != %s): training them again",
            n, others, code[:12],
        )  # fmt: skip
    return n


def tags_of(regime: str, rung: str, seed: int, kind: str) -> dict[str, str]:
    return {"ablation.regime": regime, "ablation.rung": rung, "ablation.seed": str(seed), "ablation.kind": kind}


def evaluate_final(
    common: dict[str, Any], model_dir: str | Path, k: int, run_name: str, tags: dict[str, str]
) -> dict[str, Any]:
    """Held-out avg@k of a final model (nested eval run; the config's fixed sampling seed)."""
    return evaluate_flow(
        **common, model=str(model_dir), k=k, metrics_path=None, nested=True, run_name=run_name,
        extra_tags={**tags, "ablation.kind": "eval"},
    )  # fmt: skip


def scored_record(record: dict[str, Any], ev: dict[str, Any], k: int, model_dir: str | Path) -> dict[str, Any]:
    """``record`` with its final score (``acc`` at ``eval_k``), the score's stop split (``stop/*``: how much of it
    is stopping at the answer line, how much arithmetic) and the identity of the model scored."""
    return {
        **record, "acc": ev["mean_acc"], "eval_k": k, "eval_run_id": ev["run_id"], "model_dir": str(model_dir),
        "model_digest": file_digest(model_dir), **stop_split(ev.get("metrics", {})),
    }  # fmt: skip


def score(
    common: dict[str, Any],
    cfg: DapoConfig,
    journal: AblationJournal,
    *,
    key: str,
    record: dict[str, Any],
    model_dir: str | Path,
    k: int,
    run_name: str,
    tags: dict[str, str],
) -> dict[str, Any] | None:
    """The journaled run ``record`` (journal key ``key``) scored at held-out avg@k: as journaled when it was scored
    at k, else from the journal's evaluation of it at k, else evaluated now. None when its final model on disk is
    not the journaled run's any more (the caller trains it again)."""
    scored_k = int(record.get("eval_k", cfg.rollout.val_n))  # records from before eval_k: rollout.val_n
    if scored_k == k:
        return record
    eval_key = fingerprint({"kind": "eval", "of": key, "k": k})
    done = journal.get(eval_key, count=False)
    # an evaluation of an earlier run under the same key (since trained again) is not this run's score
    if done is not None and done.get("scored_run_id", record["run_id"]) == record["run_id"]:
        return {**record, **done}
    if not _same_model(common, record, model_dir, scored_k, run_name, tags):
        return None
    if not record.get("model_digest"):  # an older record, shown to be this model: journal its digest from now on
        record = journal.put(key, {**record, "model_dir": str(model_dir), "model_digest": file_digest(model_dir)})
    ev = evaluate_final(common, model_dir, k, f"{run_name}-eval-k{k}", tags)
    done = {
        "acc": ev["mean_acc"], "eval_k": k, "eval_run_id": ev["run_id"], "scored_run_id": record["run_id"],
        **stop_split(ev.get("metrics", {})),
    }  # fmt: skip
    journal.put(eval_key, done)
    return {**record, **done}


def reuse_journaled(
    common: dict[str, Any],
    cfg: DapoConfig,
    journal: AblationJournal,
    *,
    key: str,
    default_model_dir: str | Path,
    k: int,
    run_name: str,
    tags: dict[str, str],
    config_key: str | None = None,
    code: str | None = None,
) -> dict[str, Any] | None:
    """The journaled run under ``key`` scored at held-out avg@k (counted in ``journal.reused``), or None when there
    is none or its final model is not on disk as journaled (the caller runs it). With ``config_key`` and ``code``
    (``run_keys``): a journaled run of the same config trained by other code is logged and counted in
    ``journal.retrained_for_code`` (the caller trains it again)."""
    done = journal.get(key, count=False)
    if done is None:
        stale = journal.other_code(config_key, code) if config_key and code else None
        if stale is not None:
            journal.retrained_for_code += 1
            _log().info(
                "%s: the journaled run %s was trained by other code (digest %s != %s): training it again",
                run_name, stale.get("run_id"), str(stale.get("code_digest") or "none")[:12], str(code)[:12],
            )  # fmt: skip
        return None
    model_dir = done.get("model_dir") or default_model_dir  # records from before model_dir: the run's default
    scored = score(common, cfg, journal, key=key, record=done, model_dir=model_dir, k=k, run_name=run_name, tags=tags)
    if scored is not None:
        journal.reused += 1
        _log().info("%s: reusing the journaled run %s", run_name, done["run_id"])
    return scored


def _same_model(
    common: dict[str, Any], record: dict[str, Any], model_dir: str | Path, scored_k: int, run_name: str,
    tags: dict[str, str],
) -> bool:  # fmt: skip
    """Is ``model_dir`` the final model of the journaled run? Its digest when journaled; else (older records) its
    journaled score must reproduce exactly (the evaluation is deterministic: fixed seed, same problems)."""
    plog = _log()
    if not (Path(model_dir) / "config.json").is_file():
        plog.warning("%s: its final model %s is gone: training it again to score it", run_name, model_dir)
        return False
    if record.get("model_digest"):
        same = file_digest(model_dir) == record["model_digest"]
    else:
        ev = evaluate_final(common, model_dir, scored_k, f"{run_name}-eval-check", tags)
        same = math.isclose(float(ev["mean_acc"]), float(record["acc"]), abs_tol=1e-12)
    if not same:
        plog.warning(
            "%s: the model in %s is not the journaled run's (overwritten by another run?): training it again",
            run_name, model_dir,
        )  # fmt: skip
    return same


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
    clean: bool = False,
) -> dict[str, Any]:
    """Continue the warm start for ``budget_s`` seconds of ``budget_kind`` ("cpu": this process's CPU time, or
    "wall") on the demonstrations of ``seed`` (``continue_warm_start``; ``clean``: clean ones, at
    ``control.clean_lr``); returns steps, wall and CPU time, last loss, model dir."""
    budget = {"cpu_budget_s": budget_s} if budget_kind == "cpu" else {"time_budget_s": budget_s}
    res = continue_warm_start(
        cfg, ws, base_dir, exclude=exclude, skip_steps=skip_steps, output_dir=output_dir, seed=seed,
        lr=control_settings(cfg, clean)["lr"], clean=clean, **budget,
    )  # fmt: skip
    return {
        "steps": res.steps, "wall_s": res.wall_s, "cpu_s": res.cpu_s, "final_loss": res.final_loss,
        "output_dir": str(res.output_dir), "lr": res.lr,
    }  # fmt: skip


def control_settings(cfg: DapoConfig, clean: bool) -> dict[str, Any]:
    """What sets a control apart besides its budget: ``clean`` and its lr (None: the warm start's final lr)."""
    lr = cfg.control.clean_lr if clean and cfg.control.clean_lr is not None else cfg.control.lr
    return {"clean": clean, "lr": lr}


def warm_start_steps(base_dir: str) -> int | None:
    """SFT steps the warm start ran (its stamp), so the control continues the stream right after them."""
    stamp = Path(base_dir) / STAMP_FILE
    try:
        return int(json.loads(stamp.read_text(encoding="utf-8"))["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("no readable %s: the control skips base_model.steps batches of the SFT stream", stamp)
        return None


def control_budget(dapo: dict[str, Any], seed: int, executor: str) -> tuple[float, str]:
    """The control's budget for ``seed``: the dapo rung's summed per-step CPU seconds (local executor: the
    training process did all the work, and other jobs on the machine inflate CPU time less than wall time), else its summed
    per-step wall time (Ray workers' CPU time is not the driver's), else the run's whole wall time."""
    i = dapo["seed_ids"].index(seed)
    cpu = (dapo.get("train_cpu_s") or [None] * len(dapo["seed_ids"]))[i]
    if executor == "local" and cpu:
        return float(cpu), "cpu"
    return float(dapo["train_s"][i] or dapo["wall_s_seeds"][i]), "wall"


def run_control(
    common: dict[str, Any],
    cfg: DapoConfig,
    regime: Regime,
    seed: int,
    budget: tuple[float, str],
    base: dict[str, Any],
    journal: AblationJournal,
    k: int,
    clean: bool = False,
) -> dict[str, Any]:
    """The supervised control of one (regime, seed): the base model, ``budget`` more seconds of SFT (``clean``:
    on clean demonstrations, ``sft-control-clean``), scored at held-out avg@k (or the journaled control, scored
    at k)."""
    budget_s, kind = budget
    rung = SFT_CONTROL_CLEAN if clean else SFT_CONTROL
    name = run_name(regime.name, rung, seed)
    # a clean control's key names it; the habit-keeping control's key keeps the shape it always had
    extra = {"control": control_settings(cfg, clean)} if clean else {}
    key, config_key = run_keys(
        {"kind": "control", "config": config_view(cfg), "seed": seed, "regime": [regime.name, regime.lr],
         "budget": [round(budget_s, 3), kind], "stream_offset": stream_offset(base["ws"], seed), **base["digests"],
         **extra},
        base["code"],
    )  # fmt: skip
    tags = tags_of(regime.name, rung, seed, "control")
    output_dir = Path(cfg.trainer.output_dir) / name
    reused = reuse_journaled(
        common, cfg, journal, key=key, default_model_dir=output_dir, k=k, run_name=name, tags=tags,
        config_key=config_key, code=base["code"],
    )  # fmt: skip
    if reused is not None:
        return reused
    with tracking.start_run(cfg, run_name=name, nested=True, tags=tags) as run:
        res = sft_control(
            cfg, base["ws"], base["dir"], budget_s=budget_s, budget_kind=kind, exclude=base["exclude"],
            skip_steps=base["skip_steps"], output_dir=str(output_dir), seed=seed, clean=clean,
        )  # fmt: skip
        metrics = {
            f"control/{kind}_budget_s": budget_s, "control/wall_s": res["wall_s"], "control/cpu_s": res["cpu_s"],
            "control/steps": res["steps"],
        }  # fmt: skip
        tracking.log_metrics({**metrics, "control/final_loss": res["final_loss"]}, step=res["steps"])
        control_run_id = run.info.run_id
    ev = evaluate_final(common, res["output_dir"], k, f"{name}-eval", tags)
    record = {
        "seed": seed,
        "wall_s": res["wall_s"],
        "cpu_s": res["cpu_s"],
        "budget_s": budget_s,
        "budget_kind": kind,
        "sft_steps": res["steps"],
        "sft_lr": res["lr"],
        "curve": [],
        "run_id": control_run_id,
        **provenance(base["code"]),
    }
    return journal.put(key, scored_record(record, ev, k, res["output_dir"]), config_key=config_key)
