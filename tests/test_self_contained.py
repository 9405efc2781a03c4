"""The repository stands on its own: no tracked file points outside it, the AIME-2024 tests say what they need,
and the fresh-clone check (scripts/fresh_clone_check.sh) parses and rejects bad arguments.

Only the CI entry point (.ci/run) may name the workbench folder beside the clone, where CI keeps its data."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest_data import AIME_DEFAULT, AIME_ENV, aime_path

ROOT = Path(__file__).resolve().parents[1]
FRESH_CLONE_CHECK = ROOT / "scripts" / "fresh_clone_check.sh"

# Pointers into the workbench: its folder beside the clone and the files it holds. The project's design notes are
# docs/design.md; a capitalised design or style note named without a folder is the workbench's.
# (the slashes are written [/] so that grepping the project for the folder name and a slash finds nothing, here too)
WORKBENCH = re.compile(r"\.\.[/]shared\b|\bshared[/](?:notes|data|bin|stack)\b|(?<![\w./-])(?:DESIGN|STYLE)\.md\b")
EXEMPT_DIRS = (".ci/",)  # the CI entry point points CI at the workbench's data


def workbench_references(path: str, lines: Iterable[str]) -> list[str]:
    """``path:line: text`` for every line that refers to the workbench."""
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, start=1) if WORKBENCH.search(line)]


def tracked_text_files(root: Path) -> list[Path]:
    """The files git tracks under ``root``, less the exempt directories and binary files."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    files = []
    for name in out.decode().split("\0"):
        path = root / name
        if not name or name.startswith(EXEMPT_DIRS) or not path.is_file():
            continue
        if b"\0" in path.read_bytes()[:8192]:  # binary (images, parquet): no text to refer with
            continue
        files.append(path)
    return files


def test_no_tracked_file_refers_to_the_workbench():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found: list[str] = []
    for path in tracked_text_files(ROOT):
        text = path.read_text(encoding="utf-8", errors="replace")
        found += workbench_references(str(path.relative_to(ROOT)), text.splitlines())
        if SHARED + "/" in text:  # the issue's own check, `grep -r` for the folder name and a slash
            found.append(f"{path.relative_to(ROOT)}: names the folder with a slash")
    assert not found, "references to the workbench outside the repository (say it here instead):\n" + "\n".join(found)


# The planted references are spelled in pieces, so that this file passes its own scan.
SHARED, DESIGN_MD, STYLE_MD = "shared", "DESIGN" + ".md", "STYLE" + ".md"


@pytest.mark.parametrize(
    "line",
    [
        f"see ../{SHARED}/{DESIGN_MD}",
        f"CI needs ../{SHARED}/data/aime-2024.parquet",
        f"# measured in {SHARED}/stack/NOTES.md",
        f"({SHARED}/notes/tiny-rl-diagnosis.md)",
        f"run {SHARED}/bin/fresh-clone-check test",
        f'metric names ({DESIGN_MD} "Metric names")',
        f"# ---- properties ({STYLE_MD}) ----",
    ],
)
def test_a_planted_reference_is_found_with_its_file_and_line(line):
    lines = ["first line", line, "last line"]
    assert workbench_references("planted.py", lines) == [f"planted.py:2: {line.strip()}"]


@pytest.mark.parametrize(
    "line",
    [
        'metric names (docs/design.md, "Metric names")',
        "the shared settings of both sides",
        "a shared-memory copy of the module",
        "data/aime-2024.parquet, the user's own copy",
        "prefect_shared.py",
        'ROOT / "docs" / "design.md"',
    ],
)
def test_the_projects_own_words_are_not_flagged(line):
    assert workbench_references("ok.py", [line]) == []


def test_the_design_notes_have_every_section_the_code_cites():
    design = (ROOT / "docs/design.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (.+)$", design, re.MULTILINE))
    cited: set[tuple[str, str]] = set()
    for path in tracked_text_files(ROOT):
        text = path.read_text(encoding="utf-8", errors="replace")
        # a citation may wrap: docs/design.md,\n"Tracking defaults"
        for section in re.findall(r'docs/design\.md,\s+(?:#\s*)?"([^"]+)"', text):
            cited.add((str(path.relative_to(ROOT)), section))
    assert cited, "no file cites a section of docs/design.md"
    missing = sorted(f"{path} cites {section!r}" for path, section in cited if section not in headings)
    assert not missing, "docs/design.md lacks cited sections:\n" + "\n".join(missing)


# ---- the AIME-2024 file: from $DAPO_AIME_PARQUET or data/aime-2024.parquet; skipped when missing, failed in CI ----


def test_aime_file_is_git_ignored_at_its_default_place():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    rel = str(AIME_DEFAULT.relative_to(ROOT))
    assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0, f"{rel} is not git-ignored"


def test_missing_aime_file_skips_with_what_to_do(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere.parquet"
    monkeypatch.setenv(AIME_ENV, str(missing))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        aime_path()
    message = str(skipped.value)
    assert str(missing) in message and AIME_ENV in message and str(AIME_DEFAULT) in message


def test_missing_aime_file_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv(AIME_ENV, str(tmp_path / "nowhere.parquet"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        aime_path()


def test_aime_file_is_read_from_the_variable(monkeypatch, tmp_path):
    present = tmp_path / "aime.parquet"
    present.write_bytes(b"not read here")
    monkeypatch.setenv(AIME_ENV, str(present))
    assert aime_path() == present


# ---- scripts/fresh_clone_check.sh: checked without cloning (a real check runs make test / make run) ----


def test_fresh_clone_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(FRESH_CLONE_CHECK)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(FRESH_CLONE_CHECK, os.X_OK), f"{FRESH_CLONE_CHECK} is not executable"


@pytest.mark.parametrize("args", [["tset"], ["test", "--kep"], ["lint"]])
def test_fresh_clone_check_rejects_a_bad_argument_with_its_usage(args, tmp_path):
    result = subprocess.run(
        ["bash", str(FRESH_CLONE_CHECK), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        timeout=30,
    )
    assert result.returncode == 2
    assert f"unknown argument '{args[-1]}'" in result.stderr
    assert "usage: scripts/fresh_clone_check.sh [--keep] [test|run ...]" in result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []  # nothing cloned, no directory made


def test_fresh_clone_check_help_names_both_targets_and_keep():
    result = subprocess.run(["bash", str(FRESH_CLONE_CHECK), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "test, run" in result.stdout and "--keep" in result.stdout
