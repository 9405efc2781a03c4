"""``hf`` rollout backend: batched sampling with transformers' ``model.generate`` (the CPU default).

Design
------
- **Length bucketing.** The B*G rows (prompt i, sample j) are sorted by prompt length and cut into micro-batches
  of ``micro_batch_size`` rows, left-padded to the longest prompt of the micro-batch; results are put back in
  (prompt, sample) order.
- **Per-sample seeding (Gumbel-max).** ``model.generate`` runs in greedy mode with one logits processor,
  ``SeededSampler``, that picks every token itself: it applies temperature, top-k and top-p to the logits, adds
  Gumbel noise drawn from a ``torch.Generator`` seeded by ``(seed, prompt_index, sample_index)`` and takes the
  argmax, which is an exact sample of the softmax (the Gumbel-max trick). Each row owns its random stream, so a
  sample does not depend on which rows share its micro-batch.

What holds: same model, prompts and ``SamplingConfig`` -> bit-identical results (on the same machine and
thread count). Across ``micro_batch_size`` (or a reordering of the other prompts) every row sees the same noise;
results are identical unless the tiny floating-point differences of differently padded batches flip a
near-tied argmax — never observed on the tiny model (the tests check equality), but not a guarantee on other
hardware or dtypes (bf16 differences are larger).

Log-probs: ``RolloutResult.log_probs`` are ``log_softmax(logits / temperature)`` (no top-k/top-p) gathered at the
sampled tokens — the quantity the trainer recomputes as ``old_log_probs`` — computed inside the
same processor, so memory stays O(B*V) instead of keeping every step's logits.

The model's own ``generation_config`` defaults (repetition penalty, top-k 50, ...) are ignored while
generating: sampling follows ``SamplingConfig`` only, as a vLLM rollout does.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from dapo_core.engines.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBackend,
    RolloutResult,
    SamplingConfig,
    register_rollout_backend,
)
from dapo_core.engines.rollout.decode_procs import Decoded, DecodeProcesses
from dapo_core.engines.rollout.static_decode import check_supported, decode_static

if TYPE_CHECKING:
    from dapo_core.config.schema import DapoConfig

logger = logging.getLogger(__name__)

# rollout.hf_decode: transformers' generate, or the lean static-KV-cache loop of static_decode
DECODE_MODES = ("generate", "static")

# Upper bound on the Gumbel noise drawn ahead per row (elements); keeps the buffer small for 150k vocabularies.
_NOISE_ELEMENTS_PER_ROW = 1 << 18


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of sample ``sample_index`` of prompt ``prompt_index`` (stable across runs and platforms)."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededSampler(LogitsProcessor):
    """Chooses each row's next token from its own random stream; records tokens and raw log-probs.

    Returns scores that are 0 at the chosen token and -inf elsewhere, so greedy ``generate`` follows it.
    """

    def __init__(
        self, row_seeds: Sequence[int], *, prompt_width: int, sampling: SamplingConfig, device: torch.device
    ) -> None:
        self.prompt_width = prompt_width
        self.sampling = sampling
        self.device = device
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]
        self.warpers: list[LogitsProcessor] = []
        if sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
        self.tokens: list[Tensor] = []  # per step, (B,)
        self.log_probs: list[Tensor] = []  # per step, (B,)
        self._noise: Tensor | None = None  # (B, chunk, V)
        self._noise_start = 0

    def _gumbel(self, step: int, vocab: int) -> Tensor:
        """Gumbel(0, 1) noise for ``step``, (B, V). Drawn ``chunk`` steps ahead per row; chunk depends on V only,
        so every row consumes its stream identically whatever the micro-batch."""
        chunk = max(1, min(64, _NOISE_ELEMENTS_PER_ROW // vocab))
        if self._noise is None or step >= self._noise_start + self._noise.shape[1]:
            self._noise_start = step - step % chunk
            # the last chunk holds only the steps a call can reach: a stream's first k draws do not depend on how
            # many follow, so every row's noise is the same as a full chunk's (nothing is drawn after it)
            steps = max(min(chunk, self.sampling.max_new_tokens - self._noise_start), step - self._noise_start + 1)
            noise = torch.empty((len(self.generators), steps, vocab), device=self.device)  # (B, steps, V)
            for g, row in zip(self.generators, noise, strict=True):
                torch.rand((steps, vocab), generator=g, device=self.device, out=row)  # U(0, 1), each row's stream
            tiny = torch.finfo(noise.dtype).tiny
            # in place, the same floats as out of place: u -> Exp(1) = -log(u) > 0 -> Gumbel(0, 1) = -log(Exp(1))
            self._noise = noise.clamp_(min=tiny).log_().neg_().clamp_(min=tiny).log_().neg_()
        return self._noise[:, step - self._noise_start]  # (B, V)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        # input_ids (B, prompt_width + step), scores (B, V): raw float32 logits of the next token
        chosen = self.choose(input_ids.shape[1] - self.prompt_width, scores)  # (B,)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, chosen[:, None], 0.0)  # (B, V)

    def choose(self, step: int, scores: Tensor) -> Tensor:
        """The tokens ``(B,)`` of generation step ``step`` from the raw next-token logits ``scores`` ``(B, V)``;
        records them and their log-probs (the generate path and ``static_decode`` both call this)."""
        logits = scores.float()
        if self.sampling.greedy:
            chosen = logits.argmax(dim=-1)  # (B,)
        else:
            warped = logits / self.sampling.temperature
            for warper in self.warpers:
                warped = warper(None, warped)  # type: ignore[arg-type]  # top-k / top-p read only the scores
            # Gumbel-max: argmax(log p + g), g ~ Gumbel(0,1), is an exact draw from softmax(log p).
            chosen = (warped + self._gumbel(step, logits.shape[-1])).argmax(dim=-1)  # (B,)
        self.tokens.append(chosen)
        if self.sampling.return_log_probs:
            # log-prob at the sampling temperature, no top-k/top-p truncation: what the trainer recomputes as
            # old_log_probs (it divides the logits by rollout.temperature too); greedy: the raw logits
            scaled = logits if self.sampling.greedy else logits / self.sampling.temperature  # (B, V)
            log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, chosen[:, None]).squeeze(-1)  # (B,)
            self.log_probs.append(log_probs)
        return chosen


@contextlib.contextmanager
def _generation_config(model: PreTrainedModel, config: GenerationConfig) -> Iterator[None]:
    """Temporarily replace ``model.generation_config``: generate() fills unset fields from it."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


