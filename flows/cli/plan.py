"""`dapo plan`: the pre-flight memory / sync / disk planner (dapo_core.planning), and `dapo train`'s check.

    dapo plan --recipe dapo-qwen2.5-32b --nodes 16 --gpus-per-node 8 --gpu-mem 80
    dapo plan --recipe dapo-qwen2.5-math-1.5b --set trainer.micro_batch_size=16 --json

Exit 0 when the plan fits, 1 when it does not (each problem names the knob to change), 2 on a bad config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from dapo_core.config import DapoConfig
from flows.cli.common import ConfigOpt, RecipeOpt, SetOpt, fail, resolve_config

EXIT_DOES_NOT_FIT = 1


def _gpu_mem_for_train() -> float | None:
    """GPU memory (GiB) for `dapo train`'s check: $DAPO_PLAN_GPU_MEM_GB, else this machine's first CUDA GPU."""
    from dapo_core.planning import GPU_MEM_ENV

    if os.environ.get(GPU_MEM_ENV):
        return float(os.environ[GPU_MEM_ENV])
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    return None


def preflight(cfg: DapoConfig) -> None:
    """`dapo train`'s check before any work: stop (exit 1) with the problems when a GPU config cannot fit.

    Runs when the config uses GPUs (resources.n_gpus_per_node > 0, or trainer.device cuda); GPU memory from
    $DAPO_PLAN_GPU_MEM_GB or the local GPU (default 80 GiB when neither: a Ray head without a GPU)."""
    from dapo_core.planning import ArchError, default_hardware, make_plan

    if cfg.resources.n_gpus_per_node == 0 and not cfg.trainer.device.startswith("cuda"):
        return
    gpus_per_node = cfg.resources.n_gpus_per_node or 1
    try:
        plan = make_plan(cfg, default_hardware(cfg, gpu_mem_gib=_gpu_mem_for_train(), gpus_per_node=gpus_per_node))
    except ArchError as exc:  # the training flow reports a missing model itself
        typer.echo(f"dapo plan: skipped ({exc})", err=True)
        return
    if not plan.fits:
        problems = "\n".join(f"  - {p}" for p in plan.problems)
        typer.echo(
            f"pre-flight plan: this config cannot fit ({len(plan.problems)} problem(s)):\n{problems}\n"
            "see `dapo plan` for every figure; --skip-plan trains anyway",
            err=True,
        )
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        config: ConfigOpt = None,
        recipe: RecipeOpt = None,
        overrides: SetOpt = None,
        nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes (default resources.nnodes).")] = None,
        gpus_per_node: Annotated[
            int | None, typer.Option("--gpus-per-node", help="GPUs per node (default resources.n_gpus_per_node).")
        ] = None,
        gpu_mem: Annotated[
            float | None, typer.Option("--gpu-mem", help="GiB per GPU (default $DAPO_PLAN_GPU_MEM_GB or 80).")
        ] = None,
        host_mem: Annotated[float | None, typer.Option("--host-mem", help="GiB of host memory per node.")] = None,
        disk: Annotated[float | None, typer.Option("--disk", help="GiB of disk for the run's outputs.")] = None,
        sync_gbps: Annotated[
            float | None, typer.Option("--sync-gbps", help="Weight-sync bandwidth in GB/s (default 10).")
        ] = None,
        model_config: Annotated[
            Path | None, typer.Option("--model-config", help="config.json (or its directory) of the model.")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    ) -> None:
        """Memory per GPU, weight sync per step and disk per checkpoint of a config; exit 1 if it cannot fit."""
        from dapo_core.planning import ArchError, default_hardware, make_plan, plan_to_dict, render_text

        cfg = resolve_config(config, recipe, overrides)
        hw = default_hardware(
            cfg, nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem, host_mem_gib=host_mem,
            disk_gib=disk, sync_gbps=sync_gbps,
        )  # fmt: skip
        try:
            result = make_plan(cfg, hw, model_config=model_config)
        except ArchError as exc:
            fail(str(exc))
        typer.echo(json.dumps(plan_to_dict(result), indent=2) if as_json else render_text(result))
        if not result.fits:
            raise typer.Exit(EXIT_DOES_NOT_FIT)
