"""Curation at the size of the published DAPO-Math-17k file: 1.79M rows, time and peak memory.

Run::

    .venv/bin/python -m benchmarks.bench_curate            # writes benchmarks/results/curate.json (+ curate.md)
    .venv/bin/python -m benchmarks.bench_curate --quick    # 10x smaller inputs

Two inputs, built first (not timed) from the synthetic generator:

- ``published_shape``: 17,900 distinct problems x 100 copies, shuffled, as a verl parquet with the DAPO template
  applied -- the shape of the published file (which repeats ~17.9k problems ~100x);
- ``all_distinct``: 1.8M generated problem/answer rows as jsonl (the worst case: only the generator's own
  repeats are removed, every kept prompt is tokenised and written).

Each curation (read -> validate/dedup/tokenise/split -> write parquet + card) runs in a fresh subprocess, so its
peak RSS (VmHWM) is its own. The goal from the issue is < 60 s on 2 cores. Informational: nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_results

PUBLISHED_DISTINCT, PUBLISHED_COPIES = 17_900, 100
ALL_DISTINCT_ROWS = 1_800_000


def build_published_shape(path: Path, distinct: int, copies: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo_core.data.synthetic import generate_problems
    from dapo_core.data.templates import DAPO_TEMPLATE

    problems = generate_problems(distinct, seed=1, min_ops=1, max_ops=4)
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_TEMPLATE.apply(p.question), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(p.answer), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(problems)
    ]
    table = pa.concat_tables([pa.Table.from_pylist(rows)] * copies)
    order = np.random.default_rng(0).permutation(table.num_rows)
    pq.write_table(table.take(pa.array(order)), path)


def build_all_distinct(path: Path, n: int) -> None:
    from dapo_core.data.synthetic import generate_problems, write_raw_jsonl

    write_raw_jsonl(generate_problems(n, seed=2, min_ops=1, max_ops=4), path)


def worker(source: str, template: str, max_prompt_length: int, out_dir: str) -> dict[str, Any]:
    """One timed curation in this process; returns phase times, counts and peak RSS."""
    from dapo_core.data.card import build_card, write_card
    from dapo_core.data.curate import curate
    from dapo_core.data.loaders import load_source
    from dapo_core.data.schema import write_rl_parquet
    from dapo_core.data.templates import load_token_counter

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    rows = load_source(source)
    times["read_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    count = load_token_counter("char")
    times["tokenizer_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    result = curate([rows], template=template, max_prompt_length=max_prompt_length, count_tokens=count, val_size=200)
    times["curate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    write_rl_parquet(result.train, Path(out_dir) / "train.parquet")
    write_rl_parquet(result.val, Path(out_dir) / "val.parquet")
    card = build_card(result, settings={"template": template, "max_prompt_length": max_prompt_length})
    write_card(card, out_dir)
    times["write_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - t0
    return {
        **{k: round(v, 2) for k, v in times.items()},
        "rows_in": card["counts"]["rows_in"],
        "kept": card["counts"]["kept"],
        "duplicates": card["counts"]["duplicates_removed"],
        "peak_rss_mb": peak_rss_mb(),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (Linux), which starts afresh at exec -- ``ru_maxrss`` would
    also count the pages of the parent this worker was forked from."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _run_worker(source: Path, template: str, max_len: int, out_dir: Path) -> dict[str, Any]:
    args = [
        sys.executable,
        "-m",
        "benchmarks.bench_curate",
        "--worker",
        str(source),
        template,
        str(max_len),
        str(out_dir),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller inputs")
    parser.add_argument("--worker", nargs=4, metavar=("SOURCE", "TEMPLATE", "MAX_LEN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        source, template, max_len, out = args.worker
        print(json.dumps(worker(source, template, int(max_len), out)))
        return
    scale = 10 if args.quick else 1
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-curate-") as tmp:
        root = Path(tmp)
        published, distinct = root / "published.parquet", root / "distinct.jsonl"
        t = time.perf_counter()
        build_published_shape(published, PUBLISHED_DISTINCT // scale, PUBLISHED_COPIES)
        build_all_distinct(distinct, ALL_DISTINCT_ROWS // scale)
        print(f"inputs built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        cases = {
            "published_shape": (published, "dapo", 2048),
            "all_distinct": (distinct, "tiny", 32),
        }
        for name, (source, template, max_len) in cases.items():
            out = root / f"out-{name}"
            results[name] = {
                "input_mb": round(source.stat().st_size / 2**20, 1),
                "template": template,
                **_run_worker(source, template, max_len, out),
            }
    header = "| input | rows in | kept | duplicates | read s | curate s | write s | total s | peak RSS MB |"
    lines = [header, "|" + "---|" * 9]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['rows_in']:,} | {r['kept']:,} | {r['duplicates']:,} | {r['read_s']} | {r['curate_s']} "
            f"| {r['write_s']} | {r['total_s']} | {r['peak_rss_mb']} |"
        )
    load = os.getloadavg()[0]
    note = f"\nGoal: < 60 s on 2 cores. Load average at the end: {load:.2f} (the machine is shared)."
    write_results(
        "curate", {"quick": args.quick, "results": results, "loadavg_1m": round(load, 2)}, "\n".join(lines) + note
    )


if __name__ == "__main__":
    main()
