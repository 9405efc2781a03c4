"""One headline per benchmark suite, from ``benchmarks/results/*.json``: summary.md/.json and the README's table.

    python -m benchmarks.summary            # rewrite benchmarks/results/summary.{md,json} and README.md's block
    python -m benchmarks.summary --check    # exit 1 when either is stale (what the committed JSONs generate)

``dapo bench`` runs this after the suites. A suite's JSON (written by ``benchmarks/common.py:write_results``, or any
JSON with a ``"benchmark"`` key) gets one row: what it compares, its headline figures, its goal where it states one,
when it was written and its markdown table. The figures come from one extractor per suite (``EXTRACTORS``); an
unknown suite, or a JSON missing a key its extractor reads, says "see <name>.md" instead. Dates are the JSON's
``written`` field, else its last commit's date (its mtime while uncommitted): ``--check`` ignores them, so it is
deterministic on a fresh clone. Machine facts come from the JSONs, never from the machine running this.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.suites import description

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
START = "<!-- bench:start (generated: python -m benchmarks.summary) -->"
END = "<!-- bench:end -->"
NOT_SUITES = frozenset({"summary", "ablation", "successors"})  # results/*.json that are no speed benchmark
DATE_RE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
FIX = "run `python -m benchmarks.summary` (or `dapo bench`) and commit the result"


@dataclass(frozen=True)
class Figures:
    """What an extractor reads from a suite's JSON: the headline, the goal (when the suite states one) and
    whether the figures meet it (None: not judged)."""

    headline: str
    goal: str | None = None
    met: bool | None = None


@dataclass(frozen=True)
class Row:
    """One suite's line of the summary."""

    name: str
    compares: str
    headline: str
    goal: str
    date: str
    link: str


Extractor = Callable[[dict[str, Any]], Figures]
EXTRACTORS: dict[str, tuple[str, Extractor]] = {}


def extractor(*names: str, compares: str) -> Callable[[Extractor], Extractor]:
    """Register ``fn`` as the headline of the result files ``names`` (``<name>.json``); ``compares`` in words."""

    def register(fn: Extractor) -> Extractor:
        for name in names:
            EXTRACTORS[name] = (compares, fn)
        return fn

    return register


@extractor("rollout", compares="hf rollout backend vs bare `generate`; static decode loop vs `generate`")
def _rollout(d: dict[str, Any]) -> Figures:
    cases = d["results"]
    worst = min(c["ratio"] for c in cases)
    default = [c for c in cases if c["max_new_tokens"] == 80 and c["rows_per_call"] == 384]  # the default batch
    static = ", ".join(f"{c['static_vs_generate']:.2f}x" for c in default)
    text = (
        f"static loop {static} `generate` on the default rollout batch (random init, warm-started base model; "
        f"{d['results'][-1]['static_of_bound']:.0%} of the arithmetic bound); hf backend {worst:.2f}x bare "
        "`generate` at worst"
    )
    if d.get("vllm_cpu"):  # only from .venv-vllm
        bare = {c["case"]: c["bare_tokens_per_s"] for c in cases}
        ratios = [r["vllm_tokens_per_s"] / bare[r["case"]] for r in d["vllm_cpu"]["results"]]
        text += f"; vLLM {d['vllm_cpu']['vllm']} CPU {min(ratios):.2f}-{max(ratios):.2f}x bare `generate`"
    met = worst >= 0.9 and bool(default) and all(c["static_vs_generate"] >= 3.0 for c in default)
    return Figures(text, "hf backend >= 0.9x bare `generate`; static loop >= 3x `generate` (default batch)", met)


@extractor("update", compares="`PolicyTrainer.update` vs a bare forward+backward loop")
def _update(d: dict[str, Any]) -> Figures:
    goal = d.get("goal_ratio")
    text = (
        f"{d['ratio']:.2f}x bare ({d['ours_tokens_per_s']:,.0f} vs {d['bare_tokens_per_s']:,.0f} tokens/s), "
        f"MFU {d['mfu']:.1%}"
    )
    return Figures(text, f">= {goal}x bare" if goal else None, d["ratio"] >= goal if goal else None)


@extractor("rewards", compares="reward scorers per item, typical and hostile inputs")
def _rewards(d: dict[str, Any]) -> Figures:
    parts = []
    for fn, classes in d["rewards"].items():
        worst_class, worst = max(((c, s["max_us"]) for c, s in classes.items()), key=lambda t: t[1])
        parts.append(
            f"{fn} typical {classes['typical']['median_us']:.1f} µs (median), worst {worst / 1000:.0f} ms "
            f"({worst_class})"
        )
    return Figures("; ".join(parts))


@extractor("curate", compares="curation of ~1.8M rows: time and peak memory")
def _curate(d: dict[str, Any]) -> Figures:
    runs = d["results"]
    text = "; ".join(
        f"{name} {s['rows_in'] / 1e6:.2f}M rows {s['total_s']:.1f} s, peak RSS {s['peak_rss_mb']:,.0f} MB"
        for name, s in runs.items()
    )
    if d.get("quick"):
        return Figures(f"(--quick) {text}", "< 60 s on 2 cores")
    return Figures(text, "< 60 s on 2 cores", max(s["total_s"] for s in runs.values()) < 60)


