"""The rollout benchmark's headline columns: the default setting's ratio to ``generate`` on the default batch.

A headline must be the figure a user gets without changing a knob, so each default-batch row of rollout.json names
``default_vs_generate`` (median of per-round ratios) beside best-vs-best, and the ``hf_procs`` option apart.
"""

from __future__ import annotations


def span(values: list[float] | None) -> str:
    """``min-max`` of per-round ratios (or "one round")."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "one round"


DEFAULT_RECIPE = "tiny-dapo"  # the recipe whose rollout settings are "the default" (make run, dapo train)


def default_setting() -> dict[str, object]:
    """The rollout settings a user gets by default: ``rollout.hf_decode`` and ``rollout.hf_procs`` of the default
    recipe (what the headline measures; other settings are options)."""
    from dapo_core.config import load_config

    r = load_config(recipe=DEFAULT_RECIPE, env={}).rollout
    return {"recipe": DEFAULT_RECIPE, "hf_decode": r.hf_decode, "hf_procs": r.hf_procs}


def is_default_batch(row: dict) -> bool:
    """The default recipe's generation batch: 48 prompts x 8 samples in one call of 384 rows, 80 new tokens."""
    return row["max_new_tokens"] == 80 and row["rows_per_call"] == 384


def add_default_columns(report: dict, setting: dict[str, object]) -> dict:
    """Each default-batch row names the default setting's ratio to ``generate`` (``default_vs_generate``: the
    median of per-round ratios, as every ratio here) beside best-vs-best (best tok/s over best tok/s), for the
    default and for the ``hf_procs`` option. Derived from the row's measured figures; nothing is re-timed."""
    report["default_setting"] = setting
    for row in report["results"]:
        if not is_default_batch(row):
            continue
        if setting["hf_decode"] != "static" or setting["hf_procs"] not in (1, row.get("procs", 1)):
            raise ValueError(f"the default setting {setting} is not among this benchmark's columns: extend it")
        key = "static" if setting["hf_procs"] == 1 else "procs"
        row["default_vs_generate"] = row[f"{key}_vs_generate"]
        row["default_vs_generate_rounds"] = row.get(f"{key}_vs_generate_rounds")
        best = row["static_logprobs_tokens_per_s"] if key == "static" else row["procs_tokens_per_s"]
        row["default_best_vs_best"] = round(best / row["hf_logprobs_tokens_per_s"], 3)
        if "procs" in row:
            row["procs_best_vs_best"] = round(row["procs_tokens_per_s"] / row["hf_logprobs_tokens_per_s"], 3)
    return report


def default_lines(report: dict) -> list[str]:
    s = report["default_setting"]
    rows = [r for r in report["results"] if "default_vs_generate" in r]
    lines = [
        f"**The default** (`{s['recipe']}`: `rollout.hf_decode: {s['hf_decode']}`, `rollout.hf_procs: "
        f"{s['hf_procs']}`) vs `generate` on the default rollout batch, log-probs on. Median of per-round ratios "
        "(the headline) beside best-vs-best:",
        "",
        "| case | default vs generate, median (rounds) | best vs best | option: hf_procs, median | best vs best |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        procs = f"{r['procs']}: {r['procs_vs_generate']:.2f}x" if "procs" in r else "-"
        procs_best = f"{r['procs_best_vs_best']:.2f}x" if "procs" in r else "-"
        lines.append(
            f"| {r['case']} | {r['default_vs_generate']:.2f}x ({span(r.get('default_vs_generate_rounds'))}) "
            f"| {r['default_best_vs_best']:.2f}x | {procs} | {procs_best} |"
        )
    return [*lines, ""]
