"""Checkpoints: an HF model directory plus the trainer state, written atomically, loaded without pickle.

Layout of ``<root>/step_<N>/``::

    config.json, generation_config.json, model.safetensors   # an ordinary HF directory (from_pretrained loads it)
    tokenizer files                                           # when a tokenizer is given
    trainer_state.pt      # optimizer + scheduler state (tensors and plain containers only: weights_only=True)
    rng_state.pt          # python / numpy / torch RNG states as tensors and plain values
    trainer_state.json    # counters, data-sampler position, MLflow run id, anything JSON the caller adds, and
                          # write_s: the seconds this checkpoint took to write, up to this file
    shards/               # FSDP2 only: every rank's shard of the weights and optimizer state (torch DCP)
    COMPLETE              # written last, inside the temp dir, before the rename

The directory is assembled under ``<root>/.tmp-step_<N>-<pid>`` and renamed into place, so a crash never leaves a
half checkpoint where a resume would look; ``latest_checkpoint`` only returns directories with ``COMPLETE``.

FSDP2 ranks save together (``sharded=ShardedSave(...)``, called on every rank): every rank writes its shard under
``shards/`` (so no rank ever holds the whole optimizer state), rank 0 writes the rest (the HF files from the
gathered weights, ``trainer_state.pt`` without the optimizer, RNG, JSON, ``COMPLETE``) and renames. The temp
directory is ``.tmp-step_<N>-sharded`` (one name the ranks agree on); lookup, pruning and resume are unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dapo_core.faults import fault_point

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"
WRITE_S = "write_s"  # trainer_state.json: seconds from save_checkpoint's call to the JSON (on the writing rank)
SHARDS_DIR = "shards"


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    trainer_state: dict[str, Any]  # optimizer/scheduler (for PolicyTrainer.load_state_dict)
    meta: dict[str, Any]  # the JSON part


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


@dataclass(frozen=True)
class ShardedSave:
    """How the ranks of one FSDP2 group write a checkpoint together (see the module docstring).

    ``write_shards(dir)`` is collective (every rank writes its shard, e.g. ``fsdp.save_sharded``);
    ``all_ok(flag)`` is collective and True iff every rank passed True (e.g. ``fsdp.all_ranks_ok``).
    """

    rank: int
    write_shards: Callable[[Path], None]
    all_ok: Callable[[bool], bool]


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: nn.Module | None,
    trainer_state: dict[str, Any],
    meta: dict[str, Any] | None = None,
    tokenizer: Any | None = None,
    max_to_keep: int | None = None,
    sharded: ShardedSave | None = None,
) -> Path:
    """Write ``<root>/step_<step>`` atomically and prune older ones beyond ``max_to_keep``. Returns its path.

    With ``sharded`` every rank calls this; ``model`` (the gathered HF model, None elsewhere), ``tokenizer``,
    ``trainer_state`` and ``meta`` are only used on rank 0, and every rank returns once the checkpoint is complete.
    """
    started = time.perf_counter()
    root = Path(root)
    final = step_dir(root, step)

    def commit(tmp: Path) -> None:
        if model is None:
            raise ValueError("save_checkpoint needs the model on the writing rank (rank 0): got None")
        try:
            _write_and_commit(tmp, final, step, model, tokenizer, trainer_state, meta, started)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if max_to_keep is not None and max_to_keep > 0:
            prune_checkpoints(root, max_to_keep)

    if sharded is None:
        remove_stale_tmp(root)
        tmp = root / f".tmp-step_{step}-{os.getpid()}"
        _fresh_dir(tmp)
        commit(tmp)
        return final
    tmp = root / f".tmp-step_{step}-sharded"  # the ranks' pids differ: a name every rank can compute
    _on_rank0(sharded, lambda: _fresh_dir(tmp), f"prepare {tmp}")
    try:
        sharded.write_shards(tmp / SHARDS_DIR)  # collective: DCP fails on every rank together
    except BaseException:
        if sharded.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _on_rank0(sharded, lambda: commit(tmp), f"write {final}")
    return final


_TMP_DIR = re.compile(r"^\.tmp-step_\d+-(\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(root: str | Path) -> list[Path]:
    """Delete the half-written checkpoints (``.tmp-step_<n>-<pid>``) of processes that are gone (killed mid-write);
    they are never loaded (no ``step_<n>`` name, no COMPLETE marker), only disk wasted. Returns what was removed."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            m = _TMP_DIR.match(child.name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


