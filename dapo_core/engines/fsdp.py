"""FSDP2 for the policy: shard an HF causal LM per decoder layer, gather it back, checkpoint its shards.

Every helper here that touches a sharded model is a *collective*: every rank of the process group calls it, in
the same order (each one all-gathers or writes together). Pure torch; the Ray side lives in
``dapo_core.distributed.trainer_group``.

    dist.init_process_group(process_group_backend(device.type))  # "cpu:gloo,cuda:nccl" / "gloo"; also a world of 1
    model = apply_fsdp2(load_model(path, dtype=MASTER_DTYPE), FsdpSettings(param_dtype="bfloat16"))
    trainer = PolicyTrainer(model, optim)                # sees the FSDP module: no manual gradient all-reduce
    ...                                                  # update / sft_step / compute_log_probs on every rank
    weights = full_state_dict(model)                     # rank 0: the full CPU state dict (weight sync)
    save_fsdp_checkpoint(root, step, model=model, optimizer=trainer.optimizer, trainer_state=trainer.state_dict())
    load_fsdp_checkpoint(path, model=model, optimizer=trainer.optimizer)    # then trainer.load_state_dict(...)
    export_hf_dir(model, tokenizer, "outputs/export")    # full weights gathered, rank 0 writes

Gradients are *summed* over ranks (divide factor 1), not averaged: the token-level loss (DAPO Eq. 12) already
divides every rank's token sum by the token count of the whole mini-batch over all ranks, so the sum of the
ranks' gradients is the gradient of the whole mini-batch. FSDP's default (average) would shrink it by the world
size. The fp32 master weights stay sharded; ``param_dtype`` is the dtype they are all-gathered and computed in.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dapo_core.engines.batch import PolicyBatch
from dapo_core.engines.checkpoint import LoadedCheckpoint, ShardedSave, load_checkpoint, save_checkpoint, shards_dir
from dapo_core.engines.dist_setup import barrier_device

if TYPE_CHECKING:
    from dapo_core.config.schema import FsdpConfig

logger = logging.getLogger(__name__)

# Valid dtype names of FsdpSettings (the same names as trainer.fsdp.* in the config).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The dtype of the sharded master weights (and of the optimizer state): the model is loaded in it before sharding.
MASTER_DTYPE = "float32"

_MODEL_KEY = "model"
_OPTIM_KEY = "optimizer"


def _dtype(name: str, field: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"FsdpSettings.{field} ({name!r}) is not a dtype name; valid: {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class FsdpSettings:
    """How ``apply_fsdp2`` shards the model (mirrors ``trainer.fsdp`` of the config)."""

    param_dtype: str = "bfloat16"  # all-gather / compute dtype of the parameters
    reduce_dtype: str = "float32"  # dtype of the gradient reduce-scatter
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state in host memory
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3); False = ZeRO-2

    def __post_init__(self) -> None:
        _dtype(self.param_dtype, "param_dtype")
        _dtype(self.reduce_dtype, "reduce_dtype")

    @classmethod
    def from_config(cls, cfg: FsdpConfig) -> FsdpSettings:
        """From the config's ``trainer.fsdp`` section."""
        return cls(
            param_dtype=cfg.param_dtype,
            reduce_dtype=cfg.reduce_dtype,
            cpu_offload=cfg.cpu_offload,
            reshard_after_forward=cfg.reshard_after_forward,
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``): one FSDP unit each."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"apply_fsdp2 shards one unit per decoder layer, but {type(model).__name__} has no non-empty "
            "`model.layers` ModuleList: pass an HF causal LM such as Qwen2ForCausalLM (AutoModelForCausalLM)"
        )
    return layers


