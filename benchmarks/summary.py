"""One headline per benchmark suite, from ``benchmarks/results/*.json``: summary.md/.json and the README's table.

    python -m benchmarks.summary            # rewrite benchmarks/results/summary.{md,json} and README.md's block
    python -m benchmarks.summary --check    # exit 1 when either is stale (what the committed JSONs generate)

``dapo bench`` runs this after the suites. A suite's JSON (written by ``benchmarks/common.py:write_results``, or any
JSON with a ``"benchmark"`` key) gets one row: what it compares, its headline figures, its goal where it states one,
when it was written and its markdown table. The figures come from one extractor per suite
(``benchmarks.headlines``); an unknown suite, or a JSON missing a key its extractor reads, says "see <name>.md"
instead. Dates are the JSON's ``written`` field, else its last commit's date (its mtime while uncommitted):
``--check`` ignores them, so it is deterministic on a fresh clone. Machine facts come from the JSONs, never from the machine running this.
Stdlib only (no torch): it runs in a second.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.headlines import figures, goal_cell

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
START = "<!-- bench:start (generated: python -m benchmarks.summary) -->"
END = "<!-- bench:end -->"
NOT_SUITES = frozenset({"summary", "ablation", "successors"})  # results/*.json that are no speed benchmark
DATE_RE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
FIX = "run `python -m benchmarks.summary` (or `dapo bench`) and commit the result"


@dataclass(frozen=True)
class Row:
    """One suite's line of the summary."""

    name: str
    compares: str
    headline: str
    goal: str
    date: str
    link: str


def _git(path: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", *args, "--", path.name], cwd=path.parent, capture_output=True, text=True)
    except OSError:  # no git
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def written_date(path: Path, payload: dict[str, Any]) -> str:
    """YYYY-MM-DD the JSON was written: its ``written`` field, else its last commit (mtime while uncommitted)."""
    written = payload.get("written")
    if isinstance(written, str) and DATE_RE.match(written):
        return written[:10]
    committed = _git(path, "log", "-1", "--format=%cs")
    if committed and not _git(path, "status", "--porcelain"):  # committed and unchanged since
        return committed
    return dt.date.fromtimestamp(path.stat().st_mtime).isoformat()


def load_suites(results: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """(name, path, payload) of each suite JSON in ``results``, by name; others (ablation, journals) are skipped."""
    out = []
    for path in sorted(results.glob("*.json")):
        if path.stem in NOT_SUITES:
            continue
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            payload = {"benchmark": path.stem}  # unreadable: a "see <name>.md" row, not a crash
        if isinstance(payload, dict) and "benchmark" in payload:
            out.append((path.stem, path, payload))
    return out


def build_rows(results: Path) -> tuple[list[Row], dict[str, dict[str, Any]]]:
    """The summary rows and each suite's recorded machine facts."""
    rows, machines = [], {}
    for name, path, payload in load_suites(results):
        compares, fig = figures(name, payload)
        date, link = written_date(path, payload), f"benchmarks/results/{name}.md"
        rows.append(Row(name, compares, fig.headline, goal_cell(payload, fig), date, link))
        machines[name] = machine_facts(payload)
    return rows, machines


# (key in the JSON's "machine", label); torch_threads is a per-suite setting, not a machine fact
MACHINE_FIELDS = (
    ("cpu_model", "CPU model"), ("cpu", "architecture"), ("cores", "logical cores"), ("memory_gib", "memory GiB"),
    ("python", "Python"), ("torch", "torch"), ("cuda", "GPU"),
)  # fmt: skip


def machine_facts(payload: dict[str, Any]) -> dict[str, Any]:
    """The JSON's machine block as a dict (older rollout.json wrote the architecture string and torch at the top)."""
    m = payload.get("machine")
    facts = dict(m) if isinstance(m, dict) else ({"cpu": m} if isinstance(m, str) else {})
    for key in ("python", "torch"):
        if facts.get(key) is None and isinstance(payload.get(key), str):
            facts[key] = payload[key]
    if "cuda" in facts and facts["cuda"] is None:  # recorded: no GPU
        facts["cuda"] = "none"
    return facts


def machine_lines(machines: dict[str, dict[str, Any]]) -> tuple[list[str], bool]:
    """One markdown bullet per machine fact (its value, or each value with its suites where they differ)."""
    lines, differ = [], False
    for key, label in MACHINE_FIELDS:
        by_value: dict[str, list[str]] = {}
        for name, facts in machines.items():
            if facts.get(key) not in (None, ""):
                by_value.setdefault(str(facts[key]), []).append(name)
        if not by_value:
            continue
        if len(by_value) == 1:
            line = f"- {label}: {next(iter(by_value))}"
        else:
            differ = True
            line = f"- {label}: " + "; ".join(f"{v} ({', '.join(n)})" for v, n in by_value.items()) + " — **differs**"
        unrecorded = [n for n in machines if all(n not in names for names in by_value.values())]
        lines.append(line + (f" (not recorded by {', '.join(unrecorded)})" if unrecorded else ""))
    return lines, differ


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], link_prefix: str) -> str:
    lines = ["| suite | compares | headline | goal | measured | details |", "|---|---|---|---|---|---|"]
    for r in rows:
        link = f"[{r.name}.md]({link_prefix}{r.name}.md)"
        lines.append(f"| {r.name} | {_cell(r.compares)} | {_cell(r.headline)} | {_cell(r.goal)} | {r.date} | {link} |")
    return "\n".join(lines)


