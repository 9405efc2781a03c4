"""The ``vllm`` rollout backend against a stand-in ``vllm`` module (CPU, fast).

vLLM cannot run here (CUDA-only). The stand-in records every call our backend makes -- ``LLM(**kwargs)``,
``SamplingParams(**kwargs)``, ``generate``, ``collective_rpc``, ``sleep``, ``wake_up``, ``reset_prefix_cache`` --
and answers with outputs shaped like vLLM 0.32's. It accepts only the argument names of the real API, refuses
tensors in ``collective_rpc`` arguments (vLLM's IPC does not rebuild them), refuses work while asleep, and runs
our worker extension on a worker whose "model" is the HF checkpoint. These tests check our side of the API;
tests/gpu/test_vllm_gpu.py checks a real engine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import itertools
import os
import pickle
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from _tiny import plain_sampling, random_batch, tiny_model_dir
from hypothesis import given
from hypothesis import strategies as st

import dapo_core.engines.rollout as rollout_pkg
from dapo_core.config import load_config
from dapo_core.engines.models import load_model
from dapo_core.engines.rollout import FINISH_LENGTH, FINISH_STOP, base
from dapo_core.engines.rollout.vllm_worker import (
    WORKER_EXTENSION_CLS,
    WeightSyncWorkerExtension,
    decode_bucket,
    encode_bucket,
    plan_buckets,
)
from dapo_core.engines.tokenizer import load_tokenizer

BACKEND_MODULE = "dapo_core.engines.rollout.vllm"
EOS = 1  # the char tokenizer's EOS id (tests/_tiny.tiny_model_dir)

# ---------------------------------------------------------------------------------------------- the stand-in

# EngineArgs names this backend may pass (checked against the v0.32 engine-args docs)
ENGINE_ARGS = {
    "model", "tokenizer", "revision", "tokenizer_revision", "trust_remote_code", "dtype", "tensor_parallel_size",
    "gpu_memory_utilization", "enable_chunked_prefill", "max_num_batched_tokens", "max_model_len",
    "enable_prefix_caching", "enforce_eager", "enable_sleep_mode", "seed", "logprobs_mode", "worker_extension_cls",
    "distributed_executor_backend", "weight_transfer_config",
}  # fmt: skip


class FakeSamplingParams:
    """vllm.SamplingParams: only the real argument names, vLLM's own validation."""

    def __init__(
        self, *, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, seed=None, logprobs=None,
        skip_special_tokens=True, stop_token_ids=None,
    ) -> None:  # fmt: skip
        if temperature < 0 or not 0 < top_p <= 1 or top_k < -1 or max_tokens < 1 or n < 1:
            raise ValueError("invalid sampling parameters")
        if seed is not None and not 0 <= seed < 2**63 - n:
            raise ValueError(f"seed {seed} + sample index must fit an int64")
        self.kwargs = dict(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
            logprobs=logprobs, skip_special_tokens=skip_special_tokens, stop_token_ids=stop_token_ids,
        )  # fmt: skip
        self.__dict__.update(self.kwargs)


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:  # vllm.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:  # vllm.RequestOutput
    prompt_token_ids: list[int]
    outputs: list[Completion]


class FakeVllmModel:
    """The worker's model: the HF checkpoint, loaded through a ``load_weights`` that records what it gets."""

    def __init__(self, path: str) -> None:
        self.hf = load_model(path, dtype="float32")
        self.received: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def parameters(self):
        return self.hf.parameters()

    def named_parameters(self):
        return self.hf.named_parameters()

    def load_weights(self, weights):
        own = dict(self.hf.named_parameters())
        loaded = set()
        if getattr(self, "reloading", False):
            assert FakeReload.current is not None, "loads run inside set_current_vllm_config"
        for name, tensor in weights:
            self.received.append((name, tuple(tensor.shape), tensor.dtype))
            if name == "lm_head.weight" and self.hf.config.tie_word_embeddings:
                continue  # as vLLM: lm_head is the embedding when tied
            with torch.no_grad():
                own[name].copy_(tensor)  # KeyError for a name the model does not have, as vLLM
            loaded.add(name)
        if getattr(self, "reloading", False):
            self.reloaded |= loaded
        return loaded


class FakeModelRunner:
    """vLLM 0.32's runner: ``reload_weights`` loads checkpoint-format weights in place and reports no names."""

    def __init__(self, path: str) -> None:
        self.model = FakeVllmModel(path)
        self.reloads = 0
        self.resets: list[str] = []

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        assert FakeReload.current is not None, "vLLM 0.32: Worker.reload_weights sets the current vLLM config"
        assert is_checkpoint_format and weights_iterator is not None and weights_path is None
        self.reloads += 1
        self.model.load_weights(list(weights_iterator))

    def reset_encoder_cache(self) -> None:
        self.resets.append("encoder")

    def reset_mm_cache(self) -> None:
        self.resets.append("mm")


