"""Is there a task split where DAPO beats both supervised controls? Probe-set experiments (issue 43.3).

The paper's setting: a verifier, and demonstrations that do not cover the hard part. Here: a warm start whose
demonstrations of problems with ``base_model.demos.scarce_from_ops`` operations or more are a fixed few
(``base_model.demos.scarce_demos``), RL on the whole range (the curated problems, answers only), both scored on the
whole range of the probe set (never the held-out problems). One setting per call:

    python -m benchmarks.probe_split TAG [--set base_model.demos.KEY=VALUE ...] [--steps 16]

1. ``dapo base-model`` with the settings -> outputs/probe/split-TAG/base (1200 steps: ~7 min on 2 cores);
2. the base model on the probe set: avg@8 and pass@8, per operation count (no hard-part signal: pass@8 ~ 0);
3. ``dapo train`` (tiny-dapo, ``--steps``) from it; its final model on the probe set;
4. both controls (``sft-control``, ``sft-control-clean`` at ``control.clean_lr``) for the RL run's training CPU
   seconds; each on the probe set.

Writes outputs/probe/split-TAG.json (and prints it): per model, avg@8, pass@8 and the stop split, all and per
operation count. Needs `python -m benchmarks.probe make` (the probe set) and `dapo curate` first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.probe import CURATED, PROBE_DIR, PROBE_FILE, _split_sets

K = 8


def _ops(question: str) -> int:
    return sum(question.count(op) for op in "+-*")


def score(cfg: Any, model_dir: str | Path) -> dict[str, Any]:
    """avg@8, pass@8 and the stop split on the probe set, overall and per operation count."""
    from tasks import evaluate as T

    records = T.load_problems([str(PROBE_FILE)])
    report = T.run_evaluation(cfg, T.resolve_model(cfg, str(model_dir)), records, k=K, seed=1234, ks=[K])
    ops = {rec.uid: _ops(rec.raw_problem) for rec in records}
    by_ops: dict[int, list[Any]] = {}
    for p in report.problems:
        by_ops.setdefault(ops[p.uid], []).append(p)
    out: dict[str, Any] = {
        "avg8": report.mean_acc(),
        "pass8": sum(p.pass_at[K] for p in report.problems) / len(records),
    }
    out["by_ops"] = {
        n: {"n": len(ps), "avg8": sum(p.mean_acc for p in ps) / len(ps), "pass8": sum(p.pass_at[K] for p in ps) / len(ps)}
        for n, ps in sorted(by_ops.items())
    }  # fmt: skip
    out["stop"] = {k.rsplit("/", 1)[-1]: v for k, v in report.metrics.items() if "/stop/" in k}
    return out


def main(tag: str, sets: list[str], steps: int) -> dict[str, Any]:
    from dapo_core.config import load_config
    from dapo_core.warmstart.control import continue_warm_start
    from flows.base_model import warm_start_settings
    from flows.controls import rl_budget
    from tasks.base_model import read_exclusions

    if not PROBE_FILE.is_file():
        raise SystemExit(f"{PROBE_FILE} is missing: run `python -m benchmarks.probe make` first")
    root = PROBE_DIR / f"split-{tag}"
    base = root / "base"
    store = f"tracking.uri=sqlite:///{PROBE_DIR}/mlflow.db"
    common = [*sets, store, f"trainer.output_dir={root}", f"tracking.run_name=split-{tag}"]
    dapo = str(Path(sys.executable).parent / "dapo")
    root.mkdir(parents=True, exist_ok=True)
    log = (root / "log.txt").open("a")
    if not (base / "config.json").is_file():
        cmd = [dapo, "base-model", "--recipe", "tiny-dapo", "-o", str(base), *[a for s in common for a in ("--set", s)]]
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    train_sets = [
        *common, f"model.path={base}", f"trainer.total_steps={steps}", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false",
    ]  # fmt: skip
    cfg = load_config(recipe="tiny-dapo", overrides=train_sets)
    result: dict[str, Any] = {"tag": tag, "sets": sets, "steps": steps, "base": score(cfg, base)}
    print(json.dumps({"base": result["base"]}), flush=True)
    cmd = [dapo, "train", "--recipe", "tiny-dapo", *[a for s in train_sets for a in ("--set", s)]]
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    final = root / f"split-{tag}" / "final"
    result["dapo"] = score(cfg, final)
    run_id = _last_run_id(cfg, f"split-{tag}")
    budget, kind = rl_budget(cfg, run_id)
    result["budget"] = [budget, kind]
    ws = warm_start_settings(cfg)
    for name, clean in (("sft-control", False), ("sft-control-clean", True)):
        res = continue_warm_start(
            cfg, ws, base, cpu_budget_s=budget, exclude=read_exclusions(CURATED), output_dir=root / name,
            lr=cfg.control.clean_lr if clean else cfg.control.lr, clean=clean,
        )  # fmt: skip
        result[name] = {"steps": res.steps, "lr": res.lr, **score(cfg, root / name)}
    (PROBE_DIR / f"split-{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _last_run_id(cfg: Any, run_name: str) -> str:
    from mlflow.tracking import MlflowClient

    from dapo_core.config.schema import resolved_tracking_uri

    client = MlflowClient(tracking_uri=resolved_tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.runName = '{run_name}'", order_by=["start_time DESC"]
    )
    return runs[0].info.run_id


if __name__ == "__main__":
    from dapo_core.env import apply_quiet_env

    apply_quiet_env(Path.cwd())
    args, sets = _split_sets(sys.argv[1:])
    steps = 16
    if "--steps" in args:
        i = args.index("--steps")
        steps = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 1:
        raise SystemExit(__doc__)
    print(json.dumps(main(args[0], sets, steps), indent=1))