def is_fsdp(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (its parameters are sharded DTensors)."""
    return isinstance(model, FSDPModule)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (HF activation checkpointing, non-reentrant); a
    no-op when it is already on or the model has no such switch."""
    if getattr(model, "is_activation_checkpointing", False):
        return
    enable = getattr(model, "activation_checkpointing_enable", None)  # the transformers 5.x name
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable):
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def full_value(t: Tensor) -> Tensor:
    """A DTensor (e.g. the grad norm of sharded gradients) as a plain tensor holding its full value."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def filler_micro_batch(device: torch.device) -> PolicyBatch:
    """One 2-token row with an all-zero response mask and zero advantage: a forward/backward that adds exactly
    nothing (every loss term is multiplied by the mask). FSDP ranks with fewer micro-batches run these, so that
    every rank all-gathers the parameters as many times as the others."""
    ids = torch.zeros(1, 2, dtype=torch.long)  # (1, P+T) with P = T = 1; token 0 exists in every vocabulary
    return PolicyBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),  # attends to real tokens: no all-masked softmax, no NaN
        position_ids=torch.arange(2).unsqueeze(0),  # (1, 2)
        response_mask=torch.zeros(1, 1),  # (1, T)
        prompt_width=1,
        group_index=torch.zeros(1, dtype=torch.long),
        advantages=torch.zeros(1),
        old_log_probs=torch.zeros(1, 1),
    ).to(device)


def _max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """Element-wise max of a small integer vector over the ranks (one all-reduce; itself without a group)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def world_size() -> int:
    """The number of ranks; 1 without an initialised process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_ranks(value: float, device: torch.device) -> float:
    """Collective: ``value`` summed over the ranks in float64 (itself without a group), e.g. a token count."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def most_over_ranks(count: int, device: torch.device) -> int:
    """Collective: the largest ``count`` of any rank (e.g. micro-batches: the others pad with fillers)."""
    return _max_over_ranks([count], device)[0]


def agreed_mini_batch_count(count: int, device: torch.device) -> int:
    """Collective: the mini-batch count every rank must step through. Ranks may hold ``count`` = that number or 0
    (no rows: it joins each mini-batch with fillers only); anything else raises on every rank alike."""
    fewest_neg, most, fewest_nonzero_neg = _max_over_ranks([-count, count, -(count or 1 << 40)], device)
    if most > 0 and -fewest_nonzero_neg != most:
        raise ValueError(
            f"ranks hold {-fewest_neg}..{most} mini-batches: every rank needs a piece of every mini-batch (or no "
            "rows at all) so that all take the same optimizer steps; shard with "
            "dapo_core.distributed.sharding.shard_for_update and call update(mini_batch_groups=1)"
        )
    return most


def apply_fsdp2(
    model: nn.Module,
    settings: FsdpSettings,
    *,
    mesh: DeviceMesh | None = None,
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, tied LM head); in place.

    Needs an initialised process group. ``mesh`` defaults to all ranks on CUDA when available, else CPU; the
    parameters move to the mesh's device layer by layer as they are sharded (load the model on CPU in
    ``MASTER_DTYPE``). Activation checkpointing is switched on first, so it wraps the unsharded layers. Build the
    optimizer *after* this call: sharding replaces the parameters.
    """
    layers = decoder_layers(model)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=_dtype(settings.param_dtype, "param_dtype"),
        reduce_dtype=_dtype(settings.reduce_dtype, "reduce_dtype"),
    )
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if settings.cpu_offload else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "offload_policy": offload,
        "reshard_after_forward": settings.reshard_after_forward,
    }
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)  # the root's own parameters; FSDP keeps the root gathered from forward to backward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # DAPO Eq. 12: each rank's loss is its token sum / the *global* token count, so the gradients must be
            # summed over ranks (factor 1), with plain SUM reductions (no AVG / PREMUL_SUM: gloo lacks them).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    logger.info(
        "FSDP2: %d decoder layers + root over %d rank(s); params %s, reduce %s, cpu_offload %s, reshard %s",
        len(layers),
        world_size(),
        settings.param_dtype,
        settings.reduce_dtype,
        settings.cpu_offload,
        settings.reshard_after_forward,
    )
    return model


# ---------------------------------------------------------------------------------------------- full weights
def full_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Collective: the full (unsharded) state dict on CPU on rank 0, with HF names; ``{}`` on the other ranks.

    ``dtype`` casts the floating-point tensors (e.g. to the rollout engine's dtype before a weight sync).
    """
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state: dict[str, Tensor] = {k: v for k, v in gathered.items() if isinstance(v, Tensor)}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def gathered_hf_model(model: nn.Module, *, dtype: torch.dtype | None = None) -> nn.Module | None:
    """Collective: on rank 0 a CPU copy of the HF model holding the full weights (for ``save_pretrained``); None
    elsewhere.

    The copy is built on the meta device and takes the gathered tensors as they are (no second copy), so its
    non-persistent buffers (e.g. rotary frequencies) stay on meta: save it, do not run it.
    """
    state = full_state_dict(model, dtype=dtype)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    # the model's own HF class (first non-FSDP class of the wrapped class): remote-code models work too
    hf_cls: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = copy.deepcopy(model.config)  # type: ignore[union-attr]
    if dtype is not None:
        config.dtype = dtype
    with torch.device("meta"):
        skeleton: Any = hf_cls(config)
    missing, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]  # tied: the embeddings
    if missing or unexpected:
        name = type(skeleton).__name__
        raise ValueError(f"gathered state dict does not match {name}: missing {missing}, unexpected {unexpected}")
    skeleton.tie_weights()
    return skeleton