class FakeReload:
    """vLLM 0.32's layerwise reload (``model_loader.reload``) and ``vllm.config.set_current_vllm_config``: records
    the calls; ``finalize`` reports the layers that received nothing, as vLLM's "Failed to load weights" warning."""

    current: Any = None
    calls: ClassVar[list[tuple[Any, ...]]] = []

    @staticmethod
    @contextlib.contextmanager
    def set_current_vllm_config(config):
        previous, FakeReload.current = FakeReload.current, config
        try:
            yield
        finally:
            FakeReload.current = previous

    @staticmethod
    def initialize_layerwise_reload(model) -> None:
        assert FakeReload.current is not None and not getattr(model, "reloading", False)
        model.reloading, model.reloaded = True, set()
        FakeReload.calls.append(("initialize",))

    @staticmethod
    def finalize_layerwise_reload(model, model_config) -> None:
        assert FakeReload.current is not None and model_config == "model-config"
        if getattr(model, "reloading", False):
            layers = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters()}
            unloaded = sorted(layers - {n.rsplit(".", 1)[0] for n in model.reloaded})
            FakeReload.calls.append(("finalize", unloaded))
        model.reloading = False


class FakeWorkerBase:
    def __init__(self, path: str) -> None:
        self.model_runner = FakeModelRunner(path)
        self.vllm_config = types.SimpleNamespace(model_config="model-config", lora_config=None)

    def reload_weights(self, *args, **kwargs) -> None:  # vLLM 0.32's Worker.reload_weights
        with FakeReload.set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(*args, **kwargs)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool, bytes))


