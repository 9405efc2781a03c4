"""Trainer memory per GPU: sharded state (exact), gathered parameters, activations and logits (derived, measured).

Exact (tests compare them with what PyTorch allocates): parameter, gradient and AdamW bytes. Under
``trainer.strategy=fsdp2`` the master weights are float32 whatever ``model.dtype`` says
(``dapo_core.engines.fsdp.MASTER_DTYPE``), gradients are kept in the master dtype, AdamW keeps two moments of the
master's size plus one float32 ``step`` scalar per parameter tensor; all of it is divided by
``resources.trainer_world_size`` (FSDP2 pads each shard to a multiple of the world size: a few bytes, ignored).
``ddp`` keeps a full replica in ``model.dtype``. ``trainer.fsdp.cpu_offload`` moves all three to host memory.

Derived from the Qwen2 layer's operations and checked against the bytes autograd saves for backward on CPU
(``torch.autograd.graph.saved_tensors_hooks``, tests/test_plan.py), with s = micro x (prompt + response) tokens
and e = the compute dtype's bytes (``trainer.fsdp.param_dtype`` under fsdp2, else ``model.dtype``):

- per layer without checkpointing: 2 RMSNorms x (s·h·(4 + 2e) + 4s) [float32 input, normalized and output copies,
  rsqrt] + e·s·(2·H·d + 2·KV·d) [q, k after RoPE, v, attention output] + 4·H·s [attention logsumexp] + 4·e·s·I
  [gate, silu(gate), up, their product];
- with ``model.gradient_checkpointing``: the layer input (s·h·e) per layer, plus one layer's full activations
  while it is recomputed in backward;
- outside the layers: token ids (8s), the final norm (s·h·(4 + e) + 4s) and the LM head's input (n·(T+1)·h·e).

Assumed, not measured here: SDPA / flash attention (no T x T probabilities; an eager attention would add
n·H·T²·e per layer), every row of the micro-batch as long as the longest (prompt + response at their maximum),
and the FSDP2 prefetch keeping 2 decoder layers gathered (plus the root: embeddings, LM head, final norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo_core.planning.arch import DTYPE_BYTES, Arch, embedding_params, layer_params, param_count, param_tensor_count
from dapo_core.planning.logits import logits_memory

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

FSDP_MASTER_DTYPE = "float32"  # dapo_core.engines.fsdp.MASTER_DTYPE
STEP_TENSOR_BYTES = 4  # AdamW's per-tensor float32 `step` scalar
PREFETCHED_LAYERS = 2  # FSDP2: the layer computing + the one prefetched (estimate)


@dataclass(frozen=True)
class StateBytes:
    """Parameter, gradient and optimizer bytes held by one trainer rank (exact)."""

    params: int
    grads: int
    optimizer: int
    dtype: str  # the master dtype

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes kept for backward by one micro-batch's forward (``saved``) and the peak estimate around it."""

    tokens: int  # s = micro x (prompt + response)
    per_layer: int  # one layer's saved activations without checkpointing
    layers_total: int  # all layers (checkpointed: boundaries + one recomputed layer)
    outside: int  # token ids, final norm, LM-head input
    logits_live: int  # the LM-head output, held by the trainer and saved by log_probs_from_logits
    logits_saved: int  # what log_probs_from_logits saves beyond it (labels, logsumexp)
    logits_grad: int  # gradient buffers of the logits during backward (transient; estimate)

    @property
    def logits(self) -> int:
        """The logits' share of ``saved``."""
        return self.logits_live + self.logits_saved

    @property
    def saved(self) -> int:
        """What autograd keeps for backward at the end of the forward (what tests measure)."""
        return self.layers_total + self.outside + self.logits

    @property
    def peak(self) -> int:
        """Saved + the logits' gradient buffers: the activation peak of one micro-batch (estimate)."""
        return self.saved + self.logits_grad


def state_bytes(a: Arch, *, master_dtype: str, world: int) -> StateBytes:
    """Master weights, gradients (master dtype) and AdamW state (2 moments + step scalars) per rank."""
    p, mb = param_count(a), DTYPE_BYTES[master_dtype]
    steps = STEP_TENSOR_BYTES * param_tensor_count(a)  # every rank holds a step scalar per (sharded) tensor
    return StateBytes(
        params=p * mb // world, grads=p * mb // world, optimizer=2 * p * mb // world + steps, dtype=master_dtype
    )


