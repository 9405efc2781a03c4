"""README.md stays true: the knob table matches the schema and recipes; the documented commands exist.

Run for real (seconds each): ``dapo --help``, every ``dapo config ...`` line, ``dapo bench --list``, ``dapo ui
status``, ``dapo plan --recipe dapo-qwen2.5-32b`` (when the CLI has ``plan``) and, marked slow (a Prefect flow run),
``dapo data generate`` into a temporary folder, checked against ``data.dvc``'s hash. Left out (minutes to hours, or
they start servers): train, pipeline, ablation, curate, base-model, evaluate, compare (needs finished runs), bench
(the suites), serve, ui start/stop: for those, every documented command line is checked to name a real subcommand
and only options it has."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from dapo_core.config.docs import render_knob_table
from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_knob_table_is_current():
    block = re.search(r"<!-- knobs:start.*?-->\n(.*?)<!-- knobs:end -->", README, re.S)
    assert block, "README.md lost its knobs:start/knobs:end markers"
    want = [line for line in render_knob_table().splitlines() if line.startswith("|")]
    got = [line for line in block.group(1).splitlines() if line.startswith("|")]
    assert got == want, "README knob table is stale: paste the table lines of `python -m dapo_core.config.docs`"


def test_readme_two_commands_exist_in_makefile():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        assert f"make {target}" in README
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_documented_dapo_commands_run():
    runner = CliRunner()
    for line in re.findall(r"^dapo (config .*?)(?:\s+#.*)?$", README, re.M):
        result = runner.invoke(app, line.split())
        assert result.exit_code == 0, (line, result.output)


def _documented_commands() -> list[str]:
    """Every ``dapo ...`` command the README shows: lines of code blocks and inline code (wrapped lines joined)."""
    lines = [m.strip() for m in re.findall(r"^\s*(dapo [^#\n]*)", README, re.M)]
    inline = [" ".join(m.split()) for m in re.findall(r"`(dapo [^`]+)`", README)]
    return sorted({re.sub(r"\s+", " ", c).strip() for c in [*lines, *inline]} - {"dapo"})


def _resolve(line: str) -> tuple[Any, list[str], list[str]]:
    """The (typer/click) command a README line names, the subcommand path and the line's ``--options``."""
    cmd: Any = typer.main.get_command(app)
    path: list[str] = []
    for token in line.split()[1:]:
        if token in getattr(cmd, "commands", {}):
            cmd = cmd.commands[token]
            path.append(token)
        else:
            break
    options = [re.sub(r"[=\]].*$", "", t.lstrip("[")) for t in line.split() if t.lstrip("[").startswith("--")]
    return cmd, path, options


def test_every_documented_command_names_a_subcommand_and_options_it_has():
    commands = _documented_commands()
    assert len(commands) >= 25, commands  # the scan finds the README's commands (not an empty pass)
    for line in commands:
        cmd, path, options = _resolve(line)
        assert path, f"{line!r}: no such dapo subcommand"
        have = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [o for o in options if o not in have]
        assert not unknown, f"{line!r}: dapo {' '.join(path)} has no option {unknown}"


def test_documented_quick_commands_run():
    """The README commands that finish in seconds, run from the repository root, with what each must print."""
    runner = CliRunner()
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0 and all(name in top.output for name in ("train", "ablation", "config")), top.output
    listed = runner.invoke(app, ["config", "recipes"])
    assert listed.exit_code == 0 and all(r in listed.output for r in recipes), listed.output
    flat = runner.invoke(
        app, ["config", "show", "--recipe", "tiny-grpo", "--set", "trainer.lr=3e-4", "--set", "rollout.n=16", "--flat"]
    )
    assert flat.exit_code == 0 and re.search(r"trainer\.lr\W+0\.0003\b", flat.output), flat.output
    assert re.search(r"rollout\.n\W+16\b", flat.output), flat.output
    ui = runner.invoke(app, ["ui", "status"])  # exit 1 while a server is not running
    assert ui.exit_code in (0, 1) and all(s in ui.output for s in ("Prefect server", "MLflow server")), ui.output
    import os

    here = os.getcwd()
    try:
        os.chdir(ROOT)  # dapo bench finds its suites under the repository root
        bench = runner.invoke(app, ["bench", "--list"])
    finally:
        os.chdir(here)
    assert bench.exit_code == 0 and "trl" in bench.output, bench.output
    if "plan" in typer.main.get_command(app).commands:  # `dapo plan` (docs/plan.md), once the CLI has it
        plan = runner.invoke(app, ["plan", "--recipe", "dapo-qwen2.5-32b"])
        assert plan.exit_code in (0, 1) and "GiB" in plan.output, plan.output  # exit 1: it cannot fit (a verdict)


@pytest.mark.slow
def test_dapo_data_generate_recreates_the_dvc_tracked_data(tmp_path, monkeypatch, prefect_api):
    """README: "dapo data generate  # on a fresh clone: re-creates data/ bit-identically": in an empty folder with
    params.yaml, the written data/ hashes to the directory md5 data.dvc records."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["data", "generate"])
    assert result.exit_code == 0, result.output
    data = tmp_path / "data"
    entries = [
        {"md5": hashlib.md5(f.read_bytes()).hexdigest(), "relpath": f.relative_to(data).as_posix()}
        for f in sorted(p for p in data.rglob("*") if p.is_file())
    ]
    dir_md5 = hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"  # DVC's .dir hash
    want = re.search(r"md5: (\S+)", (ROOT / "data.dvc").read_text()).group(1)
    assert dir_md5 == want
