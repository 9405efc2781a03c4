"""The ``hf`` rollout backend: ordering, lengths, stop/truncation, seeding, sampling laws, raw log-probs, weights."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter

import pytest
import torch
from _tiny import plain_sampling
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.rollout import (
    FINISH_LENGTH,
    FINISH_STOP,
    HFRolloutBackend,
    RolloutBackend,
    SamplingConfig,
    available_rollout_backends,
    get_rollout_backend_cls,
    register_rollout_backend,
)
from dapo_core.engines.rollout.hf import SeededSampler
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY["intermediate_size"] = 64
TEXTS = ["Q: 1+2", "Q: 71-57*6", "Q: 3", "Solve: (12+30)/7 = ?", "Q: 9*9-1", "Q: 5-5"]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return build_char_tokenizer(DEFAULT_ALPHABET)


@pytest.fixture(scope="module")
def model(tok) -> Qwen2ForCausalLM:
    return build_tiny_qwen2(tok, seed=0, **TINY)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


def biased_model(tok, bias: dict[int, float], default: float = 0.0) -> Qwen2ForCausalLM:
    """A model whose next-token logits are the constant vector ``bias`` (default elsewhere), whatever the input."""
    model = build_tiny_qwen2(tok, tie_word_embeddings=False, **TINY)
    head = torch.nn.Linear(TINY["hidden_size"], len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(default)
        for token, value in bias.items():
            head.bias[token] = value
    model.lm_head = head
    return model


def naive_log_probs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Reference: one full forward on the unpadded sequence, log_softmax(logits / T), gather the response tokens."""
    ids = torch.tensor([prompt_ids + response_ids])  # (1, P + R)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits.float() / temperature, dim=-1)[0]  # (P + R, V)
    p = len(prompt_ids)
    return log_probs[p - 1 : -1].gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)  # (R,)


# ---------------------------------------------------------------------------------------------- config, registry


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n \\(0\\) must be >= 1"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        plain_sampling(**kwargs)


def test_registry_returns_hf_and_lists_valid_names() -> None:
    assert get_rollout_backend_cls("hf") is HFRolloutBackend
    assert {"hf", "vllm"} <= set(available_rollout_backends())
    with pytest.raises(ValueError, match=r"unknown rollout backend 'sglang'.*'hf'.*'vllm'"):
        get_rollout_backend_cls("sglang")
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_backend("hf")(type("Other", (HFRolloutBackend,), {}))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_says_how_to_install() -> None:
    with pytest.raises(ImportError, match=r"pip install \.\[gpu\].*GPU"):
        get_rollout_backend_cls("vllm")


# ---------------------------------------------------------------------------------------------- generation


def test_results_are_ordered_by_prompt_then_sample_with_consistent_fields(model, tok, prompts) -> None:
    backend = HFRolloutBackend(model, tok)
    results = backend.generate(prompts, plain_sampling(n=3, max_new_tokens=12, seed=0))
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(6) for j in range(3)]
    eos = tok.eos_token_id
    for r in results:
        assert r.prompt_ids == prompts[r.prompt_index]
        assert r.response_length == len(r.response_ids)
        assert 1 <= r.response_length <= 12
        assert eos not in r.response_ids[:-1]  # EOS can only be the last token
        assert r.truncated == (r.response_ids[-1] != eos)
        assert r.finish_reason == (FINISH_LENGTH if r.truncated else FINISH_STOP)
        assert r.truncated == (r.response_length == 12 and r.response_ids[-1] != eos)
        assert r.log_probs is None
        assert r.text == tok.decode(r.response_ids, skip_special_tokens=True)


def test_same_seed_same_output_other_seed_differs(model, tok, prompts) -> None:
    backend = HFRolloutBackend(model, tok)
    sampling = plain_sampling(n=2, max_new_tokens=10, seed=5)
    first = [r.response_ids for r in backend.generate(prompts, sampling)]
    assert first == [r.response_ids for r in backend.generate(prompts, sampling)]
    other = [r.response_ids for r in backend.generate(prompts, plain_sampling(n=2, max_new_tokens=10, seed=6))]
    assert first != other
    assert first[0] != first[1]  # the samples of one prompt differ from each other


def test_output_is_independent_of_micro_batch_size_and_other_prompts(model, tok, prompts) -> None:
    sampling = plain_sampling(n=2, max_new_tokens=10, seed=3, return_log_probs=True)
    reference = HFRolloutBackend(model, tok, micro_batch_size=64).generate(prompts, sampling)
    for micro in (4,):
        results = HFRolloutBackend(model, tok, micro_batch_size=micro).generate(prompts, sampling)
        assert [r.response_ids for r in results] == [r.response_ids for r in reference]
        for r, ref in zip(results, reference, strict=True):
            assert r.log_probs == pytest.approx(ref.log_probs, abs=1e-5)
    # prompt 0 alone (no padding, different neighbours) draws the same samples as inside the batch
    alone = HFRolloutBackend(model, tok).generate(prompts[:1], sampling)
    assert [r.response_ids for r in alone] == [r.response_ids for r in reference[:2]]


