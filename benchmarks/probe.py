"""Tuning on the probe set, never on the held-out problems: how the ablation's regimes were chosen.

    python -m benchmarks.probe make                      # outputs/probe/probe.parquet: 200 problems of the warm
                                                         # start's "probe" stream, none in train or val
    python -m benchmarks.probe run dapo 3e-4 16 [SEED] [STEPS] [BASE] [--set KEY=VALUE ...]
                                                         # one ablation rung (tiny-dapo ladder) at lr 3e-4 with
                                                         # ppo_mini_batch_size 16 (STEPS: default 16; BASE: the
                                                         # base model dir, default outputs/base_model; --set: more
                                                         # recipe overrides, e.g. rollout.n=4), validated on the
                                                         # probe set
    python -m benchmarks.probe control 5e-4 [--clean] [--cpu-s 160] [--seed 1] [--base DIR]
                                                         # the supervised control at lr 5e-4 (--clean: on clean
                                                         # demonstrations) for 160 CPU s, scored on the probe set
                                                         # (avg@8 and the stop split) -> outputs/probe/<name>.json

Each run logs to outputs/probe/mlflow.db (run name probe-<rung>-lr<lr>-mb<mini>-s<seed>; its in-training
validation ``val/synthetic/acc/mean_at_8`` at steps 8 and 16 is the probe avg@8) and writes outputs/probe/<name>.log.
Needs `dapo curate` and `dapo base-model` first (outputs/curated/, outputs/base_model/).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PROBE_DIR = Path("outputs/probe")
PROBE_FILE = PROBE_DIR / "probe.parquet"
CURATED = ["outputs/curated/train.parquet", "outputs/curated/val.parquet"]


def make(n: int = 200) -> Path:
    """Write the probe set: ``n`` problems of the warm start's probe stream that are in neither curated split."""
    from dapo_core.config import load_config
    from dapo_core.data.schema import write_rl_parquet
    from dapo_core.data.synthetic import synthetic_records
    from dapo_core.warmstart.demos import heldout_problems
    from flows.base_model import warm_start_settings
    from tasks.base_model import read_exclusions

    ws = warm_start_settings(load_config(recipe="tiny-dapo"))
    exclude = read_exclusions(CURATED)
    problems = heldout_problems(
        n, seed=ws.seed, exclude=exclude, min_ops=ws.demos.min_ops, max_ops=ws.demos.max_ops, stream="probe"
    )
    records = synthetic_records(problems)
    PROBE_DIR.mkdir(parents=True, exist_ok=True)
    return write_rl_parquet(records, PROBE_FILE)


def run(
    rung: str,
    lr: str,
    mini: str,
    seed: str = "1",
    steps: int = 16,
    base: str = "outputs/base_model",
    extra: Sequence[str] = (),
) -> int:
    """One rung of the tiny-dapo ladder, validated on the probe set every 8 steps; returns dapo train's exit code.
    ``extra``: further ``KEY=VALUE`` recipe overrides (applied last; each named in the run name)."""
    from dapo_core.config import load_config
    from dapo_core.config.ablation import build_ladder

    if not PROBE_FILE.is_file():
        raise SystemExit(f"{PROBE_FILE} is missing: run `python -m benchmarks.probe make` first")
    ladder = {r.name: r for r in build_ladder(load_config(recipe="tiny-dapo"))}
    if rung not in ladder:
        raise SystemExit(f"unknown rung {rung!r}; valid: {', '.join(ladder)}")
    if not (Path(base) / "config.json").is_file():
        raise SystemExit(f"{base} holds no model: run `dapo base-model -o {base}` first")
    name = f"probe-{rung}-lr{lr}-mb{mini}-s{seed}" + (f"-t{steps}" if steps != 16 else "")
    if base != "outputs/base_model":
        name += f"-{Path(base).name}"
    for item in extra:
        if "=" not in item:
            raise SystemExit(f"--set {item!r} is not KEY=VALUE, e.g. --set rollout.n=4")
        name += "-" + item.replace("=", "")
    sets = [
        *ladder[rung].overrides(), f"model.path={base}", f"trainer.lr={lr}", f"trainer.seed={seed}",
        f"trainer.ppo_mini_batch_size={mini}", f"trainer.total_steps={steps}", "trainer.test_freq=8",
        "trainer.val_before_train=false", "trainer.save_freq=0", f"data.val_files=[{PROBE_FILE}]",
        f"tracking.run_name={name}", f"tracking.uri=sqlite:///{PROBE_DIR}/mlflow.db", f"trainer.output_dir={PROBE_DIR}/runs",
        *extra,
    ]  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "dapo"), "train", "--recipe", "tiny-dapo"]
    cmd += [a for s in sets for a in ("--set", s)]
    with (PROBE_DIR / f"{name}.log").open("w") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)