@extractor("fsdp", "fsdp_cuda", compares="FSDP2 vs DDP vs one process: update tokens/s, memory per rank")
def _fsdp(d: dict[str, Any]) -> Figures:
    lay = d["layouts"]
    speed = ", ".join(f"{k} {lay[k]['tokens_per_s']:,.0f}" for k in ("fsdp2", "ddp", "single"))
    return Figures(
        f"{d.get('device', 'cpu')}, tokens/s: {speed}; state/rank {lay['fsdp2']['state_mb_per_rank']:.0f} MB "
        f"(fsdp2) vs {lay['ddp']['state_mb_per_rank']:.0f} MB (ddp)"
    )


@extractor("vllm", compares="vLLM generation and weight sync through `VllmRollout` (GPU)")
def _vllm(d: dict[str, Any]) -> Figures:
    return Figures(
        f"{d['gen_tokens_per_s']:,.0f} tokens/s ({d['prompts']}x{d['n']}, {Path(str(d['model'])).name}); "
        f"weight sync {d['sync_s']:.3f} s for {d['sync_mib']:,.0f} MiB; wake-up {d['wake_up_s']:.2f} s"
    )


@extractor("overlap", compares="`one_step_off` rollout vs `sync` on Ray: s/step, held-out avg@8")
def _overlap(d: dict[str, Any]) -> Figures:
    layouts = d["summary"]
    speed = ", ".join(f"{k} {v['speedup_vs_sync_colocate']:.2f}x" for k, v in layouts.items() if k != "sync colocate")
    acc = ", ".join(f"{k} {mean(v['heldout_acc']):.1%}" for k, v in layouts.items())
    base = layouts["sync colocate"]["median_step_s"]
    return Figures(f"vs sync colocate ({base:.2f} s/step): {speed}; held-out {acc}")


@extractor("trl", compares="our trainer vs TRL's GRPOTrainer: s per RL step, held-out avg@8")
def _trl(d: dict[str, Any]) -> Figures:
    ratio = d["ratio_ours_to_trl"]
    return Figures(
        f"{ratio:.2f}x TRL's time per step ({d['ours_s_per_step']:.2f} vs {d['trl_s_per_step']:.2f} s); held-out "
        f"{d['ours_val_acc']:.1%} vs {d['trl_val_acc']:.1%} (base model {d['base_val_acc']:.1%})",
        "<= 0.7x TRL's time per step",
        ratio <= 0.7,
    )


@extractor("overhead", compares="Prefect, MLflow and Ray on top of the core RL step")
def _overhead(d: dict[str, Any]) -> Figures:
    s = d["summary"]  # a phase the run skipped has no fraction: the others still make the headline
    parts = []
    if "prefect_mlflow_frac" in s:
        parts.append(
            f"Prefect + MLflow {s['prefect_mlflow_frac']:+.1%} (CPU {s['prefect_mlflow_cpu_frac']:+.1%}; "
            f"Prefect alone {s['prefect_frac']:+.1%})"
        )
    if "ray_1x1_frac" in s:
        parts.append(f"Ray 1x1 {s['ray_1x1_frac']:+.1%} (CPU {s['ray_1x1_cpu_frac']:+.1%})")
    if "ray_2x2_vs_local_frac" in s:
        parts.append(f"Ray 2x2 vs local at 2 threads {s['ray_2x2_vs_local_frac']:+.1%}")
    # the goal is per layer: the in-process ones together (Prefect + MLflow) and Ray (1x1: the same compute)
    layers = [s[k] for k in ("prefect_mlflow_frac", "ray_1x1_frac") if k in s]
    met = max(layers) <= 0.05 if len(layers) == 2 else None
    return Figures(f"core step {s['core_step_s']:.2f} s; " + ", ".join(parts), None, met)


@extractor("pi_old", compares="pi_old from the sampler vs recomputed by the trainer: s per RL step, held-out avg@8")
def _pi_old(d: dict[str, Any]) -> Figures:
    s, rows = d["summary"], d["rows"]
    acc = ", ".join(f"{k} {v:.1%}" for k, v in s["heldout_acc"].items())
    return Figures(
        f"{s['ratio_rollout_to_recompute']:.2f}x the time per step (median of paired steps; the "
        f"{rows['recompute']['phases_s']['old_log_prob']:.2f} s pi_old forward skipped); held-out {acc}"
    )


@extractor("scaling", compares="step time and peak memory as batch and response length grow (x1, x2, x4)")
def _scaling(d: dict[str, Any]) -> Figures:
    fit, proj = d["fit"], d["projection"]
    return Figures(
        f"step s = {fit['intercept_s']:.2g} + {fit['s_per_1k_tokens']:.3g} per 1k generated tokens (R² {fit['r2']:.3f}); "
        f"peak memory {fit['mb_per_1k_tokens']:.3g} MB per 1k token positions of one rollout call "
        f"(R² {fit['mb_r2']:.3f}); 32B recipe, a projection: {proj['hours_per_step']:.2g} h per rollout step"
    )


def figures(name: str, payload: dict[str, Any]) -> tuple[str, Figures]:
    """(what ``name`` compares, its figures); "see <name>.md" for an unknown suite or a JSON its extractor cannot
    read, so one odd file never stops the summary."""
    see = Figures(f"see {name}.md")
    if name not in EXTRACTORS:
        bench = HERE / f"bench_{name}.py"
        return (description(bench) if bench.is_file() else "—"), see
    compares, fn = EXTRACTORS[name]
    try:
        return compares, fn(payload)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError):
        return compares, see


def goal_cell(payload: dict[str, Any], fig: Figures) -> str:
    goal = payload.get("goal") if isinstance(payload.get("goal"), str) else fig.goal  # the suite's words win
    if not goal:
        return "—"
    return goal if fig.met is None else f"{goal}: {'met' if fig.met else '**not met**'}"


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