def _fresh_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()


def _on_rank0(sharded: ShardedSave, work: Callable[[], None], what: str) -> None:
    """Run ``work`` on rank 0; every rank learns whether it failed (and raises too), so none waits in a later
    collective."""
    error: BaseException | None = None
    if sharded.rank == 0:
        try:
            work()
        except BaseException as exc:
            error = exc
    if not sharded.all_ok(error is None):
        if error is not None:
            raise error
        raise RuntimeError(f"checkpoint rank 0 failed to {what}; see rank 0's error")


def _write_and_commit(
    tmp: Path,
    final: Path,
    step: int,
    model: nn.Module,
    tokenizer: Any | None,
    trainer_state: dict[str, Any],
    meta: dict[str, Any] | None,
    started: float,
) -> None:
    """The HF files, trainer state, RNG, JSON (with the write time since ``started``, a perf_counter reading) and
    COMPLETE into ``tmp``, then rename it to ``final``."""
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
    fault_point("checkpoint", step)  # reliability tests: a kill with the weights written, the rest not
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    torch.save(capture_rng_state(), tmp / "rng_state.pt")
    meta_all = {"step": step, **(meta or {}), WRITE_S: time.perf_counter() - started}
    (tmp / "trainer_state.json").write_text(json.dumps(meta_all, indent=2, sort_keys=True))
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    if final.exists():  # re-saving a step (e.g. after a resume) replaces it whole
        old = final.parent / f".old-step_{step}-{os.getpid()}"
        final.rename(old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def shards_dir(path: str | Path) -> Path:
    """The FSDP2 shards of a complete checkpoint; a clear error for a checkpoint written without them."""
    shards = Path(path) / SHARDS_DIR
    if not shards.is_dir():
        raise FileNotFoundError(
            f"{path} has no {SHARDS_DIR}/ directory: it was written with trainer.strategy=ddp (full weights and "
            f"optimizer in one file). Resume it with trainer.strategy=ddp, or start a new fsdp2 run from its "
            f"weights with model.path={path}"
        )
    return shards


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def prune_checkpoints(root: str | Path, max_to_keep: int) -> list[Path]:
    """Delete all but the newest ``max_to_keep`` complete checkpoints; returns what was removed."""
    ckpts = list_checkpoints(root)
    removed = []
    for _, path in ckpts[: max(0, len(ckpts) - max_to_keep)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def load_checkpoint(path: str | Path, *, model: nn.Module | None = None, restore_rng: bool = True) -> LoadedCheckpoint:
    """Read a checkpoint written by ``save_checkpoint``. Loads weights into ``model`` in place when given.

    Nothing is unpickled: weights come from safetensors, the rest through ``torch.load(weights_only=True)``.
    """
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
            "use latest_checkpoint(<checkpoints dir>) to find the newest complete one"
        )
    if model is not None:
        from safetensors.torch import load_file

        weights = path / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing: the checkpoint has no single-file safetensors weights")
        state = load_file(str(weights))
        missing, unexpected = model.load_state_dict(state, strict=False)
        # tied embeddings: lm_head.weight is not stored separately
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
        tie_weights = getattr(model, "tie_weights", None)
        if callable(tie_weights):
            tie_weights()
    trainer_state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if restore_rng:
        restore_rng_state(torch.load(path / "rng_state.pt", map_location="cpu", weights_only=True))
    meta = read_meta(path)
    return LoadedCheckpoint(path=path, step=int(meta["step"]), trainer_state=trainer_state, meta=meta)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path`` (``step``, ``write_s`` and what the caller saved)."""
    return json.loads((Path(path) / "trainer_state.json").read_text())
