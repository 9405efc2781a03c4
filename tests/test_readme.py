"""README.md and the documentation site (docs/, mkdocs.yml) stay true: the commands they show exist, their links
resolve, every page is in the site's navigation, and the README stays a short entry point.

Run for real (seconds each): ``dapo --help``, every ``dapo config ...`` line, ``dapo bench --list``, ``dapo ui
status``, ``dapo plan --recipe dapo-qwen2.5-32b`` (when the CLI has ``plan``) and, marked slow (a Prefect flow run),
``dapo data generate`` into a temporary folder, checked against ``data.dvc``'s hash. Left out (minutes to hours, or
they start servers): train, pipeline, ablation, curate, base-model, evaluate, compare (needs finished runs), bench
(the suites), serve, ui start/stop: for those, every command line the README or a docs page shows (in a code block
or as inline code) is checked to name a real subcommand and only options it has. The knob reference is
docs/recipe-knobs.md, kept current by tests/test_config.py; `make test` also builds the site with
``mkdocs build --strict`` (broken links, anchors and includes fail there too)."""

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

from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MKDOCS = (ROOT / "mkdocs.yml").read_text()
README_MAX_LINES = 250

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# [text](target) and ![alt](target); reference-style links ([text][id]: mkdocstrings cross-references) are not paths
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SNIPPET = re.compile(r'^--8<-- "([^"]+?)(?::[-0-9:,]*)?"\s*$', re.M)


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks and inline code removed (a path in code is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _commands_in(text: str) -> list[str]:
    """Every ``dapo ...`` command in ``text``: lines of code blocks and inline code (wrapped lines joined)."""
    lines = [m.strip() for block in FENCE.findall(text) for m in re.findall(r"^\s*(dapo [^#\n]*)", block, re.M)]
    inline = [" ".join(m.split()) for m in re.findall(r"`(dapo [^`]+)`", text)]
    return sorted({re.sub(r"\s+", " ", c).strip() for c in [*lines, *inline]} - {"dapo"})


def _documented_commands() -> list[str]:
    """The commands README.md and every docs page show."""
    return sorted({c for text in [README, *(p.read_text() for p in DOCS)] for c in _commands_in(text)})


def _resolve(line: str) -> tuple[Any, list[str], list[str]]:
    """The (typer/click) command a documented line names, the subcommand path and the line's ``--options``."""
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


def _subcommand_paths() -> list[str]:
    """``config show``, ``train``, ...: every runnable subcommand of ``dapo`` (groups' leaves, not the groups)."""
    paths = []
    for name, cmd in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        subs = getattr(cmd, "commands", None)
        paths += [f"{name} {sub}" for sub in subs] if subs else [name]
    return paths


def test_readme_is_short():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a docs/ page and link it"
    )


def test_readme_two_commands_exist_in_makefile():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test", "ui", "docs"):
        assert f"make {target}" in README, f"README.md does not show `make {target}`"
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _recipe(target: str) -> list[str]:
    recipe = re.search(rf"^{target}:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, f"the Makefile has no {target} target"
    return recipe.group(1).splitlines()


def test_make_test_builds_the_docs_strictly_before_pytest():
    steps = _recipe("test")
    docs = [i for i, s in enumerate(steps) if "mkdocs build" in s]
    tests = [i for i, s in enumerate(steps) if "pytest" in s or "scripts/test_tiers.sh" in s]
    assert docs and tests and docs[0] < tests[0], steps
    assert "--strict" in steps[docs[0]] and "--quiet" not in steps[docs[0]], steps[docs[0]]  # -q hides the warnings
    # the script runs both tiers: the .venv tests, then the vllm-marked ones through `make test-vllm`
    script = [
        line for line in (ROOT / "scripts" / "test_tiers.sh").read_text().splitlines() if not line.startswith("#")
    ]
    main = [i for i, line in enumerate(script) if "-m pytest" in line and '-m "not vllm"' in line]
    vllm = [i for i, line in enumerate(script) if "make" in line and "test-vllm" in line]
    assert main and vllm, script
    # the vllm tier runs after the .venv tests, in the foreground: beside them, Ray missed its start deadline in CI
    assert vllm[0] > main[0] and not script[vllm[0]].rstrip().endswith("&"), script[vllm[0]]
    assert any("pytest -m vllm" in step for step in _recipe("test-vllm"))


def test_documented_dapo_commands_run():
    runner = CliRunner()
    lines = sorted({c for c in _documented_commands() if c.startswith("dapo config ")})
    assert lines, "no `dapo config ...` line found in README.md or docs/"
    for line in lines:
        result = runner.invoke(app, line.split()[1:])
        assert result.exit_code == 0, (line, result.output)


def test_every_documented_command_names_a_subcommand_and_options_it_has():
    commands = _documented_commands()
    assert len(_commands_in(README)) >= 15, _commands_in(README)  # the scan finds the README's commands
    assert len(commands) >= 40, commands  # ... and the docs pages' (not an empty pass)
    for line in commands:
        cmd, path, options = _resolve(line)
        assert path, f"{line!r}: no such dapo subcommand"
        have = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [o for o in options if o not in have]
        assert not unknown, f"{line!r}: dapo {' '.join(path)} has no option {unknown}"


def test_the_readme_command_table_names_every_subcommand():
    shown = {" ".join(_resolve(c)[1]) for c in _commands_in(README)}
    missing = [p for p in _subcommand_paths() if p not in shown]
    assert not missing, f"README.md's command table lacks: {', '.join('dapo ' + m for m in missing)}"


def test_every_relative_link_points_at_a_file_that_exists():
    broken = []
    for path in [ROOT / "README.md", *DOCS]:
        text = path.read_text()
        targets = LINK.findall(_without_code(text))
        assert path != ROOT / "README.md" or len(targets) >= 10, targets  # the scan sees the README's links
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s):, mailto: ... and anchors within the page
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
        for include in SNIPPET.findall(text):  # pymdownx.snippets includes, relative to the repository root
            if not (ROOT / include).is_file():
                broken.append(f"{path.relative_to(ROOT)}: --8<-- {include}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_site_navigation():
    nav = MKDOCS.split("\nnav:", 1)[1] if "\nnav:" in MKDOCS else ""
    listed = set(re.findall(r"^\s*-\s+(?:[^\n]*?:\s+)?([\w./-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in DOCS}
    assert not pages - listed, f"docs pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert not listed - pages, f"mkdocs.yml's nav names pages that do not exist: {sorted(listed - pages)}"
    for page in ("design.md", "gpu.md", "plan.md", "recipe-knobs.md"):
        assert page in listed, page


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
    """docs/pipeline.md: "dapo data generate  # on a fresh clone: re-creates data/ bit-identically": in an empty
    folder with params.yaml, the written data/ hashes to the directory md5 data.dvc records."""
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