def control(lr: float, *, clean: bool, cpu_s: float, seed: int = 1, base: str = "outputs/base_model") -> dict:
    """The supervised control (``continue_warm_start``) at ``lr`` for ``cpu_s`` CPU seconds from ``base``, scored
    on the probe set at avg@8 (with the stop split); written to outputs/probe/<name>.json and returned."""
    import json

    from dapo_core.config import load_config
    from dapo_core.warmstart.control import continue_warm_start
    from flows.base_model import warm_start_settings
    from flows.evaluate import evaluate_flow
    from tasks.base_model import read_exclusions

    if not PROBE_FILE.is_file():
        raise SystemExit(f"{PROBE_FILE} is missing: run `python -m benchmarks.probe make` first")
    cfg = load_config(recipe="tiny-dapo")
    name = f"probe-control{'-clean' if clean else ''}-lr{lr:g}-cpu{cpu_s:g}-s{seed}"
    out_dir = PROBE_DIR / "runs" / name
    res = continue_warm_start(
        cfg, warm_start_settings(cfg), base, cpu_budget_s=cpu_s, exclude=read_exclusions(CURATED),
        output_dir=out_dir, seed=seed, lr=lr, clean=clean,
    )  # fmt: skip
    sets = [f"data.val_files=[{PROBE_FILE}]", f"tracking.uri=sqlite:///{PROBE_DIR}/mlflow.db"]
    ev = evaluate_flow(recipe="tiny-dapo", overrides=sets, model=str(out_dir), k=8, metrics_path=None, run_name=name)
    split = {k.rsplit("/", 1)[-1]: v for k, v in ev["metrics"].items() if "/stop/" in k}
    record = {
        "name": name,
        "lr": lr,
        "clean": clean,
        "cpu_s": res.cpu_s,
        "steps": res.steps,
        "probe_avg8": ev["mean_acc"],
        **split,
    }
    (PROBE_DIR / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _split_sets(argv: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments and the values of ``--set KEY=VALUE`` pairs, in order."""
    args, sets = [], []
    it = iter(argv)
    for a in it:
        if a == "--set":
            value = next(it, None)
            if value is None:
                raise SystemExit("--set needs a KEY=VALUE after it, e.g. --set rollout.n=4")
            sets.append(value)
        else:
            args.append(a)
    return args, sets


if __name__ == "__main__":
    from dapo_core.env import apply_quiet_env

    apply_quiet_env(Path.cwd())  # what the dapo CLI sets: a project-local Prefect home, quiet and offline
    if len(sys.argv) >= 2 and sys.argv[1] == "make":
        print(make())
    elif len(sys.argv) >= 5 and sys.argv[1] == "run":
        args, sets = _split_sets(sys.argv[2:])
        sys.exit(run(*args[:4], *[int(a) for a in args[4:5]], *args[5:6], extra=sets))
    elif len(sys.argv) >= 3 and sys.argv[1] == "control":
        import argparse

        ap = argparse.ArgumentParser(prog="python -m benchmarks.probe control")
        ap.add_argument("lr", type=float)
        ap.add_argument("--clean", action="store_true")
        ap.add_argument("--cpu-s", type=float, default=160.0)
        ap.add_argument("--seed", type=int, default=1)
        ap.add_argument("--base", default="outputs/base_model")
        a = ap.parse_args(sys.argv[2:])
        print(control(a.lr, clean=a.clean, cpu_s=a.cpu_s, seed=a.seed, base=a.base))
    else:
        raise SystemExit(__doc__)