def render(results: Path) -> tuple[str, str, str]:
    """(summary.md, summary.json, README block) as the JSONs in ``results`` make them."""
    rows, machines = build_rows(results)
    facts, differ = machine_lines(machines)
    same = "Every suite that records a fact reports the same value."
    if differ:
        same = "The suites were **not all measured on the same machine and software** (marked below): compare "
        same += "figures within a row, not across rows."
    intro = (
        "Generated by `python -m benchmarks.summary` (which `dapo bench` runs after the suites) from "
        "`benchmarks/results/*.json`: one headline per suite; each suite's full table is in its .md. `measured`: "
        "the JSON's `written` date, else its last commit (`--check` ignores dates)."
    )
    md = f"# Benchmark summary\n\n{intro}\n\n{table(rows, '')}\n\n## Machine and software, as each suite recorded them"
    md += f"\n\n{same}\n\n" + "\n".join(facts) + "\n"
    doc: dict[str, Any] = {"generated_by": "python -m benchmarks.summary", "suites": [asdict(r) for r in rows]}
    doc.update(machines=machines, machines_differ=differ)
    link = "[benchmarks/results/summary.md](benchmarks/results/summary.md)"
    note = " (they differ between suites)" if differ else ""
    block = f"{table(rows, 'benchmarks/results/')}\n\nMachine and software of each suite{note}: {link}."
    return md, json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n", block


def _block_re() -> re.Pattern[str]:
    return re.compile(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), re.S)


def _no_markers(readme: Path) -> str:
    return (
        f"{readme} has no generated benchmark block: put the lines `{START}` and `{END}` in its "
        "'## Benchmarks' section, then run `python -m benchmarks.summary`"
    )


def _mask(text: str) -> str:
    return DATE_RE.sub("<date>", text)


def _stale(what: str, have: str, want: str) -> str:
    # diff with dates masked, so lines that differ only by a date (a fresh clone's file times) do not crowd out the
    # lines that matter
    have, want = _mask(have), _mask(want)
    diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), "current", "generated", lineterm="", n=0))
    shown = "\n".join(diff[:20]) + ("\n..." if len(diff) > 20 else "")
    return f"{what} is stale: it differs from what the results JSONs generate (dates ignored); {FIX}\n{shown}"


def check(results: Path, readme: Path) -> list[str]:
    """Problems found (empty: summary.md, summary.json and README's block are current)."""
    md, doc, block = render(results)
    problems = []
    for path, want in ((results / "summary.md", md), (results / "summary.json", doc)):
        have = path.read_text() if path.is_file() else ""
        if _mask(have) != _mask(want):
            problems.append(_stale(str(path), have, want) if have else f"{path} is missing: {FIX}")
    found = _block_re().search(readme.read_text()) if readme.is_file() else None
    if found is None:
        problems.append(_no_markers(readme))
    elif _mask(found.group(1)) != _mask(block):
        problems.append(_stale(f"{readme}'s benchmark table", found.group(1), block))
    return problems


def write(results: Path, readme: Path) -> None:
    """Rewrite summary.md, summary.json and README's block; SystemExit when README lacks the markers."""
    md, doc, block = render(results)
    text = readme.read_text()
    if not _block_re().search(text):
        raise SystemExit(f"error: {_no_markers(readme)}")
    (results / "summary.md").write_text(md)
    (results / "summary.json").write_text(doc)
    readme.write_text(_block_re().sub(lambda _: f"{START}\n{block}\n{END}", text, count=1))
    print(f"wrote {results / 'summary.md'}, {results / 'summary.json'} and the table in {readme}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if summary.md/.json or README's table is stale")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the suites' JSONs (and summary)")
    parser.add_argument("--readme", type=Path, default=README, help="the README holding the generated block")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: {args.results}: no such folder (the suites write their JSONs there)", file=sys.stderr)
        return 2
    if not args.check:
        write(args.results, args.readme)
        return 0
    problems = check(args.results, args.readme)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"benchmark summary current: {args.results / 'summary.md'}, {args.readme}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
