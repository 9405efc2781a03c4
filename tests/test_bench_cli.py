"""`dapo bench` (flows/cli/bench.py) and the benchmark summary (benchmarks/summary.py).

No real benchmark runs here: the commands that run suites do so in a temporary checkout whose benchmarks/ holds
the real suites.py and summary.py beside stand-in suites that only record that they ran.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.cli import bench as cli_bench

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
START = "<!-- bench:start (generated: python -m benchmarks.summary) -->"
END = "<!-- bench:end -->"
BASE_AND_DATA = ("outputs/base_model/config.json", "outputs/curated/train.parquet", "outputs/curated/val.parquet")
runner = CliRunner()

STAND_IN = '''"""Stand-in {name} suite: records that it ran and writes a result."""
import json
from pathlib import Path

Path("ran_{name}").write_text("yes")
Path("benchmarks/results/{name}.json").write_text(json.dumps({{"benchmark": "{name}", "machine": {{}}}}))
'''


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary repository root: the real suites.py, summary.py and headlines.py, stand-ins for `rewards`
    (needs nothing) and `overlap` (needs the base model and curated data, absent here), a README with the generated
    block."""
    bench = tmp_path / "benchmarks"
    (bench / "results").mkdir(parents=True)
    for name in ("__init__.py", "suites.py", "summary.py", "headlines.py"):
        shutil.copy(REPO / "benchmarks" / name, bench / name)
    for name in ("rewards", "overlap"):
        (bench / f"bench_{name}.py").write_text(STAND_IN.format(name=name))
    (tmp_path / "README.md").write_text(f"# stand-in\n\n## Benchmarks\n\n{START}\n{END}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def summary(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is no installed package
    return importlib.import_module("benchmarks.summary")


@pytest.fixture
def headlines(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.headlines")


def _summary_check(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks.summary", "--check", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_list_names_every_suite_file(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    result = runner.invoke(app, ["bench", "--list"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert set(lines) == {p.stem.removeprefix("bench_") for p in (REPO / "benchmarks").glob("bench_*.py")}
    assert "Per-item latency of the reward functions" in lines["rewards"]  # the docstring's first line
    assert "base model + curated data" in lines["trl"] and ".venv-vllm" in lines["rollout"]


def test_unknown_suite_is_refused_before_anything_runs(checkout: Path):
    result = runner.invoke(app, ["bench", "--only", "rewards,nosuch"])
    assert result.exit_code != 0
    assert "nosuch" in result.output and "Valid: overlap, rewards" in result.output
    assert not (checkout / "ran_rewards").exists()  # rewards was valid, yet nothing ran
    assert not (checkout / "benchmarks" / "results" / "summary.md").exists()


def test_suite_needing_the_base_model_is_skipped_with_the_fix(checkout: Path):
    result = runner.invoke(app, ["bench", "--only", "overlap,rewards"])
    assert result.exit_code == 0, result.output
    assert (checkout / "ran_rewards").is_file()  # suites do run in this checkout...
    assert not (checkout / "ran_overlap").exists()  # ...but not this one
    (line,) = [x for x in result.output.splitlines() if x.startswith("=== overlap")]
    assert "skipped" in line and "outputs/base_model/config.json" in line
    assert "`dapo base-model`" in line and "`make run`" in line and "--prepare" in line
    assert re.search(r"^overlap\s+skipped\s+-", result.output, re.M)
    assert re.search(r"^rewards\s+ok\s+\d", result.output, re.M)
    # then the summary ran: summary.md and the README block name the suite that wrote a result
    assert "| rewards |" in (checkout / "benchmarks" / "results" / "summary.md").read_text()
    assert "[rewards.md](benchmarks/results/rewards.md)" in (checkout / "README.md").read_text()


def test_suite_needing_the_base_model_runs_once_it_exists(checkout: Path):
    for f in BASE_AND_DATA:
        (checkout / f).parent.mkdir(parents=True, exist_ok=True)
        (checkout / f).write_text("")
    result = runner.invoke(app, ["bench", "--skip", "rewards"])
    assert result.exit_code == 0, result.output
    assert (checkout / "ran_overlap").is_file() and not (checkout / "ran_rewards").exists()


def test_prepare_runs_the_dapo_commands_first(checkout: Path, monkeypatch: pytest.MonkeyPatch):
    made = {"curate": BASE_AND_DATA[1:], "base-model": BASE_AND_DATA[:1]}
    calls: list[str] = []
    real_stream = cli_bench._stream

    def stream(cmd: list[str], root: Path) -> int:
        if cmd[1:3] == ["-m", "flows.cli"]:  # `dapo curate` / `dapo base-model`: create their outputs only
            calls.append(cmd[3])
            for f in made[cmd[3]]:
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                (root / f).write_text("")
            return 0
        return real_stream(cmd, root)

    monkeypatch.setattr(cli_bench, "_stream", stream)
    result = runner.invoke(app, ["bench", "--only", "overlap", "--prepare"])
    assert result.exit_code == 0, result.output
    assert calls == ["curate", "base-model"] and (checkout / "ran_overlap").is_file()


def test_failing_suite_fails_the_command(checkout: Path):
    (checkout / "benchmarks" / "bench_broken.py").write_text('"""Always fails."""\nraise SystemExit(3)\n')
    result = runner.invoke(app, ["bench", "--only", "broken,rewards"])
    assert result.exit_code == 1
    assert re.search(r"^broken\s+failed\s+[\d.]+\s+exit code 3", result.output, re.M)
    assert (checkout / "ran_rewards").is_file()  # the others still run


def test_outside_the_repository_root_says_where_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", "--list"])
    assert result.exit_code == 2 and "from the repository root" in result.output


def test_committed_summary_and_readme_table_are_current():
    result = _summary_check()
    assert result.returncode == 0, result.stderr


def test_check_fails_when_a_headline_value_changes(tmp_path: Path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for path in results.iterdir():  # every row's date differs from the committed one, as in a fresh clone
        os.utime(path, (978307200, 978307200))  # 2001-01-01
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    args = ("--results", str(results), "--readme", str(tmp_path / "README.md"))
    assert _summary_check(*args).returncode == 0  # the copy is faithful (dates differ there and are ignored)
    update = json.loads((results / "update.json").read_text())
    update["ratio"] = 0.123
    (results / "update.json").write_text(json.dumps(update))
    result = _summary_check(*args)
    assert result.returncode == 1
    assert "summary.md is stale" in result.stderr and "benchmark table is stale" in result.stderr
    assert "0.12x bare" in result.stderr and "python -m benchmarks.summary" in result.stderr


def test_extractor_headlines(headlines: ModuleType):
    trl = json.loads((RESULTS / "trl.json").read_text())
    compares, fig = headlines.figures("trl", trl)
    assert f"{trl['ratio_generate_to_trl']:.2f}x TRL's time per step with the same decode path" in fig.headline
    assert f"{trl['ratio_ours_to_trl']:.2f}x as shipped" in fig.headline and "TRL" in compares
    assert fig.met is (trl["ratio_generate_to_trl"] <= 0.7)  # judged on the same decode path, not the faster one
    _, fig = headlines.figures("trl", {**trl, "ratio_generate_to_trl": 0.75, "ratio_ours_to_trl": 0.5})
    assert fig.met is False
    # fixed payloads in the schemas of the overhead and scaling suites
    overhead = {"summary": {"core_step_s": 4.2, "prefect_frac": 0.021, "mlflow_frac": 0.012, "ray_1x1_frac": 0.062,
                            "prefect_mlflow_frac": 0.031, "prefect_mlflow_cpu_frac": 0.04, "ray_1x1_cpu_frac": 0.05,
                            "ray_2x2_vs_local_frac": -0.25}}  # fmt: skip
    _, fig = headlines.figures("overhead", overhead)
    assert fig.headline == (
        "core step 4.20 s; Prefect + MLflow +3.1% (CPU +4.0%; Prefect alone +2.1%), Ray 1x1 +6.2% (CPU +5.0%), "
        "Ray 2x2 vs local at 2 threads -25.0%"
    )
    assert fig.met is False  # Ray 1x1 is over 5%
    overhead["summary"]["ray_1x1_frac"] = 0.04
    assert headlines.figures("overhead", overhead)[1].met is True
    scaling = {"fit": {"s_per_1k_tokens": 0.125, "intercept_s": 0.5, "r2": 0.998, "mb_per_1k_tokens": 3.5,
                       "mb_r2": 0.99}, "projection": {"label": "32B", "hours_per_step": 1.25}}  # fmt: skip
    _, fig = headlines.figures("scaling", scaling)
    assert "step s = 0.5 + 0.125 per 1k generated tokens (R² 0.998)" in fig.headline
    assert "3.5 MB per 1k token positions" in fig.headline and "a projection: 1.2 h per rollout step" in fig.headline


def test_rollout_headline_is_the_default_settings_figure_and_procs_only_an_option(headlines: ModuleType):
    setting = {"recipe": "tiny-dapo", "hf_decode": "static", "hf_procs": 1}
    case = {"ratio": 1.02, "static_of_bound": 0.28, "default_vs_generate": 2.3, "default_best_vs_best": 2.5}
    _, fig = headlines.figures("rollout", {"default_setting": setting, "results": [dict(case)]})
    assert fig.met is False and "(`hf_decode: static`, `hf_procs: 1`) 2.30x `generate`" in fig.headline
    assert "best-vs-best 2.50x" in fig.headline and "hf_procs: 2" not in fig.headline
    # a faster non-default setting is reported as an option and cannot meet the goal for the default
    multi = {**case, "procs": 2, "procs_vs_generate": 3.6}
    _, fig = headlines.figures("rollout", {"default_setting": setting, "results": [multi]})
    assert fig.met is False and "option `rollout.hf_procs: 2` 3.60x `generate`" in fig.headline
    _, fig = headlines.figures(
        "rollout", {"default_setting": setting, "results": [{**multi, "default_vs_generate": 3.1}]}
    )
    assert fig.met is True


def test_every_default_batch_row_of_the_committed_rollout_results_names_the_defaults_ratio():
    import importlib

    bench = importlib.import_module("benchmarks.rollout_default")
    report = json.loads((RESULTS / "rollout.json").read_text())
    assert report["default_setting"] == bench.default_setting()  # the recipe's default, not a chosen setting
    rows = [r for r in report["results"] if bench.is_default_batch(r)]
    assert rows and all("default_vs_generate" in r for r in rows)
    key = "static" if report["default_setting"]["hf_procs"] == 1 else "procs"
    assert all(r["default_vs_generate"] == r[f"{key}_vs_generate"] for r in rows)


def test_unknown_suite_or_missing_key_points_to_its_table(headlines: ModuleType):
    assert headlines.figures("scaling", {"fit": {}})[1].headline == "see scaling.md"
    assert headlines.figures("no_such_suite", {"benchmark": "x"}) == ("—", headlines.Figures("see no_such_suite.md"))
