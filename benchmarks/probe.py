"""Tuning on the probe set, never on the held-out problems: how the ablation's regimes were chosen.

    python -m benchmarks.probe make                      # outputs/probe/probe.parquet: 200 problems of the warm
                                                         # start's "probe" stream, none in train or val
    python -m benchmarks.probe run dapo 3e-4 16 [SEED] [STEPS] [BASE] [--set KEY=VALUE ...]
                                                         # one ablation rung (tiny-dapo ladder) at lr 3e-4 with
                                                         # ppo_mini_batch_size 16 (STEPS: default 16; BASE: the
                                                         # base model dir, default outputs/base_model; --set: more
                                                         # recipe overrides, e.g. rollout.n=4), validated on the
                                                         # probe set

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
    from dapo_core.engines.sft_data import heldout_problems
    from flows.base_model import warm_start_settings
    from tasks.base_model import read_exclusions

    ws = warm_start_settings(load_config(recipe="tiny-dapo"))
    exclude = read_exclusions(CURATED)
    problems = heldout_problems(
        n, seed=ws.seed, exclude=exclude, min_ops=ws.min_ops, max_ops=ws.max_ops, stream="probe"
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
    if len(sys.argv) >= 2 and sys.argv[1] == "make":
        print(make())
    elif len(sys.argv) >= 5 and sys.argv[1] == "run":
        args, sets = _split_sets(sys.argv[2:])
        sys.exit(run(*args[:4], *[int(a) for a in args[4:5]], *args[5:6], extra=sets))
    else:
        raise SystemExit(__doc__)
