"""``python -m benchmarks.probe run``: the tuning runs on the probe set, as ``dapo train`` command lines.

No training here: ``subprocess.call`` is replaced by a recorder, so what is checked is the command a probe run
launches (the rung's overrides, the probe set as validation, ``--set`` overrides last) and its run name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import probe
from dapo_core.config import load_config
from dapo_core.config.ablation import build_ladder


@pytest.fixture
def launched(tmp_path, monkeypatch) -> list[list[str]]:
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "probe.parquet").write_bytes(b"")
    monkeypatch.setattr(probe, "PROBE_DIR", probe_dir)
    monkeypatch.setattr(probe, "PROBE_FILE", probe_dir / "probe.parquet")
    calls: list[list[str]] = []

    def call(cmd, **_):
        calls.append(list(cmd))
        return 0

    monkeypatch.setattr(probe.subprocess, "call", call)
    return calls


@pytest.fixture
def base(tmp_path) -> str:
    model = tmp_path / "base_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return str(model)


def overrides(cmd: list[str]) -> list[str]:
    assert cmd[1:4] == ["train", "--recipe", "tiny-dapo"]
    flags, values = cmd[4::2], cmd[5::2]
    assert set(flags) == {"--set"}
    return values


def test_extra_overrides_come_last_and_name_the_run(launched, base) -> None:
    args, sets = probe._split_sets(["grpo", "1e-4", "16", "2", "--set", "rollout.n=4", "24", base])
    assert (args, sets) == (["grpo", "1e-4", "16", "2", "24", base], ["rollout.n=4"])
    assert probe.run(*args[:4], int(args[4]), args[5], extra=sets) == 0
    values = overrides(launched[0])
    assert values[-1] == "rollout.n=4"  # after the ladder's and the probe's own: it wins
    rung = {r.name: r for r in build_ladder(load_config(recipe="tiny-dapo"))}["grpo"]
    assert values[: len(rung.overrides())] == rung.overrides()  # the rung's settings first
    name = "probe-grpo-lr1e-4-mb16-s2-t24-base_model-rollout.n4"
    assert f"tracking.run_name={name}" in values
    assert f"model.path={base}" in values and "trainer.total_steps=24" in values and "trainer.seed=2" in values
    assert f"data.val_files=[{probe.PROBE_FILE}]" in values
    assert (probe.PROBE_DIR / f"{name}.log").is_file()


def test_without_extras_the_run_name_is_unchanged(launched, base) -> None:
    probe.run("dapo", "3e-4", "16", "1", 16, base)
    values = overrides(launched[0])
    assert "tracking.run_name=probe-dapo-lr3e-4-mb16-s1-base_model" in values
    assert not any(v.startswith("rollout.n=") for v in values)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["dapo", "1e-4", "16", "--set"], "needs a KEY=VALUE"), (["dapo", "1e-4", "16", "--set", "rollout.n"], None)],
)
def test_bad_set_arguments_fail_before_anything_runs(launched, base, argv, message) -> None:
    if message:
        with pytest.raises(SystemExit, match=message):
            probe._split_sets(argv)
        return
    args, sets = probe._split_sets(argv)
    with pytest.raises(SystemExit, match=r"'rollout.n' is not KEY=VALUE"):
        probe.run(*args, "1", 16, base, extra=sets)
    assert launched == [] and not list(Path(probe.PROBE_DIR).glob("*.log"))