def export_hf_dir(
    model: nn.Module, tokenizer: Any | None, path: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Collective: gather the full weights and write one HF directory at ``path`` (rank 0 writes, atomically).

    Every rank returns after the directory is complete. ``tokenizer`` is only needed on rank 0.
    """
    from dapo_core.engines.models import save_hf_dir

    hf_model = gathered_hf_model(model, dtype=dtype)
    ok = True
    error: BaseException | None = None
    if hf_model is not None:
        try:
            save_hf_dir(hf_model, tokenizer, path)  # type: ignore[arg-type]
        except BaseException as exc:  # tell the other ranks, then re-raise here
            ok, error = False, exc
    if not all_ranks_ok(ok) and error is None:
        raise RuntimeError(f"rank 0 failed to export the model to {path}; see rank 0's error")
    if error is not None:
        raise error
    return Path(path)


def all_ranks_ok(ok: bool) -> bool:
    """Collective: True iff every rank passed True (one all-reduce; True without a process group).

    Also the barrier where the other ranks wait while rank 0 alone writes an export or a checkpoint: the flag
    lives on the CPU whenever the group has a CPU side (gloo, or ``cpu:gloo,cuda:nccl``), so the wait happens in a
    host thread under the group's collective timeout (``resources.collective_timeout_s``), with nothing spinning
    on the NCCL stream (see ``dapo_core.engines.dist_setup``). A pure NCCL group falls back to a CUDA flag.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    device = barrier_device(str(dist.get_backend()))
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


# ------------------------------------------------------------------------------------- sharded checkpoints
def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Collective: every rank writes its shard of the model and optimizer state under ``path`` (DCP).

    Nothing is gathered: a 32B run's optimizer state never sits on one rank. An optimizer without state (no step
    taken yet) is left out, so a resumed fresh optimizer stays fresh.
    """
    if optimizer.state:
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL_KEY: model_state, _OPTIM_KEY: optim_state}
    else:
        state = {_MODEL_KEY: get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Collective: load what ``save_sharded`` wrote into ``model`` and ``optimizer`` in place (any world size)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no DCP checkpoint (no .metadata): write it with save_sharded")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    has_optim = any(key.startswith(f"{_OPTIM_KEY}.") for key in saved)
    if has_optim:
        model_state, optim_state = get_state_dict(model, optimizer)  # initialises empty optimizer state
        state: dict[str, Any] = {_MODEL_KEY: model_state, _OPTIM_KEY: optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state[_MODEL_KEY], optim_state_dict=state[_OPTIM_KEY])
    else:
        state = {_MODEL_KEY: get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state[_MODEL_KEY])
        optimizer.state.clear()


def save_fsdp_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    meta: dict[str, Any] | None = None,
    tokenizer: Any | None = None,
    max_to_keep: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Collective: ``<root>/step_<step>`` as ``checkpoint.save_checkpoint`` lays it out, plus ``shards/``.

    Rank 0 writes an ordinary HF directory from the gathered weights (cast to ``dtype``: the configured model
    dtype), so ``from_pretrained`` and ``model.path=<checkpoint>`` work as for a ddp checkpoint; the optimizer
    state is only ever written as shards. ``trainer_state`` is ``PolicyTrainer.state_dict()`` (no optimizer).
    """
    hf_model = gathered_hf_model(model, dtype=dtype)
    sharded = ShardedSave(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        write_shards=lambda shards: save_sharded(model, optimizer, shards),
        all_ok=all_ranks_ok,
    )
    return save_checkpoint(
        root,
        step,
        model=hf_model,
        trainer_state=trainer_state,
        meta=meta,
        tokenizer=tokenizer,
        max_to_keep=max_to_keep,
        sharded=sharded,
    )


def load_fsdp_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, restore_rng: bool = True
) -> LoadedCheckpoint:
    """Collective: weights and optimizer state from ``shards/`` (any world size), plus what ``load_checkpoint``
    reads (trainer state without the optimizer: pass it to ``PolicyTrainer.load_state_dict`` after this)."""
    loaded = load_checkpoint(path, restore_rng=restore_rng)
    load_sharded(model, optimizer, shards_dir(loaded.path))
    return loaded
