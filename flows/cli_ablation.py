"""`dapo ablation`: DAPO's Table 1 in miniature (GRPO -> +each technique -> DAPO, and a supervised control)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from flows.cli_common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config
from flows.cli_train import USER_ERRORS


def register(app: typer.Typer) -> None:
    @app.command("ablation")
    def ablation(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        regimes: Annotated[
            str, typer.Option("--regimes", help="Comma-separated: tuned (recipe lr), aggressive (4x lr).")
        ] = "tuned,aggressive",
        tuned_lr: Annotated[
            float | None, typer.Option("--tuned-lr", help="lr of the tuned regime (default: the recipe's trainer.lr).")
        ] = None,
        aggressive_lr: Annotated[
            float | None,
            typer.Option("--aggressive-lr", help="lr of the aggressive regime (default: 4x the recipe's)."),
        ] = None,
        steps: Annotated[
            int | None,
            typer.Option("--steps", help="Gradient steps per run (default: the recipe's trainer.total_steps)."),
        ] = None,
        seeds: Annotated[int | None, typer.Option("--seeds", help="Seeds 1..N per rung (default 3).")] = None,
        base: Annotated[
            Path | None,
            typer.Option("--base", help="Base model dir (default: curate + warm start, reused if current)."),
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option("--out", help="Report dir (default benchmarks/results; --quick: outputs/ablation-quick)."),
        ] = None,
        rungs: Annotated[
            str | None,
            typer.Option(
                "--rungs",
                help="Comma-separated rungs (default: the Table-1 ladder and sft-control): grpo, overlong-filtering, "
                "clip-higher, soft-overlong, token-level-loss, dapo; successors gspo, cispo, gmpo, dr-grpo; "
                "sft-control (needs dapo).",
            ),
        ] = None,
        name: Annotated[
            str, typer.Option("--name", help="Report file stem: <out>/<name>.json/.md/.png (e.g. successors).")
        ] = "ablation",
        resume: Annotated[
            bool,
            typer.Option(
                "--resume",
                help="Reuse the finished runs journaled in <out>/<name>.journal.jsonl whose config, base model and "
                "data are unchanged (after a kill or across sessions); the rest run under the same parent run.",
            ),
        ] = False,
        eval_k: Annotated[
            int | None,
            typer.Option(
                "--eval-k",
                help="Samples per held-out problem of each final score (default 32, Table 1's avg@32; --quick: the "
                "recipe's rollout.val_n). Journaled runs scored at another k are scored again, not trained again.",
            ),
        ] = None,
        quick: Annotated[
            bool,
            typer.Option("--quick", help="One seed, 2 steps, both regimes (a smoke run; shrink the model with --set)."),
        ] = False,
    ) -> None:
        """Table 1 in miniature: each DAPO technique added to GRPO in turn, per lr regime, vs SFT for the same time.

        Default recipe: tiny-dapo-table1 (tiny-dapo at batch 64; not params.yaml). Writes ablation.json,
        ablation.md and ablation.png, also logged to one parent MLflow run.
        """
        from flows.ablation import (
            DEFAULT_OUT_DIR,
            DEFAULT_RECIPE,
            DEFAULT_SEEDS,
            QUICK_OUT_DIR,
            QUICK_SEEDS,
            QUICK_STEPS,
            check_eval_k,
        )

        if config is None and recipe is None:
            recipe = DEFAULT_RECIPE
        cfg = resolve_config(config, recipe, overrides)  # a bad config fails here, before any work
        if quick:
            steps = QUICK_STEPS if steps is None else steps
            seeds = QUICK_SEEDS if seeds is None else seeds
            eval_k = cfg.rollout.val_n if eval_k is None else eval_k
        out_dir = str(out) if out is not None else (QUICK_OUT_DIR if quick else DEFAULT_OUT_DIR)
        # the plan's own checks (a DAPO recipe, regime names, lrs, steps) before any work
        from dapo_core.config.ablation import build_ladder, build_regimes, curve_test_freq, parse_regimes, parse_rungs
        from dapo_core.evaluation.ablation_report import report_stem

        try:
            rung_names = parse_rungs(rungs) if rungs is not None else None
            report_stem(name)
            build_ladder(cfg, rung_names)
            build_regimes(cfg, regimes, tuned_lr=tuned_lr, aggressive_lr=aggressive_lr)
            curve_test_freq(steps if steps is not None else cfg.trainer.total_steps)
            if eval_k is not None:
                check_eval_k(eval_k)
            if seeds is not None and seeds < 1:
                raise ValueError(f"--seeds ({seeds}) must be >= 1 (seeds 1..N go to trainer.seed), e.g. --seeds 3")
        except ValueError as exc:
            fail(str(exc))
        from flows.ablation import ablation_flow

        t0 = time.perf_counter()
        try:
            result = ablation_flow(
                config_path=str(config) if config else None, recipe=recipe, overrides=overrides or [],
                regimes=parse_regimes(regimes), tuned_lr=tuned_lr, aggressive_lr=aggressive_lr, steps=steps,
                seeds=seeds if seeds is not None else DEFAULT_SEEDS, base=str(base) if base else None, out_dir=out_dir,
                rungs=rung_names, name=name, resume=resume, eval_k=eval_k,
            )  # fmt: skip
        except USER_ERRORS as exc:
            fail(str(exc))
        typer.echo("")
        reused = f", {result['reused_runs']} journaled run(s) reused" if result.get("reused_runs") else ""
        typer.echo(
            f"== dapo ablation finished in {time.perf_counter() - t0:.0f}s (MLflow run {result['parent_run_id']}"
            f"{reused})"
        )
        for name, regime in result["regimes"].items():
            row = "  ".join(f"{r['name']} {r['mean']:.3f}" for r in regime["rungs"])
            typer.echo(f"{name} (lr {regime['lr']:g}), held-out avg@{result['k']}: {row}")
        for kind, path in result["paths"].items():
            typer.echo(f"{kind}: {path}")