def layer_activation_bytes(a: Arch, tokens: int, e: int) -> int:
    """Bytes one Qwen2 decoder layer saves for backward over ``tokens`` tokens in a dtype of ``e`` bytes."""
    s, h = tokens, a.hidden
    norms = 2 * (s * h * (4 + 2 * e) + 4 * s)  # float32 input, normalized (e), output (e), rsqrt (s, 1) fp32
    attention = e * s * (2 * a.heads * a.head_dim + 2 * a.kv_dim) + 4 * a.heads * s  # q, attn out, k, v; lse
    mlp = 4 * e * s * a.intermediate  # gate, silu(gate), up, silu(gate) * up
    return norms + attention + mlp


def activation_bytes(
    a: Arch, *, micro: int, prompt_len: int, response_len: int, e: int, checkpointing: bool, logits_dtype_bytes: int
) -> ActivationBytes:
    """Activations and logits of one micro-batch of ``micro`` rows of prompt_len + response_len tokens."""
    s = micro * (prompt_len + response_len)
    per_layer = layer_activation_bytes(a, s, e)
    if checkpointing:
        layers_total = a.layers * s * a.hidden * e + per_layer  # boundaries + one layer being recomputed
    else:
        layers_total = a.layers * per_layer
    outside = 8 * s + s * a.hidden * (4 + e) + 4 * s + micro * (response_len + 1) * a.hidden * e
    lg = logits_memory(micro=micro, response_len=response_len, vocab=a.vocab, e=logits_dtype_bytes)
    return ActivationBytes(s, per_layer, layers_total, outside, lg.live, lg.saved, lg.grad)


@dataclass(frozen=True)
class TrainerGpu:
    """One trainer rank's GPU (and host) memory."""

    state: StateBytes
    state_on_host: bool
    gathered: int  # param_dtype copies of the gathered layers and root (fsdp2)
    grad_buffers: int  # unsharded gradients before the reduce-scatter (transient)
    activations: ActivationBytes
    compute_dtype: str

    @property
    def resident(self) -> int:
        """What stays on the GPU between steps (the sharded state unless offloaded)."""
        return 0 if self.state_on_host else self.state.total

    @property
    def peak(self) -> int:
        """Resident state + gathered parameters + gradient buffers + one micro-batch's activation peak."""
        return self.resident + self.gathered + self.grad_buffers + self.activations.peak

    @property
    def host(self) -> int:
        return self.state.total if self.state_on_host else 0


def trainer_gpu(cfg: DapoConfig, a: Arch, *, world: int) -> TrainerGpu:
    """The trainer rank's memory for ``cfg`` sharded over ``world`` ranks (fsdp2) or replicated (ddp)."""
    from dapo_core.config.schema import resolved_max_new_tokens

    t = cfg.trainer
    fsdp = t.strategy == "fsdp2"
    return trainer_gpu_for(
        a,
        fsdp=fsdp,
        master=FSDP_MASTER_DTYPE if fsdp else cfg.model.dtype,
        compute=t.fsdp.param_dtype if fsdp else cfg.model.dtype,
        reduce=t.fsdp.reduce_dtype,
        reshard_after_forward=t.fsdp.reshard_after_forward,
        defer_grad_sync=t.fsdp.defer_grad_sync,
        cpu_offload=fsdp and t.fsdp.cpu_offload,
        world=world,
        micro=t.micro_batch_size,
        prompt_len=cfg.data.max_prompt_length,
        response_len=resolved_max_new_tokens(cfg),
        checkpointing=cfg.model.gradient_checkpointing,
    )


def trainer_gpu_for(
    a: Arch,
    *,
    fsdp: bool,
    master: str,
    compute: str,
    reduce: str,
    reshard_after_forward: bool,
    defer_grad_sync: bool,
    cpu_offload: bool,
    world: int,
    micro: int,
    prompt_len: int,
    response_len: int,
    checkpointing: bool,
) -> TrainerGpu:
    """``trainer_gpu`` from explicit settings (no config object: scripts/gpu_check.py runs without pydantic)."""
    e = DTYPE_BYTES[compute]
    state = state_bytes(a, master_dtype=master, world=world if fsdp else 1)
    gathered, grad_buffers = 0, 0
    if fsdp:
        layers_gathered = a.layers if not reshard_after_forward else min(PREFETCHED_LAYERS, a.layers)
        gathered = (embedding_params(a) + a.hidden + layers_gathered * layer_params(a)) * e
        unsharded = param_count(a) if defer_grad_sync else layer_params(a) + embedding_params(a)
        grad_buffers = unsharded * (e + DTYPE_BYTES[reduce])  # param_dtype gradients and their reduce_dtype copy
    acts = activation_bytes(
        a,
        micro=micro,
        prompt_len=prompt_len,
        response_len=response_len,
        e=e,
        checkpointing=checkpointing,
        logits_dtype_bytes=e,
    )
    return TrainerGpu(state, cpu_offload, gathered, grad_buffers, acts, compute)