@register_rollout_backend("hf")
class HFRolloutBackend(RolloutBackend):
    """Rollouts with transformers ``generate``; see the module docstring for seeding and log-prob semantics.

    ``micro_batch_size`` counts rows (prompt x sample). ``device`` moves the model; by default the model stays
    where it is. ``eos_token_ids`` default to the model's generation-config EOS plus the tokenizer's EOS.
    ``procs`` > 1 decodes each micro-batch's rows in that many CPU processes at once (``decode_procs``; the same
    tokens); ``shutdown`` stops them.
    """

    shares_policy_model = True  # generates with the module it is given (in-process: the trainer's own)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        micro_batch_size: int = 64,
        device: str | torch.device | None = None,
        eos_token_ids: Sequence[int] | None = None,
        decode: str = "generate",
        procs: int = 1,
    ) -> None:
        if procs < 1:
            raise ValueError(f"procs ({procs}) must be >= 1 decode processes (rollout.hf_procs)")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) must be >= 1 rows")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode {decode!r} is not one of {DECODE_MODES} (rollout.hf_decode)")
        if decode == "static":
            check_supported(model)
        self.decode = decode
        self.model = model
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        if device is not None:
            self.model.to(device)  # type: ignore[arg-type]  # transformers types .to loosely
        self.device = next(model.parameters()).device
        self.model.eval()
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else self._default_eos_ids()
        if not self.eos_token_ids:
            raise ValueError(
                "no EOS token id found in the model's generation config or the tokenizer: pass eos_token_ids"
            )
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self._weight_version = 0
        self._procs = DecodeProcesses(self, procs) if procs > 1 else None

    @classmethod
    def config_kwargs(cls, cfg: DapoConfig) -> dict[str, Any]:
        """``rollout.micro_batch_size`` rows per call, decoded by ``rollout.hf_decode`` in ``rollout.hf_procs``."""
        return {
            "micro_batch_size": cfg.rollout.micro_batch_size,
            "decode": cfg.rollout.hf_decode,
            "procs": cfg.rollout.hf_procs,
        }

    def _default_eos_ids(self) -> list[int]:
        ids: list[int] = []
        model_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for value in (model_eos, self.tokenizer.eos_token_id):
            for i in value if isinstance(value, (list, tuple)) else [value]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig, *, prompt_index_offset: int = 0
    ) -> list[RolloutResult]:
        """Sample ``sampling.n`` responses per prompt; ``results[i * n + j]`` is sample ``j`` of prompt ``i``.

        ``prompt_index_offset``: the position of ``prompts[0]`` in a larger batch that was split across workers
        (data parallel). Seeds and ``RolloutResult.prompt_index`` use ``offset + i``, so a shard generated with
        its offset gives exactly the rows of the whole batch generated in one call.
        """
        if prompt_index_offset < 0:
            raise ValueError(f"prompt_index_offset ({prompt_index_offset}) must be >= 0: pass the shard's start")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. a chat template)")
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]  # (B*G,) in result order
        # bucket by prompt length (stable sort) so a micro-batch pads little; results go back by row index
        order = sorted(range(len(rows)), key=lambda r: len(prompts[rows[r][0]]))
        results: list[RolloutResult | None] = [None] * len(rows)
        was_training = self.model.training
        self.model.eval()
        try:
            if self._procs is not None:
                self._procs.prepare()  # workers up, the current weights copied to them once for the whole call
            for start in range(0, len(order), self.micro_batch_size):
                chunk = order[start : start + self.micro_batch_size]
                batch = self._generate_micro_batch([rows[r] for r in chunk], prompts, sampling, prompt_index_offset)
                for r, result in zip(chunk, batch, strict=True):
                    results[r] = result
        finally:
            self.model.train(was_training)
        return [r for r in results if r is not None]

    def _generation_config(self, sampling: SamplingConfig) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=False,  # SeededSampler does the sampling; generate just follows it
            num_beams=1,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    def _generate_micro_batch(
        self,
        rows: list[tuple[int, int]],
        prompts: Sequence[list[int]],
        sampling: SamplingConfig,
        prompt_index_offset: int = 0,
    ) -> list[RolloutResult]:
        if self._procs is None:
            decoded = self._decode_micro_batch(rows, prompts, sampling, prompt_index_offset)
            return self._to_results(rows, prompts, *decoded, prompt_index_offset)
        # share k holds rows[k::procs]; put each share's results back at those positions
        results: list[RolloutResult] = [None] * len(rows)  # type: ignore[list-item]  # every slot is filled
        for k, part in enumerate(self._procs.decode(rows, prompts, sampling, prompt_index_offset)):
            if part is not None:
                share = rows[k :: self._procs.procs]
                results[k :: self._procs.procs] = self._to_results(share, prompts, *part, prompt_index_offset)
        return results

    def _decode_micro_batch(
        self,
        rows: list[tuple[int, int]],
        prompts: Sequence[list[int]],
        sampling: SamplingConfig,
        prompt_index_offset: int = 0,
    ) -> Decoded:
        """Sample ``rows`` in one batch: (responses (b, t), the sampler's tokens (b, t'), log-probs (b, t') | None)."""
        width = max(len(prompts[i]) for i, _ in rows)
        pads = [width - len(prompts[i]) for i, _ in rows]  # left padding
        input_ids = torch.tensor(
            [[self.pad_token_id] * pad + list(prompts[i]) for pad, (i, _) in zip(pads, rows, strict=True)],
            dtype=torch.long,
        )  # (b, L)
        attention_mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in pads], dtype=torch.long)  # (b, L)
        sampler = SeededSampler(
            [row_seed(sampling.seed, prompt_index_offset + i, j) for i, j in rows],
            prompt_width=width,
            sampling=sampling,
            device=self.device,
        )
        if self.decode == "static":
            responses = decode_static(
                self.model,
                input_ids.to(self.device),
                attention_mask.to(self.device),
                max_new_tokens=sampling.max_new_tokens,
                choose=sampler.choose,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
            ).cpu()  # (b, t)
        else:
            config = self._generation_config(sampling)
            with _generation_config(self.model, config), torch.inference_mode():
                sequences = self.model.generate(  # type: ignore[operator]
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([sampler]),
                )  # (b, L + t)
            responses = sequences[:, width:].cpu()  # (b, t)
        chosen = torch.stack(sampler.tokens, dim=1).cpu()  # (b, t') t' >= t: generate may run extra steps
        log_probs = torch.stack(sampler.log_probs, dim=1).cpu() if sampler.log_probs else None  # (b, t')
        return responses, chosen, log_probs

    def _to_results(
        self,
        rows: list[tuple[int, int]],
        prompts: Sequence[list[int]],
        responses: Tensor,
        chosen: Tensor,
        log_probs: Tensor | None,
        prompt_index_offset: int = 0,
    ) -> list[RolloutResult]:
        steps = responses.shape[1]
        is_eos = torch.isin(responses, torch.tensor(self.eos_token_ids))  # (b, t)
        has_eos = is_eos.any(dim=1)  # (b,)
        # length = first EOS position + 1 (EOS kept), else every generated token
        lengths = torch.where(
            has_eos, is_eos.int().argmax(dim=1) + 1, torch.full_like(has_eos, steps, dtype=torch.long)
        )
        valid = torch.arange(steps)[None, :] < lengths[:, None]  # (b, t)
        # generate may run (and undo) extra steps after every row stopped: keep the first `steps` records
        chosen = chosen[:, :steps]  # (b, t)
        if bool(((chosen != responses) & valid).any()):
            raise RuntimeError(
                "generate() did not emit the tokens chosen by SeededSampler; another logits processor or "
                "generation option changed the tokens. This is a bug in HFRolloutBackend."
            )
        # one conversion to Python lists per call (per-row tensor indexing costs more than the rows' data)
        all_ids, all_lengths, all_stopped = responses.tolist(), lengths.tolist(), has_eos.tolist()
        all_log_probs = log_probs[:, :steps].tolist() if log_probs is not None else None  # (b, t)
        results = []
        for k, (i, j) in enumerate(rows):
            n_tok, stopped = all_lengths[k], all_stopped[k]
            ids = all_ids[k][:n_tok]
            results.append(
                RolloutResult(
                    prompt_index=prompt_index_offset + i,
                    sample_index=j,
                    prompt_ids=list(prompts[i]),
                    response_ids=ids,
                    response_length=n_tok,
                    truncated=not stopped,
                    finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
                    log_probs=all_log_probs[k][:n_tok] if all_log_probs is not None else None,
                    text=str(self.tokenizer.decode(ids, skip_special_tokens=True)),
                )
            )
        return results

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model in place (tied weights may be omitted) and set the version."""
        self._check_weight_version(version)
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise ValueError(f"state_dict has keys the rollout model does not: {unknown[:5]} (same architecture?)")
        loaded = {own[k].data_ptr() for k in state_dict}
        missing = sorted(k for k in set(own) - set(state_dict) if own[k].data_ptr() not in loaded)  # tied: ok
        if missing:
            raise ValueError(f"state_dict lacks keys of the rollout model: {missing[:5]} (pass the full state dict)")
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=False)
        self._weight_version = version
        logger.debug("rollout weights updated to version %d", version)

    def shutdown(self) -> None:
        """Stop the decode processes of ``procs`` > 1 (a later ``generate`` starts them again)."""
        if self._procs is not None:
            self._procs.close()