@pytest.mark.parametrize("max_new_tokens", [1, 63, 64, 66, 130])
def test_gumbel_noise_is_each_rows_stream_in_64_step_chunks_whatever_the_length(max_new_tokens: int) -> None:
    # reference: per row, full chunks of 64 steps x V uniforms from its own generator, -log(-log(u)) out of place;
    # the sampler draws the call's last chunk short (only the steps it can reach): the same floats must come out
    vocab, seeds = 80, [11, 12, 13]
    sampling = plain_sampling(n=1, max_new_tokens=max_new_tokens, seed=0)
    sampler = SeededSampler(seeds, prompt_width=0, sampling=sampling, device=torch.device("cpu"))
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    tiny = torch.finfo(torch.float32).tiny
    for start in range(0, max_new_tokens, 64):
        u = torch.stack([torch.rand((64, vocab), generator=g) for g in generators])  # (B, 64, V)
        expected = -torch.log((-torch.log(u.clamp(min=tiny))).clamp(min=tiny))
        for step in range(start, min(start + 64, max_new_tokens)):
            assert torch.equal(sampler._gumbel(step, vocab), expected[:, step - start])


@pytest.mark.parametrize("decode", ["generate", "static"])
def test_a_shorter_max_new_tokens_samples_a_prefix_of_the_longer(tok, prompts, decode: str) -> None:
    model = biased_model(tok, {tok.eos_token_id: -30.0})  # constant logits: the tokens are the noise's argmax
    backend = HFRolloutBackend(model, tok, decode=decode)
    long = backend.generate(prompts, plain_sampling(n=2, max_new_tokens=130, seed=1, return_log_probs=True))
    short = backend.generate(prompts, plain_sampling(n=2, max_new_tokens=66, seed=1, return_log_probs=True))
    for s, ref in zip(short, long, strict=True):
        assert s.response_length == 66 and ref.response_length == 130
        assert s.response_ids == ref.response_ids[:66]
        assert s.log_probs == pytest.approx(ref.log_probs[:66], abs=1e-6)


def test_small_max_new_tokens_truncates_when_eos_is_unlikely(tok, prompts) -> None:
    model = biased_model(tok, {tok.eos_token_id: -30.0})
    results = HFRolloutBackend(model, tok).generate(prompts, plain_sampling(n=2, max_new_tokens=3, seed=0))
    assert all(r.truncated and r.finish_reason == FINISH_LENGTH and r.response_length == 3 for r in results)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_eos_stops_immediately(tok, prompts, temperature: float) -> None:
    model = biased_model(tok, {tok.eos_token_id: 30.0})
    sampling = plain_sampling(n=2, temperature=temperature, max_new_tokens=5, seed=0)
    for r in HFRolloutBackend(model, tok).generate(prompts, sampling):
        assert r.response_ids == [tok.eos_token_id]
        assert (r.truncated, r.finish_reason, r.response_length, r.text) == (False, FINISH_STOP, 1, "")


def test_mixed_stops_exclude_padding(tok, prompts) -> None:
    # P(EOS) ~ 0.25 per step, pad impossible: some rows stop early while others run to the limit
    model = biased_model(tok, {tok.eos_token_id: math.log(26.0), tok.pad_token_id: -30.0})
    sampling = plain_sampling(n=4, max_new_tokens=8, seed=1)
    results = HFRolloutBackend(model, tok, micro_batch_size=8).generate(prompts, sampling)
    reasons = Counter(r.finish_reason for r in results)
    assert reasons[FINISH_STOP] > 0 and reasons[FINISH_LENGTH] > 0
    assert len({r.response_length for r in results}) > 2
    for r in results:
        assert tok.pad_token_id not in r.response_ids
        if not r.truncated:
            assert r.response_ids[-1] == tok.eos_token_id


def test_greedy_follows_the_argmax_of_a_naive_forward(model, tok, prompts) -> None:
    sampling = plain_sampling(n=2, temperature=0.0, max_new_tokens=6)
    results = HFRolloutBackend(model, tok).generate(prompts[:3], sampling)
    for r in results[::2]:
        ids = list(r.prompt_ids)
        for token in r.response_ids:
            with torch.no_grad():
                assert int(model(torch.tensor([ids])).logits[0, -1].argmax()) == token
            ids.append(token)
    assert results[0].response_ids == results[1].response_ids  # greedy samples of one prompt agree


