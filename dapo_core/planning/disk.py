"""Checkpoint bytes and disk over a run (``dapo_core.engines.checkpoint`` / ``fsdp.save_fsdp_checkpoint``).

Exact for the tensor payloads:

- HF files (``model.safetensors``): every stored parameter (a tied LM head is not stored) x ``model.dtype`` bytes,
  the dtype ``save_fsdp_checkpoint`` casts the gathered weights to (ddp saves the model as it is: model.dtype).
  The file adds a JSON header (8-byte length + the header, a few KB): not counted here; tests subtract it.
- fsdp2 shards (``shards/``, torch DCP): float32 master weights + AdamW's two float32 moments + step scalars.
- ddp ``trainer_state.pt``: the optimizer state (2 moments in model.dtype + step scalars) plus a small pickle.

Saves over a run: every ``save_freq`` steps and at the last step (flows/train.py); at most ``max_ckpt_to_keep`` stay
on disk (null: all). The final export (outputs/<run>/final, HF files) and its MLflow registered copy add two HF
copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo_core.planning.arch import DTYPE_BYTES, Arch, param_count, param_tensor_count

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

STEP_TENSOR_BYTES = 4


@dataclass(frozen=True)
class DiskFigures:
    hf_bytes: int  # model.safetensors tensor payload
    shard_bytes: int  # fsdp2 DCP shards (0 under ddp)
    optimizer_file_bytes: int  # ddp trainer_state.pt optimizer payload (0 under fsdp2)
    saves: int  # checkpoints written over the run
    kept: int  # checkpoints on disk at the end
    unbounded: bool  # max_ckpt_to_keep is null
    final_copies: int  # HF copies of the final model (export + MLflow registry)

    @property
    def per_checkpoint(self) -> int:
        return self.hf_bytes + self.shard_bytes + self.optimizer_file_bytes

    @property
    def run_total(self) -> int:
        """Disk at the end of the run: kept checkpoints + the final model's copies."""
        return self.kept * self.per_checkpoint + self.final_copies * self.hf_bytes


def hf_file_bytes(a: Arch, dtype: str) -> int:
    """Tensor bytes of the HF safetensors files in ``dtype`` (header excluded)."""
    return param_count(a) * DTYPE_BYTES[dtype]


def number_of_saves(total_steps: int, save_freq: int) -> int:
    """Checkpoints written: every save_freq steps (if > 0) plus the last step when it is not one of them."""
    if save_freq <= 0:
        return 1
    return total_steps // save_freq + (1 if total_steps % save_freq else 0)


def disk_figures(cfg: DapoConfig, a: Arch) -> DiskFigures:
    t = cfg.trainer
    p, steps = param_count(a), STEP_TENSOR_BYTES * param_tensor_count(a)
    fsdp = t.strategy == "fsdp2"
    shards = 3 * p * 4 + steps if fsdp else 0  # fp32 master + 2 fp32 moments (+ step scalars)
    optim_file = 0 if fsdp else 2 * p * DTYPE_BYTES[cfg.model.dtype] + steps
    saves = number_of_saves(t.total_steps, t.save_freq)
    kept = saves if t.max_ckpt_to_keep is None else min(saves, t.max_ckpt_to_keep)
    return DiskFigures(
        hf_bytes=hf_file_bytes(a, cfg.model.dtype),
        shard_bytes=shards,
        optimizer_file_bytes=optim_file,
        saves=saves,
        kept=kept,
        unbounded=t.max_ckpt_to_keep is None,
        final_copies=2,
    )
