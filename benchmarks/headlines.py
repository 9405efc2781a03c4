"""The headline of each benchmark suite: one extractor per suite reads its JSON (``benchmarks/results/<name>.json``)
and returns what ``benchmarks.summary`` prints for it, the goal the issue set and whether the figures meet it.

To add a suite's headline, register a function with ``@extractor("<name>", compares="...")``; a suite without one
gets "see <name>.md", and so does a JSON missing a key its extractor reads. Stdlib only (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.suites import description

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Figures:
    """What an extractor reads from a suite's JSON: the headline, the goal (when the suite states one) and
    whether the figures meet it (None: not judged)."""

    headline: str
    goal: str | None = None
    met: bool | None = None


Extractor = Callable[[dict[str, Any]], Figures]
EXTRACTORS: dict[str, tuple[str, Extractor]] = {}


def extractor(*names: str, compares: str) -> Callable[[Extractor], Extractor]:
    """Register ``fn`` as the headline of the result files ``names`` (``<name>.json``); ``compares`` in words."""

    def register(fn: Extractor) -> Extractor:
        for name in names:
            EXTRACTORS[name] = (compares, fn)
        return fn

    return register


@extractor(
    "rollout",
    compares="hf rollout backend vs bare `generate`; static decode loop (one process / several) vs `generate`",
)
def _rollout(d: dict[str, Any]) -> Figures:
    """The headline is the default setting's figure (``default_vs_generate``: what a user gets without changing a
    knob); ``rollout.hf_procs`` is reported as an option, never as the headline."""
    cases = d["results"]
    worst = min(c["ratio"] for c in cases)
    default = [c for c in cases if "default_vs_generate" in c]  # the default rollout batch
    setting = d["default_setting"]
    ratios = ", ".join(f"{c['default_vs_generate']:.2f}x" for c in default)
    best = ", ".join(f"{c['default_best_vs_best']:.2f}x" for c in default)
    text = (
        f"the default (`hf_decode: {setting['hf_decode']}`, `hf_procs: {setting['hf_procs']}`) {ratios} `generate` "
        f"on the default rollout batch (random init, warm-started base model; median of rounds, best-vs-best "
        f"{best}; {d['results'][-1]['static_of_bound']:.0%} of the arithmetic bound); hf backend {worst:.2f}x bare "
        "`generate` at worst"
    )
    multi = [c for c in default if "procs" in c]
    if multi:
        options = ", ".join(f"{c['procs_vs_generate']:.2f}x" for c in multi)
        text += f"; option `rollout.hf_procs: {multi[0]['procs']}` {options} `generate`"
    if d.get("vllm_cpu"):  # only from .venv-vllm
        bare = {c["case"]: c["bare_tokens_per_s"] for c in cases}
        vr = [r["vllm_tokens_per_s"] / bare[r["case"]] for r in d["vllm_cpu"]["results"]]
        text += f"; vLLM {d['vllm_cpu']['vllm']} CPU {min(vr):.2f}-{max(vr):.2f}x bare `generate`"
    met = worst >= 0.9 and bool(default) and all(c["default_vs_generate"] >= 3.0 for c in default)
    goal = "hf backend >= 0.9x bare `generate`; the default setting >= 3x `generate` (default batch)"
    return Figures(text, goal, met)


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
    """Both of our sides when the JSON has them: the same decode path as TRL (``generate``) and as shipped."""
    ratio = d["ratio_ours_to_trl"]
    acc = f"held-out {d['ours_val_acc']:.1%} vs {d['trl_val_acc']:.1%} (base model {d['base_val_acc']:.1%})"
    if "ratio_generate_to_trl" not in d:  # a race run before both decode paths were measured
        return Figures(
            f"{ratio:.2f}x TRL's time per step ({d['ours_s_per_step']:.2f} vs {d['trl_s_per_step']:.2f} s); {acc}",
            "<= 0.7x TRL's time per step",
            ratio <= 0.7,
        )
    gen = d["ratio_generate_to_trl"]
    text = (
        f"{gen:.2f}x TRL's time per step with the same decode path (`generate`), {ratio:.2f}x as shipped (static "
        f"loop; {d['ours_s_per_step']:.2f} vs {d['trl_s_per_step']:.2f} s); {acc}"
    )
    return Figures(text, "<= 0.7x TRL's time per step, with the same decode path", gen <= 0.7)


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