def test_log_probs_are_the_sampling_temperatures_log_probs_of_sampled_tokens(model, tok, prompts) -> None:
    # the returned log-probs are log_softmax(logits / T) without top-p truncation: what the trainer recomputes as
    # old_log_probs (it divides by rollout.temperature too), not the raw model's
    sampling = plain_sampling(n=2, temperature=0.7, top_p=0.9, max_new_tokens=10, seed=2, return_log_probs=True)
    results = HFRolloutBackend(model, tok, micro_batch_size=5).generate(prompts, sampling)
    for r in results:
        assert r.log_probs is not None and len(r.log_probs) == r.response_length
        expected = naive_log_probs(model, r.prompt_ids, r.response_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(r.log_probs), expected, atol=1e-5, rtol=0)
        raw = naive_log_probs(model, r.prompt_ids, r.response_ids)
        assert not torch.allclose(torch.tensor(r.log_probs), raw, atol=1e-3)


# ---------------------------------------------------------------------------------------------- sampling laws


def _token_frequencies(tok, sampling: SamplingConfig) -> tuple[dict[int, float], list[int]]:
    """Draw 48 rows x 32 steps from constant logits a=2, b=1, c=0 (everything else impossible)."""
    a, b, c = (tok.convert_tokens_to_ids(x) for x in "abc")
    model = biased_model(tok, {a: 2.0, b: 1.0, c: 0.0}, default=-30.0)
    results = HFRolloutBackend(model, tok).generate([tok.encode("Q")] * 48, sampling)
    counts = Counter(t for r in results for t in r.response_ids)
    total = sum(counts.values())
    return {t: counts[t] / total for t in (a, b, c)}, [a, b, c]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampling_frequencies_follow_softmax_at_temperature(tok, temperature: float) -> None:
    sampling = plain_sampling(temperature=temperature, max_new_tokens=32, seed=0)
    freqs, (a, b, c) = _token_frequencies(tok, sampling)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / temperature, dim=0).tolist()
    for token, p in zip((a, b, c), expected, strict=True):
        assert abs(freqs[token] - p) < 0.04  # 1536 draws: sd <= 0.013


def test_top_k_and_top_p_truncate_the_distribution(tok) -> None:
    freqs, (a, b, c) = _token_frequencies(tok, plain_sampling(top_k=2, max_new_tokens=32, seed=0))
    assert freqs[c] == 0.0
    assert abs(freqs[a] - 0.731) < 0.04  # renormalised over {a, b}: e^2 / (e^2 + e)
    freqs, _ = _token_frequencies(tok, plain_sampling(top_k=1, max_new_tokens=8, seed=0))
    assert freqs[a] == 1.0
    # p = (0.665, 0.245, 0.090): nucleus 0.7 keeps {a, b}, nucleus 0.5 keeps {a}
    freqs, _ = _token_frequencies(tok, plain_sampling(top_p=0.7, max_new_tokens=32, seed=0))
    assert freqs[c] == 0.0 and freqs[b] > 0.2
    freqs, _ = _token_frequencies(tok, plain_sampling(top_p=0.5, max_new_tokens=8, seed=0))
    assert freqs[a] == 1.0


# ---------------------------------------------------------------------------------------------- weights, modes


def test_update_weights_loads_in_place_and_tracks_versions(tok, prompts) -> None:
    policy = build_tiny_qwen2(tok, seed=1, **TINY)
    rollout_model = build_tiny_qwen2(tok, seed=2, **TINY)
    backend = HFRolloutBackend(rollout_model, tok)
    assert backend.weight_version == 0
    sampling = plain_sampling(max_new_tokens=8, seed=4)
    before = [r.response_ids for r in backend.generate(prompts, sampling)]
    state = {k: v for k, v in policy.state_dict().items() if k != "lm_head.weight"}  # tied: may be omitted
    backend.update_weights(state, version=3)
    assert backend.weight_version == 3
    assert backend.model is rollout_model
    after = [r.response_ids for r in backend.generate(prompts, sampling)]
    assert after == [r.response_ids for r in HFRolloutBackend(policy, tok).generate(prompts, sampling)]
    assert after != before
    with pytest.raises(ValueError, match="older than the loaded version 3"):
        backend.update_weights(state, version=2)
    with pytest.raises(ValueError, match="keys the rollout model does not"):
        backend.update_weights({**state, "extra.weight": torch.zeros(1)}, version=4)
    with pytest.raises(ValueError, match="lacks keys"):
        backend.update_weights({k: v for k, v in state.items() if "norm" not in k}, version=4)
    assert backend.weight_version == 3


def test_training_mode_is_restored_and_hooks_are_noops(model, tok, prompts) -> None:
    backend = HFRolloutBackend(model, tok)
    assert isinstance(backend, RolloutBackend)
    model.train()
    try:
        backend.sleep()
        backend.wake_up()
        backend.generate(prompts[:1], plain_sampling(max_new_tokens=2))
        assert model.training
    finally:
        model.eval()
    assert model.generation_config.top_k is None  # the temporary clean config was put back


def test_empty_inputs(model, tok) -> None:
    backend = HFRolloutBackend(model, tok)
    assert backend.generate([], plain_sampling()) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[5], []], plain_sampling())
    with pytest.raises(ValueError, match="micro_batch_size"):
        HFRolloutBackend(model, tok, micro_batch_size=0)
