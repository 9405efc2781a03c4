"""Pre-flight planning: memory per GPU, weight sync and disk of a config on a cluster (`dapo plan`).

    from dapo_core.planning import Hardware, make_plan, render_text
    plan = make_plan(cfg, Hardware(nodes=16, gpus_per_node=8, gpu_mem=80 << 30))
    print(render_text(plan)); plan.fits

Exact: parameter, gradient, optimizer and checkpoint bytes. Derived and measured on CPU: activations and logits.
Estimates (stated constants): vLLM overheads, CUDA contexts, sync time, mean response length. See docs/plan.md.
"""

from dapo_core.planning.arch import PUBLIC_CONFIGS, Arch, ArchError, param_count, resolve_arch
from dapo_core.planning.plan import GIB, GPU_MEM_ENV, Hardware, Plan, default_hardware, make_plan
from dapo_core.planning.render import plan_to_dict, render_text

__all__ = [
    "GIB",
    "GPU_MEM_ENV",
    "PUBLIC_CONFIGS",
    "Arch",
    "ArchError",
    "Hardware",
    "Plan",
    "default_hardware",
    "make_plan",
    "param_count",
    "plan_to_dict",
    "render_text",
    "resolve_arch",
]