class FakeLLM:
    """vllm.LLM: records calls in ``self.calls``; deterministic outputs that depend only on each request's seed."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"not an engine argument of this stand-in: {sorted(unknown)}")
        self.kwargs = kwargs
        self.calls: list[tuple[Any, ...]] = [("LLM",)]
        module, _, name = kwargs["worker_extension_cls"].rpartition(".")
        extension = getattr(importlib.import_module(module), name)  # as vLLM: import the dotted path
        worker_cls = type("Worker", (FakeWorkerBase, extension), {})
        self.workers = [worker_cls(kwargs["model"]) for _ in range(kwargs.get("tensor_parallel_size", 1))]
        self.asleep: set[str] = set()
        self.scripted: list[RequestOutput] | None = None  # next generate returns these
        FakeLLM.instances.append(self)

    instances: ClassVar[list[FakeLLM]] = []

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        self.calls.append(("generate", len(prompts), use_tqdm))
        assert len(sampling_params) == len(prompts)
        if self.scripted is not None:
            out, self.scripted = self.scripted, None
            return out
        return [self._answer(p["prompt_token_ids"], sp) for p, sp in zip(prompts, sampling_params, strict=True)]

    @staticmethod
    def _answer(prompt: list[int], sp: FakeSamplingParams) -> RequestOutput:
        outs = []
        eos = (sp.stop_token_ids or [EOS])[0]
        for j in range(sp.n):
            rng = random.Random(0 if sp.temperature == 0 else sp.seed + j)  # vLLM: child j gets seed + j
            length = rng.randint(1, sp.max_tokens + 2)
            if length <= sp.max_tokens:
                ids, reason = [rng.randint(3, 40) for _ in range(length - 1)] + [eos], "stop"
            else:
                ids, reason = [rng.randint(3, 40) for _ in range(sp.max_tokens)], "length"
            lps = [{t: Logprob(-0.01 * (k + 1) - j)} for k, t in enumerate(ids)] if sp.logprobs is not None else None
            outs.append(Completion(j, "".join(chr(94 + t) for t in ids if t != eos), ids, lps, reason))
        return RequestOutput(list(prompt), outs[::-1])  # samples out of order: the backend sorts by index

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if "weights" in self.asleep:
            raise RuntimeError("collective_rpc on sleeping weights")
        if not _plain(args) or not _plain(kwargs or {}):
            raise TypeError("collective_rpc arguments must be plain values (vLLM's IPC does not rebuild tensors)")
        args = pickle.loads(pickle.dumps(args))  # it crosses a process boundary
        self.calls.append(("collective_rpc", method, args))
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def sleep(self, level=1):
        assert self.kwargs["enable_sleep_mode"], "sleep needs enable_sleep_mode=True"
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def names(self) -> list[str]:
        return [c[0] if c[0] != "collective_rpc" else f"rpc:{c[1]}" for c in self.calls]


@dataclass
class Stand:
    vllm: types.ModuleType
    backend: types.ModuleType  # dapo_core.engines.rollout.vllm
    cls: type
    llms: list[FakeLLM] = field(default_factory=list)


@pytest.fixture
def stand(monkeypatch):
    """A stand-in ``vllm`` in sys.modules (with a spec, so find_spec sees it) and a GPU; all undone after."""
    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", loader=None)
    fake.LLM = FakeLLM
    fake.SamplingParams = FakeSamplingParams
    platforms = types.ModuleType("vllm.platforms")  # a CUDA platform with sleep mode, as vLLM's GPU build
    platforms.current_platform = types.SimpleNamespace(device_type="cuda", is_sleep_mode_available=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    config = types.ModuleType("vllm.config")  # the layerwise reload API the worker extension uses
    config.set_current_vllm_config = FakeReload.set_current_vllm_config
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = FakeReload.initialize_layerwise_reload
    reload.finalize_layerwise_reload = FakeReload.finalize_layerwise_reload
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, reload.__name__, reload)
    monkeypatch.setattr(FakeReload, "calls", [])
    monkeypatch.setattr(base, "_ROLLOUT_BACKENDS", dict(base._ROLLOUT_BACKENDS))  # registration is undone
    sys.modules.pop(BACKEND_MODULE, None)
    FakeLLM.instances = []
    cls = base.get_rollout_backend_cls("vllm")
    module = sys.modules[BACKEND_MODULE]
    monkeypatch.setattr(module, "cuda_available", lambda: True)
    assert importlib.util.find_spec("vllm") is fake.__spec__
    yield Stand(fake, module, cls, FakeLLM.instances)
    for backend in list(FakeLLM.instances):
        backend.workers.clear()
    sys.modules.pop(BACKEND_MODULE, None)
    if hasattr(rollout_pkg, "vllm"):
        delattr(rollout_pkg, "vllm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "base")


def make_cfg(model_dir, **extra):
    sets = [
        f"model.path={model_dir}",
        "rollout.backend=vllm",
        "resources.n_gpus_per_node=1",
        "rollout.tensor_parallel_size=1",
        "trainer.device=cpu",
        "rollout.n=3",
        "data.max_prompt_length=24",
        "data.max_response_length=12",
        "algorithm.overlong.buffer_length=4",
        "data.train_batch_size=4",
        "data.gen_batch_size=4",
        "trainer.ppo_mini_batch_size=2",
        "trainer.seed=7",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(recipe="tiny-dapo", overrides=sets, env={})


def make_backend(stand, model_dir, **extra):
    cfg = make_cfg(model_dir, **extra)
    tok = load_tokenizer(str(model_dir))
    return stand.cls.from_config(cfg, model=None, tokenizer=tok, model_path=str(model_dir)), cfg


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]

# ---------------------------------------------------------------------------------------------- construction


def test_engine_is_built_with_the_configured_arguments(stand, model_dir) -> None:
    backend, _ = make_backend(
        stand, model_dir, **{"rollout.gpu_memory_utilization": 0.6, "rollout.enforce_eager": "true"}
    )
    assert not backend.shares_policy_model
    assert stand.llms[0].kwargs == {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "revision": None,
        "tokenizer_revision": None,
        "trust_remote_code": False,
        "dtype": "bfloat16",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 96,
        "max_model_len": 24 + 12,  # max_prompt_length + max new tokens (= max_response_length)
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "enable_sleep_mode": True,  # free_cache_engine
        "seed": 7,
        "logprobs_mode": "raw_logprobs",
        "worker_extension_cls": "dapo_core.engines.rollout.vllm_worker.WeightSyncWorkerExtension",
    }
    assert isinstance(stand.llms[0].workers[0], WeightSyncWorkerExtension)
    assert backend.eos_token_ids == [EOS] and backend.tie_word_embeddings is True


def test_explicit_max_model_len_and_tokenizer_path_win(stand, model_dir) -> None:
    make_backend(stand, model_dir, **{"rollout.max_model_len": 64, "model.tokenizer_path": str(model_dir) + "/"})
    kwargs = stand.llms[0].kwargs
    assert kwargs["max_model_len"] == 64 and kwargs["tokenizer"] == str(model_dir) + "/"


def test_a_platform_that_is_neither_cuda_nor_cpu_is_refused_with_the_fix(stand, model_dir, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules["vllm.platforms"].current_platform, "device_type", "tpu")
    with pytest.raises(RuntimeError, match=r"neither a CUDA GPU nor the CPU \(platform 'tpu'.*rollout\.backend=hf"):
        make_backend(stand, model_dir)
    assert stand.llms == []  # no engine was started


def test_on_the_cpu_build_chunked_prefill_and_sleep_are_off(stand, model_dir, monkeypatch) -> None:
    platform = sys.modules["vllm.platforms"].current_platform
    monkeypatch.setattr(platform, "device_type", "cpu")
    monkeypatch.setattr(platform, "is_sleep_mode_available", lambda: False)
    backend, _ = make_backend(stand, model_dir)
    kwargs = stand.llms[0].kwargs
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enable_sleep_mode"] is False
    assert kwargs["max_num_batched_tokens"] >= max(kwargs["max_model_len"], stand.backend.CPU_MIN_BATCHED_TOKENS)
    backend.sleep()  # a no-op, not an error
    assert not backend.is_asleep and stand.llms[0].names() == ["LLM"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_backend_says_how_to_install() -> None:
    with pytest.raises(ImportError, match=r"pip install \.\[gpu\].*GPU"):
        base.get_rollout_backend_cls("vllm")


def test_sleeping_needs_sleep_mode(stand, model_dir) -> None:
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        stand.cls({"enable_sleep_mode": False}, free_cache_engine=True)


# ---------------------------------------------------------------------------------------------- sampling


def test_sampling_parameters_map_one_to_one(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    sampling = plain_sampling(
        n=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7, seed=11, return_log_probs=True
    )
    params = [backend.sampling_params(sampling, i).kwargs for i in range(4)]
    assert params[2] == {
        "n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 7,
        "seed": stand.backend.prompt_seed(11, 2), "logprobs": 0, "skip_special_tokens": True, "stop_token_ids": [EOS],
    }  # fmt: skip
    assert len({p["seed"] for p in params}) == 4  # one stream per prompt
    assert all(0 <= p["seed"] < 2**62 for p in params)
    greedy = backend.sampling_params(plain_sampling(temperature=0.0, top_k=-1, max_new_tokens=4), 0).kwargs
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["logprobs"] is None


def test_two_shards_give_exactly_the_rows_of_one_call(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    sampling = plain_sampling(n=3, max_new_tokens=6, seed=5, return_log_probs=True)
    whole = backend.generate(PROMPTS, sampling)
    shards = backend.generate(PROMPTS[:1], sampling) + backend.generate(PROMPTS[1:], sampling, prompt_index_offset=1)
    assert shards == whole
    assert [(r.prompt_index, r.sample_index) for r in whole] == [(i, j) for i in range(4) for j in range(3)]
    assert backend.generate(PROMPTS, plain_sampling(n=3, max_new_tokens=6, seed=6)) != whole  # seed matters
    assert ("generate", 4, False) in stand.llms[0].calls  # use_tqdm=False


def test_outputs_become_the_shared_record(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    results = backend.generate(PROMPTS, plain_sampling(n=4, max_new_tokens=5, seed=3, return_log_probs=True))
    reasons = {r.finish_reason for r in results}
    assert reasons == {FINISH_STOP, FINISH_LENGTH}  # the canned engine produces both
    for r in results:
        assert r.prompt_ids == PROMPTS[r.prompt_index]
        assert r.response_length == len(r.response_ids) == len(r.log_probs) <= 5
        assert r.log_probs == pytest.approx([-0.01 * (k + 1) - r.sample_index for k in range(r.response_length)])
        if r.finish_reason == FINISH_STOP:
            assert r.response_ids[-1] == EOS and not r.truncated  # EOS kept
        else:
            assert EOS not in r.response_ids and r.truncated and r.response_length == 5
        # text: the run's tokenizer decodes the ids, as the hf backend does
        assert r.text == backend.tokenizer.decode(r.response_ids, skip_special_tokens=True)
    assert all(r.log_probs is None for r in backend.generate(PROMPTS, plain_sampling(n=2, max_new_tokens=5)))
    backend.tokenizer = None  # no tokenizer: vLLM's own detokenisation
    for r in backend.generate(PROMPTS, plain_sampling(n=2, max_new_tokens=5)):
        assert r.text == "".join(chr(94 + t) for t in r.response_ids if t != EOS)


def test_eos_on_the_last_allowed_token_is_a_stop(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    stand.llms[0].scripted = [RequestOutput([5, 6, 7], [Completion(0, "ab", [3, 4, EOS], None, "length")])]
    (r,) = backend.generate([[5, 6, 7]], plain_sampling(n=1, max_new_tokens=3))
    assert r.finish_reason == FINISH_STOP and not r.truncated and r.response_ids == [3, 4, EOS]


@pytest.mark.parametrize(
    ("completion", "match"),
    [
        (Completion(0, "", [3, 4], None, "abort"), "finish_reason 'abort'"),
        (Completion(0, "", [3, 4], [{3: Logprob(-1.0)}], "length"), "1 log-prob entries for the 2 tokens"),
        (Completion(0, "", [3, 4], [{3: Logprob(-1.0)}, {9: Logprob(-1.0)}], "length"), "lack the sampled token 4"),
        (Completion(1, "", [3, 4], None, "length"), r"samples \[1\]"),
    ],
)
def test_malformed_engine_outputs_are_refused(stand, model_dir, completion, match) -> None:
    backend, _ = make_backend(stand, model_dir)
    stand.llms[0].scripted = [RequestOutput([5], [completion])]
    with pytest.raises(RuntimeError, match=match):
        backend.generate([[5]], plain_sampling(n=1, max_new_tokens=2, return_log_probs=True))


def test_bad_prompts_are_refused_before_the_engine_runs(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[5], []], plain_sampling())
    with pytest.raises(ValueError, match="prompt_index_offset"):
        backend.generate([[5]], plain_sampling(), prompt_index_offset=-1)
    assert backend.generate([], plain_sampling()) == []
    assert "generate" not in stand.llms[0].names()


# ---------------------------------------------------------------------------------------------- weight sync


def perturbed_policy(model_dir, seed=1):
    policy = load_model(str(model_dir), dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def engine_params(llm: FakeLLM, rank: int = 0) -> dict[str, torch.Tensor]:
    return dict(llm.workers[rank].model_runner.model.hf.state_dict())


def test_weights_go_through_load_weights_with_hf_names_and_shapes_in_buckets(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir, **{"rollout.tensor_parallel_size": 2, "resources.n_gpus_per_node": 2})
    backend.weight_sync_bucket_bytes = 4096  # the tiny model's tensors: 160 B .. 5 KiB in bf16
    llm = stand.llms[0]
    policy = perturbed_policy(model_dir)
    state = policy.state_dict()
    stats = backend.update_weights(state, version=1)

    rpcs = [c for c in llm.calls if c[0] == "collective_rpc" and c[1] == "dapo_load_weights"]
    buckets = [c[2][0] for c in rpcs]
    assert len(buckets) > 1
    layer = stand.backend.layer_group
    for bucket in buckets:  # within the limit, or one decoder layer that is bigger than the limit on its own
        assert sum(len(e[3]) for e in bucket) <= 4096 or len({layer(e[0]) for e in bucket}) == 1
    for a, b in itertools.pairwise(buckets):  # no decoder layer is split: vLLM processes a layer per reload
        assert layer(a[-1][0]) == "" or layer(a[-1][0]) != layer(b[0][0])
    shipped = [e[0] for b in buckets for e in b]
    assert shipped == list(state)  # in order; the tied lm_head too (a reload without it leaves the head stale)
    # ONE layerwise reload per sync on each worker (not one per bucket), and no layer left unloaded
    assert FakeReload.calls == [("initialize",)] * 2 + [("finalize", [])] * 2
    assert all(w.model_runner.reloads == 0 and w.model_runner.resets == ["encoder", "mm"] for w in llm.workers)
    syncs = [n for n in llm.names() if n.startswith("rpc:")]
    assert syncs == ["rpc:dapo_begin_reload", *["rpc:dapo_load_weights"] * len(buckets), "rpc:dapo_finish_reload",
                     "rpc:dapo_release_memory"]  # fmt: skip
    assert stats == backend.last_sync and (stats.version, stats.tensors, stats.buckets) == (1, len(state), len(buckets))
    assert stats.bytes == sum(v.numel() * 2 for v in state.values()) and stats.seconds > 0  # bf16 on the wire
    for rank in (0, 1):  # every tensor-parallel worker got every bucket
        received = llm.workers[rank].model_runner.model.received
        assert [(n, s) for n, s, _ in received] == [(k, tuple(state[k].shape)) for k in shipped]
        assert {d for _, _, d in received} == {torch.bfloat16}  # cast to rollout.dtype before shipping
        for name, value in engine_params(llm, rank).items():
            torch.testing.assert_close(value, state[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    # stale KV of the old weights is dropped after loading, then the sync's staging memory is released
    assert llm.names()[-2:] == ["reset_prefix_cache", "rpc:dapo_release_memory"]
    assert backend.weight_version == 1


def test_lm_head_is_required_when_untied_and_shipped_when_unknown(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    state = dict(perturbed_policy(model_dir).state_dict())
    backend.tie_word_embeddings = None
    backend.update_weights(state, version=1)
    received = [n for n, _, _ in stand.llms[0].workers[0].model_runner.model.received]
    assert "lm_head.weight" in received
    backend.tie_word_embeddings = False
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"lm_head\.weight.*not tied"):
        backend.update_weights(state, version=2)


def test_a_partial_state_dict_is_refused(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    state = dict(perturbed_policy(model_dir).state_dict())
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"leave 1 checkpoint tensor\(s\) unwritten.*down_proj"):
        backend.update_weights(state, version=1)
    assert backend.weight_version == 0
    assert not [c for c in stand.llms[0].calls if c[0] == "collective_rpc"]  # refused before shipping anything


def test_stale_versions_are_refused_before_anything_is_shipped(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    state = perturbed_policy(model_dir).state_dict()
    backend.update_weights(state, version=3)
    calls = len(stand.llms[0].calls)
    with pytest.raises(ValueError, match="older than the loaded version 3"):
        backend.update_weights(state, version=2)
    assert len(stand.llms[0].calls) == calls and backend.weight_version == 3
    backend.update_weights(state, version=3)  # same version again: allowed (a re-sync)
    with pytest.raises(RuntimeError, match="update_weights"):
        backend.mark_in_sync(4)  # it holds its own copy: a version bump alone would be a lie


# ---------------------------------------------------------------------------------------------- sleep / wake


def test_sleep_and_wake_sequencing(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    llm = stand.llms[0]
    sampling = plain_sampling(n=1, max_new_tokens=3)
    backend.sleep()
    backend.sleep()  # idempotent
    assert llm.names().count("sleep") == 1 and llm.calls[-1] == ("sleep", 1) and backend.is_asleep
    backend.generate(PROMPTS, sampling)  # generate wakes everything first
    assert llm.calls[-2:] == [("wake_up", None), ("generate", 4, False)] and not backend.is_asleep

    backend.sleep()
    backend.update_weights(perturbed_policy(model_dir).state_dict(), version=1)  # weights only, KV stays freed
    wake = llm.calls.index(("wake_up", ["weights"]))
    assert llm.names()[wake + 1] == "rpc:dapo_begin_reload" and llm.asleep == {"kv_cache"} and backend.is_asleep
    backend.generate(PROMPTS, sampling)
    assert llm.calls[-2:] == [("wake_up", ["kv_cache"]), ("generate", 4, False)] and llm.asleep == set()

    before = len(llm.calls)
    backend.wake_up()  # awake already: nothing to do
    backend.update_weights(perturbed_policy(model_dir, seed=2).state_dict(), version=2)
    assert "wake_up" not in llm.names()[before:]


def test_without_free_cache_engine_sleep_is_a_no_op(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir, **{"rollout.free_cache_engine": "false"})
    assert stand.llms[0].kwargs["enable_sleep_mode"] is False
    backend.sleep()
    assert "sleep" not in stand.llms[0].names() and not backend.is_asleep


def test_shutdown_releases_the_engine(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    backend.shutdown()
    backend.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        backend.generate(PROMPTS, plain_sampling())


# ---------------------------------------------------------------------------------------------- executors


def test_local_executor_sleeps_before_training_and_pushes_weights_on_sync(stand, model_dir, tmp_path) -> None:
    from dapo_core.engines.executor import LocalExecutor

    ex = LocalExecutor(make_cfg(model_dir))
    llm = stand.llms[0]
    assert isinstance(ex.rollout, stand.cls) and ex.rollout.weight_version == 0
    results = ex.generate(PROMPTS, plain_sampling(n=2, max_new_tokens=4))
    assert len(results) == 8

    trained = []
    ex.trainer.compute_log_probs = lambda *a, **k: trained.append(("log_probs", ex.rollout.is_asleep)) or (None, None)
    ex.trainer.update = lambda *a, **k: trained.append(("update", ex.rollout.is_asleep)) or {}
    batch = random_batch(0)
    ex.compute_log_probs(batch)
    ex.update(batch)
    assert trained == [("log_probs", True), ("update", True)]  # the engine slept before each training phase
    assert llm.names().count("sleep") == 1

    with torch.no_grad():
        for p in ex.model.parameters():
            p.add_(0.01)  # what an optimizer step does
    assert ex.sync_weights() == 1 and ex.rollout.weight_version == 1
    for name, value in engine_params(llm).items():
        torch.testing.assert_close(value, ex.model.state_dict()[name].to(torch.bfloat16).float(), rtol=0, atol=0)

    path = ex.save_checkpoint(tmp_path / "ckpts", 1, {})
    again = LocalExecutor(make_cfg(model_dir))
    again.load_checkpoint(path)  # the loaded weights reach the new engine with the checkpoint's version
    assert again.rollout.weight_version == 1
    for name, value in engine_params(stand.llms[1]).items():
        torch.testing.assert_close(value, ex.model.state_dict()[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    ex.shutdown()
    assert ex.rollout.llm is None


def test_a_vllm_rollout_worker_loads_no_hf_model(stand, model_dir, monkeypatch) -> None:
    from dapo_core.distributed import rollout_group

    def no_hf_copy(*args, **kwargs):
        raise AssertionError("a vllm rollout worker must not load an HF model copy")

    monkeypatch.setattr(rollout_group, "load_model", no_hf_copy)
    worker = rollout_group.RolloutWorker(make_cfg(model_dir), str(model_dir), threads=1)
    assert isinstance(worker.backend, stand.cls)
    worker.sleep()
    assert stand.llms[0].names()[-1] == "sleep"
    worker.update_weights(perturbed_policy(model_dir).state_dict(), 1)
    assert worker.weight_version() == 1


@pytest.mark.parametrize(
    ("placement", "free", "sleeps"), [("colocate", True, 1), ("split", True, 0), ("colocate", False, 0)]
)
def test_ray_executor_sleeps_colocated_engines_only(model_dir, placement, free, sleeps) -> None:
    from dapo_core.distributed.executor import RayExecutor

    cfg = make_cfg(model_dir, **{"resources.placement": placement, "rollout.free_cache_engine": str(free).lower()})
    group = types.SimpleNamespace(calls=0)
    group.sleep = lambda **kw: setattr(group, "calls", group.calls + 1)  # kw: the timeout the executor passes
    ex = types.SimpleNamespace(cfg=cfg, _groups=lambda: (None, group, None))
    RayExecutor._free_rollout_memory(ex)  # type: ignore[arg-type]
    assert group.calls == sleeps


# ---------------------------------------------------------------------------------------------- buckets


@given(sizes=st.lists(st.integers(0, 50), max_size=30), limit=st.integers(1, 60))
def test_buckets_keep_order_and_respect_the_limit(sizes, limit) -> None:
    named = [(f"w{i}", s) for i, s in enumerate(sizes)]
    buckets = plan_buckets(named, limit)
    assert [n for b in buckets for n in b] == [n for n, _ in named]
    size = dict(named)
    for k, bucket in enumerate(buckets):
        total = sum(size[n] for n in bucket)
        assert bucket and (total <= limit or len(bucket) == 1)
        if k + 1 < len(buckets):  # greedy: the next tensor did not fit
            assert total + size[buckets[k + 1][0]] > limit


def test_bucket_encoding_round_trips_dtypes_and_shapes() -> None:
    tensors = [
        ("a", torch.randn(3, 4, dtype=torch.bfloat16)),
        ("b", torch.randn(5)),
        ("c", torch.arange(6).reshape(2, 3)),
        ("d", torch.tensor([True, False])),
        ("e", torch.tensor(2.5, dtype=torch.float16)),
        ("f", torch.zeros(0, 3)),
        ("g", torch.randn(4, 4).t()),  # not contiguous
    ]
    bucket = encode_bucket(tensors)
    assert _plain(bucket)
    decoded = decode_bucket(pickle.loads(pickle.dumps([list(e) for e in bucket])))  # tuples may come back as lists
    for (name, t), (name2, t2) in zip(tensors, decoded, strict=True):
        assert name == name2 and t2.dtype == t.dtype and t2.shape == t.shape
        assert torch.equal(t2, t)
    assert WORKER_EXTENSION_CLS.endswith(".WeightSyncWorkerExtension")


def test_ray_worker_of_a_tensor_parallel_engine_hands_its_bundles_to_vllm(stand, model_dir, monkeypatch) -> None:
    from dapo_core.distributed.rollout_group import RolloutWorker

    for key in ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"):
        monkeypatch.delenv(key, raising=False)  # registered: teardown undoes what the worker sets
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cfg = make_cfg(model_dir, **{"resources.n_gpus_per_node": 4, "rollout.tensor_parallel_size": 2})
    worker = RolloutWorker(cfg, str(model_dir), 1, engine_bundles=[2, 3], engine_gpu_share=0.5)
    kwargs = stand.llms[-1].kwargs
    assert kwargs["distributed_executor_backend"] == "ray" and kwargs["tensor_parallel_size"] == 2
    assert os.environ["VLLM_RAY_BUNDLE_INDICES"] == "2,3" and os.environ["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the driver actor holds no GPU; vLLM's workers do
    assert worker.weight_version() == 0
    single = RolloutWorker(make_cfg(model_dir), str(model_dir), 1)  # TP 1: vLLM runs in the actor's process
    assert "distributed_executor_backend" not in stand.llms[-1].kwargs and single.weight_version() == 0


# ---------------------------------------------------------------------------------------------- streamed weight sync


def test_streamed_buckets_make_one_reload_and_report_bytes_and_seconds(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    llm = stand.llms[0]
    state = perturbed_policy(model_dir).state_dict()  # fp32 masters
    assert backend.sync_dtype == torch.bfloat16  # rollout.dtype: what the trainer should ship
    names = list(state)
    parts = [names[:3], names[3:9], names[9:]]
    backend.begin_weight_update(4)
    shipped = [backend.load_weight_bucket([(n, state[n]) for n in part]) for part in parts]
    assert shipped == [sum(state[n].numel() * 2 for n in part) for part in parts]  # cast to bf16 before shipping
    with pytest.raises(RuntimeError, match="weight update to version 4 is in progress"):
        backend.generate(PROMPTS, plain_sampling())  # the parameters are being replaced
    with pytest.raises(ValueError, match="does not match begin_weight_update"):
        backend.finish_weight_update(5)
    stats = backend.finish_weight_update(4)
    assert stats == backend.last_sync and isinstance(stats, base.WeightSyncStats)
    assert (stats.version, stats.tensors, stats.buckets, stats.bytes) == (4, len(names), 3, sum(shipped))
    assert stats.seconds > 0 and backend.weight_version == 4
    assert FakeReload.calls == [("initialize",), ("finalize", [])]  # once per sync, not once per bucket
    for name, value in engine_params(llm).items():
        torch.testing.assert_close(value, state[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert len(backend.generate(PROMPTS, plain_sampling(max_new_tokens=2))) == 4


def test_the_stream_is_refused_out_of_order(stand, model_dir) -> None:
    backend, _ = make_backend(stand, model_dir)
    state = perturbed_policy(model_dir).state_dict()
    first = next(iter(state))
    with pytest.raises(RuntimeError, match="no weight update in progress: call begin_weight_update"):
        backend.load_weight_bucket([(first, state[first])])
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        backend.finish_weight_update(1)
    backend.update_weights(state, version=2)
    with pytest.raises(ValueError, match="older than the loaded version 2"):
        backend.begin_weight_update(1)
    backend.begin_weight_update(3)
    with pytest.raises(RuntimeError, match="in progress: call finish_weight_update"):
        backend.begin_weight_update(3)
    backend.load_weight_bucket([(first, state[first])])
    with pytest.raises(ValueError, match="already shipped in this update"):
        backend.load_weight_bucket([(first, state[first])])


def test_a_stream_that_leaves_parameters_unwritten_fails_and_blocks_generation(stand, model_dir, monkeypatch) -> None:
    backend, _ = make_backend(stand, model_dir)
    state = perturbed_policy(model_dir).state_dict()
    backend.expected_weights = None  # only the engine can tell what is missing now
    backend.begin_weight_update(1)
    backend.load_weight_bucket([(n, v) for n, v in state.items() if "layers.1." not in n])
    with pytest.raises(ValueError, match=r"unwritten, e\.g\. \['model\.layers\.1\..*full sync"):
        backend.finish_weight_update(1)
    assert backend.weight_version == 0 and FakeReload.calls[-1][0] == "finalize"  # finalised: the engine can run
    with pytest.raises(RuntimeError, match=r"failed part-way.*full update_weights"):
        backend.generate(PROMPTS, plain_sampling())
    # a failure inside a bucket ends the sync too (finalised with force), and a full sync recovers
    backend.begin_weight_update(2)
    with pytest.raises(KeyError):
        backend.load_weight_bucket([("model.no_such.weight", torch.zeros(2))])
    assert not backend.weight_update_in_progress
    assert ("collective_rpc", "dapo_finish_reload", ()) in stand.llms[0].calls
    backend.update_weights(state, version=2)
    assert backend.weight_version == 2 and len(backend.generate(PROMPTS, plain_sampling(max_new_tokens=2))) == 4


def test_without_the_layerwise_api_each_bucket_goes_through_the_workers_own_reload(stand, model_dir, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.model_executor.model_loader.reload")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", None)  # import fails
    backend, _ = make_backend(stand, model_dir)
    backend.weight_sync_bucket_bytes = 4096
    stats = backend.update_weights(perturbed_policy(model_dir).state_dict(), version=1)
    runner = stand.llms[0].workers[0].model_runner
    assert stats.buckets > 1 and runner.reloads == stats.buckets  # Worker.reload_weights (sets the config) per bucket
    assert FakeReload.calls == []


@pytest.mark.parametrize(("mode", "backend_name", "transport"), [("cuda_ipc", "ipc", "IpcTransport"),
                                                                  ("nccl", "nccl", "NcclTransport")])  # fmt: skip
def test_gpu_weight_sync_modes_configure_vllms_transfer_engine(stand, model_dir, monkeypatch, mode, backend_name,
                                                               transport) -> None:  # fmt: skip
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    backend, _ = make_backend(stand, model_dir, **{"rollout.weight_sync": mode, "rollout.tensor_parallel_size": 2,
                                                   "resources.n_gpus_per_node": 2})  # fmt: skip
    assert stand.llms[0].kwargs["weight_transfer_config"] == {"backend": backend_name}
    assert type(backend._transport).__name__ == transport and backend._transport.mode == mode
    # IPC handles travel pickled: vLLM's workers accept them only with this set before the engine starts
    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == ("1" if mode == "cuda_ipc" else None)
    if mode == "nccl":
        assert backend._transport.world_size == 3  # the sender + 2 tensor-parallel workers


@pytest.mark.parametrize("mode", ["cuda_ipc", "nccl"])
def test_gpu_weight_sync_modes_are_refused_without_cuda_naming_the_knob(stand, model_dir, monkeypatch, mode) -> None:
    platform = sys.modules["vllm.platforms"].current_platform
    monkeypatch.setattr(platform, "device_type", "cpu")
    monkeypatch.setattr(platform, "is_sleep_mode_available", lambda: False)
    with pytest.raises(RuntimeError, match=rf"rollout\.weight_sync={mode} .*needs CUDA.*rollout\.weight_sync=bytes"):
        make_backend(stand, model_dir, **{"rollout.weight_sync": mode})
    monkeypatch.setattr(platform, "device_type", "cuda")
    monkeypatch.setattr(stand.backend, "cuda_available", lambda: False)  # a CUDA engine, but no GPU in this process
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        make_backend(stand, model_dir, **{"rollout.weight_sync": mode})
    assert stand.llms == []  # refused before an engine started
    assert "weight_transfer_config" not in make_backend(stand, model_dir)[0].engine_kwargs  # bytes: the default
