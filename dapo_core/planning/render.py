"""The plan as a readable table (``render_text``) and as JSON-ready data (``plan_to_dict``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dapo_core.planning.plan import Plan, gib


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<34} {value:>14}  {note}".rstrip()


def _trainer_rows(p: Plan) -> list[str]:
    t, a = p.trainer, p.trainer.activations
    where = ("host" if t.state_on_host else "GPU") if p.on_gpu else "CPU"
    return [
        f"trainer, per rank ({t.state.dtype} master, compute {t.compute_dtype})",
        _row("weights (master)", gib(t.state.params), f"exact, on {where}"),
        _row("gradients", gib(t.state.grads), f"exact, on {where}"),
        _row("optimizer (AdamW)", gib(t.state.optimizer), f"exact, on {where}"),
        _row("gathered params (fsdp2)", gib(t.gathered), "estimate: root + prefetched layers"),
        _row("gradient buffers", gib(t.grad_buffers), "estimate: before reduce-scatter"),
        _row("activations", gib(a.layers_total + a.outside), f"derived+measured, {a.tokens} tokens"),
        _row("logits", gib(a.logits), "exact: LM-head output + lse"),
        _row("logits backward transient", gib(a.logits_grad), "estimate"),
        _row(
            "peak on GPU" if p.on_gpu else "peak (CPU)",
            gib(t.peak),
            f"available {gib(p.trainer_available)}" if p.on_gpu else "",
        ),
    ]


def _vllm_rows(p: Plan) -> list[str]:
    v = p.vllm
    if v is None:
        return []
    rows = [
        f"vLLM, per GPU ({v.dtype})",
        _row("budget (utilization x GPU)", gib(v.budget)),
        _row("weights", gib(v.weights), "params x dtype / TP"),
        _row("overhead", gib(v.overhead), "estimate: context, graphs, profile run"),
        _row("KV cache", gib(v.kv_cache), f"{v.kv_bytes_per_token // 1024} KiB/token"),
        _row("sequences that fit", str(v.seqs_fit), f"of {v.max_model_len} tokens; batch asks {v.seqs_asked}"),
    ]
    if p.colocated:
        rows.append(_row("trainer GPU while vLLM sleeps", gib(p.trainer_available), "level 1: weights to host"))
    return rows


def _other_rows(p: Plan) -> list[str]:
    s, d = p.step, p.disk
    return [
        "per step",
        _row("weight sync per engine", gib(s.sync_bytes_per_engine), f"{s.sync_dtype}, x {s.engines} engines"),
        _row(
            "sync time", f"{s.sync_seconds:.1f} s", f"estimate at {s.gbps:g} GB/s; {s.sync_seconds_serial:.0f} s serial"
        ),
        _row("tokens per generation batch", f"{s.tokens_mean:,}", f"assumed mean = max/2; max {s.tokens_max:,}"),
        "per checkpoint",
        _row("HF files", gib(d.hf_bytes), "exact (header excluded)"),
        _row("fsdp2 shards", gib(d.shard_bytes), "exact: fp32 master + 2 moments"),
        _row("ddp optimizer file", gib(d.optimizer_file_bytes), "exact tensors + small pickle"),
        _row("disk over the run", gib(d.run_total), f"{d.kept} of {d.saves} saves kept + final x {d.final_copies}"),
        _row("host memory, node 0", gib(p.host_per_node), "estimate"),
    ]


def render_text(p: Plan) -> str:
    """The plan as lines of text: figures, then problems and warnings, then the verdict."""
    a = p.arch
    gpus = f"{p.hw.nodes} x {p.hw.gpus_per_node} GPUs of {gib(p.hw.gpu_mem)}" if p.on_gpu else "CPU"
    lines = [
        f"plan for {p.recipe} on {gpus}",
        f"model: {p.params:,} parameters (exact; h {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} heads, "
        f"I {a.intermediate}, V {a.vocab}, {'tied' if a.tied else 'untied'}) from {a.source}",
        *_trainer_rows(p),
        *_vllm_rows(p),
        *_other_rows(p),
    ]
    if not p.on_gpu:
        lines.append("no GPUs (resources.n_gpus_per_node = 0): no GPU limits apply")
    lines += [f"WARNING: {w}" for w in p.warnings]
    lines += [f"PROBLEM: {x}" for x in p.problems]
    lines.append("verdict: fits" if p.fits else f"verdict: does NOT fit ({len(p.problems)} problem(s))")
    return "\n".join(lines)


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """Every figure (bytes) plus the derived totals, problems, warnings and the verdict."""
    out = dataclasses.asdict(p)
    out["trainer"]["peak"] = p.trainer.peak
    out["trainer"]["resident"] = p.trainer.resident
    out["trainer"]["activations"]["saved"] = p.trainer.activations.saved
    out["trainer"]["activations"]["peak"] = p.trainer.activations.peak
    out["disk"]["per_checkpoint"] = p.disk.per_checkpoint
    out["disk"]["run_total"] = p.disk.run_total
    out["fits"] = p.fits
    return out
