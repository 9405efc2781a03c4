"""`dapo bench`: the benchmark suites (benchmarks/bench_*.py) one after another, then the summary and README's table.

dapo bench --list                      # every suite: what it measures, what it needs
dapo bench                             # all of them, in turn (never concurrently: they time things)
dapo bench --only rewards,update       # some of them; --skip trl,curate: all but some
dapo bench --prepare                   # first `dapo curate` + `dapo base-model` where a selected suite needs them

Run from the repository root (where benchmarks/ is): each suite runs as ``python -m benchmarks.bench_<name>`` with
this interpreter, its output streamed, and writes benchmarks/results/<name>.json and .md; then
``python -m benchmarks.summary`` rewrites benchmarks/results/summary.md, summary.json and README.md's table. Which
suite needs what is in benchmarks/suites.py. Exit status 1 when a suite or the summary failed, 2 on a usage error.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from flows.cli.common import fail


@dataclass(frozen=True)
class Outcome:
    """What happened to one suite: ``ok``, ``failed`` or ``skipped``, its wall time and why."""

    name: str
    status: str
    wall_s: float | None = None
    note: str = ""


def _repo_root() -> Path:
    root = Path.cwd()
    if not any((root / "benchmarks").glob("bench_*.py")) or not (root / "benchmarks" / "suites.py").is_file():
        fail(
            f"no benchmark suites (benchmarks/bench_*.py, benchmarks/suites.py) under {root}: run `dapo bench` "
            "from the repository root, the folder holding benchmarks/ and README.md"
        )
    return root


def _suites(root: Path) -> ModuleType:
    """``benchmarks/suites.py`` of the checkout at ``root``, loaded from its file: ``benchmarks`` is no installed
    package, and putting ``root`` on ``sys.path`` would outlive the command (stdlib only, so this is instant)."""
    path = root / "benchmarks" / "suites.py"
    spec = importlib.util.spec_from_file_location("_dapo_bench_suites", path)
    if spec is None or spec.loader is None:
        fail(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _names(value: str | None, valid: list[str], flag: str) -> list[str]:
    """The suite names of a comma-separated option (``bench_x`` / ``bench_x.py`` accepted); fail on unknown ones."""
    if not value:
        return []
    names = [v.strip().removesuffix(".py").removeprefix("bench_") for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown:
        fail(
            f"{flag}: no suite named {', '.join(unknown)}. Valid: {', '.join(valid)} "
            "(benchmarks/bench_<name>.py; `dapo bench --list` describes them)"
        )
    return names


def _stream(cmd: list[str], root: Path) -> int:
    """Run ``cmd`` in ``root`` with its output on this terminal; its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run(cmd, cwd=root).returncode


def _results_state(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (root / "benchmarks" / "results").glob("*.json")}


def _prepare(root: Path, suites: ModuleType, names: list[str]) -> str | None:
    """Run the `dapo` commands that create what ``names`` need and is missing; why they failed, or None."""
    need = [n for n in names if suites.missing_files(n, root)]
    for command, files in suites.PREPARE_COMMANDS if need else ():
        if all((root / f).is_file() for f in files):
            continue
        typer.echo(f"=== prepare: dapo {command} (for {', '.join(need)})")
        code = _stream([sys.executable, "-m", "flows.cli", command], root)
        if code != 0:
            return f"`dapo {command}` (run by --prepare) exited {code}; run it alone to see why"
    return None


def _run_suite(root: Path, suites: ModuleType, suite: Any, prepare_error: str | None) -> Outcome:
    if prepare_error and suites.missing_files(suite.name, root):
        typer.echo(f"=== {suite.name}: not run: {prepare_error}")
        return Outcome(suite.name, "failed", note=prepare_error)
    reason = suites.skip_reason(suite.name, root)
    if reason:
        typer.echo(f"=== {suite.name}: skipped: {reason}")
        return Outcome(suite.name, "skipped", note=reason)
    typer.echo(f"=== {suite.name}: python -m {suite.module}")
    before = _results_state(root)
    t0 = time.perf_counter()
    code = _stream([sys.executable, "-m", suite.module], root)
    wall = time.perf_counter() - t0
    if code != 0:
        return Outcome(suite.name, "failed", wall, f"exit code {code}")
    wrote = _results_state(root) != before
    return Outcome(suite.name, "ok", wall, "" if wrote else "wrote no results JSON (it may have skipped itself)")


def _print_table(outcomes: list[Outcome]) -> None:
    width = max(len(o.name) for o in outcomes)
    typer.echo(f"\n{'suite':<{width}}  {'status':<7}  {'wall s':>7}  note")
    for o in outcomes:
        wall = f"{o.wall_s:7.1f}" if o.wall_s is not None else f"{'-':>7}"
        typer.echo(f"{o.name:<{width}}  {o.status:<7}  {wall}  {o.note}".rstrip())


def _print_list(root: Path, suites: ModuleType) -> None:
    found = suites.discover(root)
    width = max(len(s.name) for s in found)
    for s in found:
        typer.echo(f"{s.name:<{width}}  {suites.description(s.path)}  [{suites.prerequisites(s.name)}]")


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""

    @app.command("bench")
    def bench(
        list_suites: Annotated[
            bool, typer.Option("--list", help="List the suites (name, what it measures, what it needs); run none.")
        ] = False,
        only: Annotated[
            str | None, typer.Option("--only", help="Comma-separated suites to run (default: every one).")
        ] = None,
        skip: Annotated[str | None, typer.Option("--skip", help="Comma-separated suites not to run.")] = None,
        prepare: Annotated[
            bool,
            typer.Option(
                "--prepare",
                help="Run `dapo curate` / `dapo base-model` first where a selected suite needs their outputs "
                "(otherwise such suites are skipped, saying so).",
            ),
        ] = False,
    ) -> None:
        """Run the benchmark suites in turn, then regenerate benchmarks/results/summary.md and README's table."""
        root = _repo_root()
        suites = _suites(root)
        if list_suites:
            _print_list(root, suites)
            return
        found = suites.discover(root)
        valid = [s.name for s in found]
        chosen = set(_names(only, valid, "--only") or valid) - set(_names(skip, valid, "--skip"))
        selected = [s for s in found if s.name in chosen]
        if not selected:
            fail(f"--only {only or '(all)'} --skip {skip} leaves no suite to run; the suites: {', '.join(valid)}")
        typer.echo(f"suites: {', '.join(s.name for s in selected)} (one after another)")
        prepare_error = _prepare(root, suites, [s.name for s in selected]) if prepare else None
        outcomes = [_run_suite(root, suites, s, prepare_error) for s in selected]
        typer.echo("=== summary: python -m benchmarks.summary")
        code = _stream([sys.executable, "-m", "benchmarks.summary"], root)
        outcomes.append(Outcome("summary", "ok" if code == 0 else "failed", None, "" if code == 0 else f"exit {code}"))
        _print_table(outcomes)
        failed = [o.name for o in outcomes if o.status == "failed"]
        if failed:
            typer.echo(f"failed: {', '.join(failed)}", err=True)
            raise typer.Exit(1)
