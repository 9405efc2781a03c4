"""README.md stays true: the knob table matches the schema and recipes; the documented commands exist."""

from __future__ import annotations

import re
from pathlib import Path

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
