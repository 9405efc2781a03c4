"""How the ``vllm`` backend reads the engine's answers: one ``RequestOutput`` of ``LLM.generate`` becomes the
``RolloutResult``s of its prompt, under the ``hf`` backend's contract (sample order, EOS, truncation, raw
log-probs, text decoded with the run's tokenizer). Imports nothing from vLLM; the facts about its outputs these
rely on are in ``dapo_core.engines.rollout.vllm``'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo_core.engines.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutResult, SamplingConfig


def to_results(
    prompt_index: int,
    prompt: list[int],
    output: Any,
    sampling: SamplingConfig,
    *,
    eos_token_ids: Sequence[int],
    tokenizer: Any = None,
) -> list[RolloutResult]:
    """The ``sampling.n`` results of global prompt ``prompt_index`` from its ``RequestOutput``, in sample order.

    A greedy request (temperature 0) asked vLLM for one sample: it is repeated ``n`` times. ``tokenizer`` decodes
    the text (``skip_special_tokens``, as ``hf``); None keeps vLLM's own ``.text``. Raises ``RuntimeError`` on
    missing samples, aborted requests or log-probs that do not match the tokens.
    """
    completions = sorted(output.outputs, key=lambda c: int(c.index))
    asked = 1 if sampling.temperature == 0 else sampling.n
    if [int(c.index) for c in completions] != list(range(asked)):
        raise RuntimeError(
            f"vLLM returned samples {[c.index for c in completions]} for prompt {prompt_index}, expected 0..{asked - 1}"
        )
    if asked < sampling.n:  # greedy: every sample is the one greedy response
        completions = completions * sampling.n
    eos = {int(i) for i in eos_token_ids}
    results = []
    for j, completion in enumerate(completions):
        ids = [int(t) for t in completion.token_ids]
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM finished sample {j} of prompt {prompt_index} with finish_reason {reason!r} (aborted?); "
                "only 'stop' and 'length' are complete responses"
            )
        # EOS-terminated = not truncated, also when the EOS was the last allowed token (as the hf backend)
        stopped = reason == "stop" or (bool(ids) and ids[-1] in eos)
        results.append(
            RolloutResult(
                prompt_index=prompt_index,
                sample_index=j,
                prompt_ids=list(prompt),
                response_ids=ids,
                response_length=len(ids),
                truncated=not stopped,
                finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
                log_probs=sampled_log_probs(completion, ids, prompt_index, j) if sampling.return_log_probs else None,
                text=str(tokenizer.decode(ids, skip_special_tokens=True))
                if tokenizer is not None
                else str(completion.text),
            )
        )
    return results


def sampled_log_probs(completion: Any, ids: list[int], prompt_index: int, sample_index: int) -> list[float]:
    """The raw log-prob of each sampled token, aligned with ``ids`` (from ``SamplingParams(logprobs=0)``)."""
    entries = completion.logprobs
    if entries is None or len(entries) != len(ids):
        got = "none" if entries is None else str(len(entries))
        raise RuntimeError(
            f"vLLM returned {got} log-prob entries for the {len(ids)} tokens of sample {sample_index} of prompt "
            f"{prompt_index}; SamplingParams(logprobs=0) must give one per token"
        )
    out = []
    for k, token in enumerate(ids):
        entry = entries[k].get(token)
        if entry is None:
            raise RuntimeError(
                f"vLLM log-probs of prompt {prompt_index} sample {sample_index} lack the sampled token {token} at "
                f"position {k}"
            )
        out.append(float(getattr(entry, "logprob", entry)))
    return out
