"""The streamed weight-update API of ``RolloutBackend`` (``begin_weight_update`` / ``load_weight_bucket`` /
``finish_weight_update``): the default implementation any backend inherits, on a recording backend and on ``hf``.
The ``vllm`` override is tested in tests/test_rollout_vllm.py (stand-in engine) and tests/test_vllm_cpu.py (real)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch
from torch import Tensor

from dapo_core.engines.rollout import SamplingConfig
from dapo_core.engines.rollout.base import RolloutBackend, RolloutResult, WeightSyncStats, cast_for_sync
from dapo_core.engines.rollout.vllm_worker import layer_group, plan_buckets


class Recording(RolloutBackend):
    """Records each ``update_weights`` call; ``dtype``: its ``sync_dtype``."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.updates: list[tuple[dict[str, Tensor], int]] = []

    @property
    def sync_dtype(self) -> torch.dtype | None:
        return self.dtype

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, *, prompt_index_offset: int = 0
    ) -> list[RolloutResult]:
        return []

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        self._check_weight_version(version)
        self.updates.append((dict(state_dict), version))
        self._weight_version = version


def _state() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.q.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.k.weight": torch.randn(4, 4, generator=g),
        "model.layers.1.q.weight": torch.randn(4, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "steps": torch.tensor([3]),  # not floating: never cast
    }


def test_the_default_collects_the_buckets_and_loads_them_once_at_finish() -> None:
    backend, state = Recording(), _state()
    assert backend.sync_dtype is None and backend.last_sync is None
    buckets = plan_buckets([(n, t.numel() * 4) for n, t in state.items()], 96, group=layer_group)
    assert len(buckets) >= 3
    backend.begin_weight_update(2)
    shipped = [backend.load_weight_bucket([(n, state[n]) for n in b]) for b in buckets]
    assert backend.updates == [] and backend.weight_update_in_progress  # nothing loaded before finish
    stats = backend.finish_weight_update(2)
    ((loaded, version),) = backend.updates
    assert (
        version == 2 and list(loaded) == list(state) and all(loaded[n].data_ptr() == state[n].data_ptr() for n in state)
    )  # no copy
    expected = WeightSyncStats(2, len(state), len(buckets), sum(t.numel() * t.element_size() for t in state.values()),
                               stats.seconds)  # fmt: skip
    assert stats == expected == backend.last_sync and sum(shipped) == stats.bytes and stats.seconds > 0
    assert backend.weight_version == 2 and not backend.weight_update_in_progress


def test_floats_are_shipped_in_the_sync_dtype() -> None:
    backend, state = Recording(torch.bfloat16), _state()
    backend.begin_weight_update(1)
    nbytes = backend.load_weight_bucket(list(state.items()))
    backend.finish_weight_update(1)
    ((loaded, _),) = backend.updates
    assert loaded["model.norm.weight"].dtype == torch.bfloat16 and loaded["steps"].dtype == torch.int64
    assert nbytes == sum(t.numel() * 2 for n, t in state.items() if n != "steps") + 8
    assert cast_for_sync(state["steps"], torch.bfloat16) is not state["steps"]  # detached view, same data
    assert torch.equal(cast_for_sync(state["steps"], torch.bfloat16), state["steps"])


def test_the_protocol_is_enforced() -> None:
    backend, state = Recording(), _state()
    with pytest.raises(RuntimeError, match="no weight update in progress: call begin_weight_update"):
        backend.load_weight_bucket(list(state.items()))
    backend.begin_weight_update(3)
    with pytest.raises(RuntimeError, match="version 3 is in progress"):
        backend.begin_weight_update(4)
    with pytest.raises(ValueError, match="empty bucket"):
        backend.load_weight_bucket([])
    backend.load_weight_bucket([("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(ValueError, match=r"\['model\.norm\.weight'\] already shipped"):
        backend.load_weight_bucket([("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(ValueError, match="does not match begin_weight_update"):
        backend.finish_weight_update(4)
    backend.abort_weight_update()
    assert not backend.weight_update_in_progress and backend.weight_version == 0 and backend.updates == []
    backend.update_weights(state, 5)
    with pytest.raises(ValueError, match="older than the loaded version 5"):
        backend.begin_weight_update(4)


def test_the_hf_backend_takes_a_streamed_update(tmp_path) -> None:
    from _tiny import tiny_model_dir

    from dapo_core.engines.models import load_model
    from dapo_core.engines.rollout import HFRolloutBackend
    from dapo_core.engines.tokenizer import load_tokenizer

    path = tiny_model_dir(tmp_path / "m")
    model, other = load_model(str(path), dtype="float32"), load_model(str(path), dtype="float32")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    backend = HFRolloutBackend(model, load_tokenizer(str(path)), micro_batch_size=4)
    assert backend.sync_dtype is None
    state = other.state_dict()
    buckets = plan_buckets([(n, t.numel() * 4) for n, t in state.items()], 4096, group=layer_group)
    backend.begin_weight_update(1)
    for bucket in buckets:
        backend.load_weight_bucket([(n, state[n]) for n in bucket])
    stats = backend.finish_weight_update(1)
    assert backend.weight_version == 1 and stats.buckets == len(buckets) and stats.tensors == len(state)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)
