"""Checkpoints: an HF model directory plus the trainer state, written atomically, loaded without pickle.

Layout of ``<root>/step_<N>/``::

    config.json, generation_config.json, model.safetensors   # an ordinary HF directory (from_pretrained loads it)
    tokenizer files                                           # when a tokenizer is given
    trainer_state.pt      # optimizer + scheduler state (tensors and plain containers only: weights_only=True)
    rng_state.pt          # python / numpy / torch RNG states as tensors and plain values
    trainer_state.json    # counters, data-sampler position, MLflow run id, anything JSON the caller adds
    COMPLETE              # written last, inside the temp dir, before the rename

The directory is assembled under ``<root>/.tmp-step_<N>-<pid>`` and renamed into place, so a crash never leaves a
half checkpoint where a resume would look; ``latest_checkpoint`` only returns directories with ``COMPLETE``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


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


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: nn.Module,
    trainer_state: dict[str, Any],
    meta: dict[str, Any] | None = None,
    tokenizer: Any | None = None,
    max_to_keep: int | None = None,
) -> Path:
    """Write ``<root>/step_<step>`` atomically and prune older ones beyond ``max_to_keep``. Returns its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        torch.save(capture_rng_state(), tmp / "rng_state.pt")
        meta_all = {"step": step, **(meta or {})}
        (tmp / "trainer_state.json").write_text(json.dumps(meta_all, indent=2, sort_keys=True))
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        if final.exists():  # re-saving a step (e.g. after a resume) replaces it whole
            old = root / f".old-step_{step}-{os.getpid()}"
            final.rename(old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if max_to_keep is not None and max_to_keep > 0:
        prune_checkpoints(root, max_to_keep)
    return final


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
    meta = json.loads((path / "trainer_state.json").read_text())
    return LoadedCheckpoint(path=path, step=int(meta["step"]), trainer_state=trainer_state, meta=meta)
