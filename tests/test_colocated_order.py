"""The order of a colocated step's memory phases, recorded (CPU; the GPU half is scripts/gpu_check.sh).

On a GPU shared by the trainer and a vLLM engine the step must run: update -> the trainer releases its cached
memory -> the engine wakes (weights, then KV cache) -> generate. Waking before the release finds the GPU full of
the trainer's cached peak. These tests record the calls of the real executors' code around a recording rollout
backend (LocalExecutor) and recording actor groups (RayExecutor: the controller's own code, without Ray), and
the start order of the groups (trainer settled before vLLM profiles its memory).
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from _tiny import plain_sampling, random_batch, tiny_model_dir

import dapo_core.distributed.executor as rex
import dapo_core.engines.executor as lex
from dapo_core.config import load_config
from dapo_core.distributed.executor import RayExecutor, TrainerWeights, staged_start, weight_sync_dtype
from dapo_core.engines.executor import LocalExecutor
from dapo_core.engines.memory import MemoryReport
from dapo_core.engines.rollout import RolloutResult, SamplingConfig
from dapo_core.engines.rollout.base import RolloutBackend, WeightSyncStats


class RecordingEngine(RolloutBackend):
    """A rollout backend that owns its engine (as vLLM) and records each memory phase into ``log``."""

    shares_policy_model = False

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self._weight_version = 0
        self.asleep = False

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, *, prompt_index_offset: int = 0
    ) -> list[RolloutResult]:
        if self.asleep:
            self.log.append("wake kv_cache")
            self.asleep = False
        self.log.append("generate")
        return []

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightSyncStats:
        if self.asleep:
            self.log.append("wake weights")
        self.log.append("load weights")
        self._weight_version = version
        return WeightSyncStats(version, len(state_dict), 1, 123, 0.0)

    def sleep(self) -> None:
        if not self.asleep:
            self.log.append("sleep")
        self.asleep = True


def _cfg(model_dir: Any, **sets: str) -> Any:
    extra = [f"{k}={v}" for k, v in sets.items()]
    return load_config(recipe="tiny-dapo", overrides=[f"model.path={model_dir}", *extra], env={})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "base")


def _recording_local(model_dir, monkeypatch) -> tuple[LocalExecutor, list[str]]:
    log: list[str] = []
    ex = LocalExecutor(_cfg(model_dir, **{"rollout.backend": "hf"}))
    ex.rollout = RecordingEngine(log)
    monkeypatch.setattr(lex, "release_cached_memory", lambda where: log.append(f"release {where}"))
    real_update = ex.trainer.update

    def update(*args, **kwargs):
        log.append("update")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(ex.trainer, "update", update)
    return ex, log


def _trained_batch(ex: LocalExecutor):
    batch = random_batch(0)
    batch.old_log_probs, _ = ex.compute_log_probs(batch)
    return batch


def test_local_colocated_step_releases_after_update_and_before_the_engine_wakes(model_dir, monkeypatch):
    ex, log = _recording_local(model_dir, monkeypatch)
    ex.update(_trained_batch(ex))
    assert ex.sync_weights() == 1
    ex.generate([[3, 4]], plain_sampling(n=2, max_new_tokens=2))
    assert log == ["sleep", "update", "release trainer", "wake weights", "load weights", "wake kv_cache", "generate"]
    assert ex.last_sync is not None and (ex.last_sync.version, ex.last_sync.bytes) == (1, 123)


def test_a_generate_after_training_without_a_sync_still_releases_first_and_only_once(model_dir, monkeypatch):
    ex, log = _recording_local(model_dir, monkeypatch)
    _trained_batch(ex)  # compute_log_probs: a training phase (the engine sleeps, the trainer allocates)
    ex.generate([[3, 4]], plain_sampling(n=1, max_new_tokens=2))
    ex.generate([[3, 4]], plain_sampling(n=1, max_new_tokens=2))
    assert log == ["sleep", "release trainer", "wake kv_cache", "generate", "generate"]


def test_a_rollout_sharing_the_trainer_module_releases_nothing(model_dir, monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(lex, "release_cached_memory", released.append)
    ex = LocalExecutor(_cfg(model_dir, **{"rollout.backend": "hf"}))
    batch = _trained_batch(ex)
    batch.advantages = torch.randn(batch.response_mask.shape[0])
    ex.update(batch)
    ex.sync_weights()
    assert released == [] and ex.last_sync is not None and ex.last_sync.bytes == 0


# ------------------------------------------------------------------------------------------ the Ray controller
class Recorder:
    """A stand-in actor group: every method call is appended to the shared log (with its keyword arguments)."""

    def __init__(self, name: str, log: list[str], answers: dict[str, Any] | None = None) -> None:
        self._name, self._log, self._answers = name, log, answers or {}

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            self._log.append(f"{self._name}.{method}" + (f" {kwargs}" if kwargs else ""))
            return self._answers.get(method)

        return call


def _ray_controller(cfg: Any, log: list[str]) -> RayExecutor:
    ex = RayExecutor.__new__(RayExecutor)  # the controller's code without a cluster
    stats = [{"version": 1, "tensors": 5, "buckets": 2, "bytes": 1000, "seconds": 0.1}]
    ex.cfg, ex._version, ex._source, ex._trainer_dirty, ex.last_sync = cfg, 0, None, False, None
    ex.trainers = Recorder("trainers", log, {"update": {}})
    ex.rollout = Recorder("rollout", log, {"stream_weights": stats, "generate": []})
    ex.rewards = Recorder("rewards", log)
    return ex


def test_ray_controller_releases_every_rank_after_the_update_before_streaming_weights(model_dir):
    cfg = _cfg(model_dir, **{"rollout.backend": "vllm", "resources.executor": "ray", "rollout.mode": "one_step_off"})
    log: list[str] = []
    ex = _ray_controller(cfg, log)
    batch = random_batch(0)
    batch.old_log_probs = torch.zeros(batch.response_mask.shape)
    batch.advantages = torch.zeros(batch.response_mask.shape[0])
    ex.update(batch)
    assert ex.sync_weights() == 1
    ex.generate([[3]], plain_sampling())
    timeout = cfg.resources.rollout_sleep_timeout_s
    assert log == [
        f"rollout.sleep {{'timeout_s': {timeout}}}",  # the sleep's own timeout, not the actor-start one
        "trainers.update",
        "trainers.release_memory",
        "rollout.stream_weights",
        "rollout.generate",
    ]
    assert isinstance(ex._source, TrainerWeights) and ex._source.dtype == "bfloat16"  # rollout.dtype, not fp32
    assert ex.last_sync is not None and (ex.last_sync.bytes, ex.last_sync.buckets) == (1000, 2)


def test_staged_start_only_where_trainer_and_vllm_share_gpus(model_dir):
    base = {"rollout.backend": "vllm", "resources.executor": "ray", "resources.n_gpus_per_node": "1"}
    assert staged_start(_cfg(model_dir, **base))
    assert not staged_start(_cfg(model_dir, **{**base, "resources.placement": "split"}))
    assert not staged_start(_cfg(model_dir, **{**base, "resources.n_gpus_per_node": "0"}))
    assert not staged_start(_cfg(model_dir, **{**base, "rollout.backend": "hf"}))


@pytest.mark.parametrize("placement", ["colocate", "split"])
def test_colocated_gpus_start_the_trainer_settled_before_vllm_profiles_its_memory(model_dir, monkeypatch, placement):
    log: list[str] = []

    def group(name: str):
        def make(*args, **kwargs):
            log.append(f"{name}.start")
            return Recorder(name, log)

        return make

    monkeypatch.setattr(rex, "TrainerGroup", group("trainers"))
    monkeypatch.setattr(rex, "RolloutGroup", group("rollout"))
    monkeypatch.setattr(rex, "RewardPool", group("rewards"))
    sets = {"rollout.backend": "vllm", "resources.executor": "ray", "resources.n_gpus_per_node": "1"}
    ex = RayExecutor.__new__(RayExecutor)
    ex.cfg, ex.options, ex.placement = (
        _cfg(model_dir, **sets, **{"resources.placement": placement}),
        rex.RayOptions(),
        object(),
    )
    ex._start_groups("model")
    trainer_side = ["trainers.start", "trainers.ready"]
    if placement == "colocate":  # trainer up, sharded and its cache released before vLLM starts
        assert log == [
            "rewards.start",
            *trainer_side,
            "trainers.release_memory",
            "rollout.start",
            "rollout.ready",
            "rewards.ready",
        ]
    else:  # separate GPUs: the engines load while the trainer ranks do
        assert log == [
            "rewards.start",
            "trainers.start",
            "rollout.start",
            "trainers.ready",
            "rollout.ready",
            "rewards.ready",
        ]


def test_weights_travel_in_the_rollout_dtype():
    vllm = types.SimpleNamespace(rollout=types.SimpleNamespace(backend="vllm", dtype="bfloat16"), model=None)
    assert weight_sync_dtype(vllm) == "bfloat16"  # the 32B recipe's masters are float32: half the bytes
    vllm.rollout.dtype = "auto"
    assert weight_sync_dtype(vllm) is None
    hf = types.SimpleNamespace(
        rollout=types.SimpleNamespace(backend="hf"), model=types.SimpleNamespace(dtype="float32")
    )
    assert weight_sync_dtype(hf) == "float32"


def test_memory_report_counts_what_was_released():
    report = MemoryReport("trainer", reserved_before=10, reserved_after=4, allocated=3)
    assert report.released == 6
