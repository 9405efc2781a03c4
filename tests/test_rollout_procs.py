"""``rollout.hf_procs``: several CPU processes decode each micro-batch and give one process's results.

Parity is checked row by row against the same backend in one process (tokens, text, finish reasons, log-probs),
for both decode paths, over micro-batches whose shares are uneven or empty; then weight changes (in place, as the
optimizer makes them, and through ``update_weights``), a decode process that dies, ``shutdown`` and the knob.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import plain_sampling
from rollout_fixtures import TEXTS, TINY, eos_prone_model
from transformers import PreTrainedTokenizerBase

from dapo_core.config import load_config
from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.rollout import HFRolloutBackend, RolloutResult
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return build_char_tokenizer(DEFAULT_ALPHABET)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]  # mixed lengths and a repeated prompt


def assert_same(ref: list[RolloutResult], got: list[RolloutResult]) -> None:
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert (a.prompt_index, a.sample_index, a.response_ids) == (b.prompt_index, b.sample_index, b.response_ids)
        assert (a.finish_reason, a.truncated, a.text, a.prompt_ids) == (
            b.finish_reason,
            b.truncated,
            b.text,
            b.prompt_ids,
        )
        assert a.log_probs is not None and b.log_probs is not None
        # fp32 sums in another order (each process has its own rows, so other matmul shapes): a few ulps of the
        # logits, which the perturbed weights below make large (an ulp near 1e-5); seen up to 2e-5 on one CPU model,
        # while weights that did not arrive move log-probs by far more (and change the tokens)
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=0)


SAMPLING = plain_sampling(n=3, max_new_tokens=20, seed=11, return_log_probs=True)


@pytest.mark.parametrize("decode", ["static", "generate"])
def test_two_processes_give_the_rows_of_one(tok, prompts, decode) -> None:
    """21 rows in micro-batches of 4: shares of 2 and 2, and a last micro-batch of 1 row (one share empty)."""
    model = eos_prone_model(tok, seed=1)
    one = HFRolloutBackend(model, tok, micro_batch_size=4, decode=decode)
    two = HFRolloutBackend(model, tok, micro_batch_size=4, decode=decode, procs=2)
    try:
        ref = one.generate(prompts, SAMPLING, prompt_index_offset=5)
        got = two.generate(prompts, SAMPLING, prompt_index_offset=5)
        assert {r.finish_reason for r in ref} == {"stop", "length"}  # rows stop at different steps, some never
        assert len({len(r.response_ids) for r in ref}) > 3
        assert_same(ref, got)
        # one micro-batch of all 21 rows, split 11 / 10
        whole = HFRolloutBackend(model, tok, micro_batch_size=64, decode=decode)
        assert_same(whole.generate(prompts, SAMPLING, prompt_index_offset=5), got)
    finally:
        two.shutdown()


def test_weight_changes_reach_the_processes(tok, prompts) -> None:
    """The default tied tiny model: an in-place update (as the optimizer makes it) and ``update_weights``."""
    model = build_tiny_qwen2(tok, seed=2)
    one = HFRolloutBackend(model, tok, micro_batch_size=64, decode="static")
    two = HFRolloutBackend(model, tok, micro_batch_size=64, decode="static", procs=2)
    try:
        before = two.generate(prompts, SAMPLING)
        assert_same(one.generate(prompts, SAMPLING), before)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        after = two.generate(prompts, SAMPLING)
        assert [r.response_ids for r in after] != [r.response_ids for r in before]
        assert_same(one.generate(prompts, SAMPLING), after)
        other = build_tiny_qwen2(tok, seed=3)
        two.update_weights(other.state_dict(), version=1)
        fresh = HFRolloutBackend(other, tok, micro_batch_size=64, decode="static")
        assert_same(fresh.generate(prompts, SAMPLING), two.generate(prompts, SAMPLING))
    finally:
        two.shutdown()


def test_a_dead_process_is_reported_and_the_next_call_starts_anew(tok, prompts) -> None:
    model = eos_prone_model(tok, seed=4)
    two = HFRolloutBackend(model, tok, micro_batch_size=64, decode="static", procs=2)
    try:
        ref = two.generate(prompts, SAMPLING)
        assert two._procs is not None
        victim = two._procs._workers[1]
        victim.kill()
        victim.join(timeout=10)
        with pytest.raises(RuntimeError, match=r"dapo-decode-1 exited with code -9.*rollout.hf_procs: 1"):
            two.generate(prompts, SAMPLING)
        assert two._procs._workers == []  # the survivor was stopped too
        assert_same(ref, two.generate(prompts, SAMPLING))
    finally:
        two.shutdown()


def test_an_interrupted_call_leaves_no_reply_for_the_next(tok, prompts, monkeypatch) -> None:
    """Ctrl-C while waiting: the replies still on their way must not answer the next call (other rows)."""
    from dapo_core.engines.rollout.decode_procs import DecodeProcesses

    def interrupt(self, k, timeout_s=None):
        raise KeyboardInterrupt

    two = HFRolloutBackend(eos_prone_model(tok, seed=6), tok, decode="static", procs=2)
    try:
        assert two._procs is not None
        two._procs.start()  # the workers are up; only the wait for their decode replies is interrupted
        with monkeypatch.context() as patch:
            patch.setattr(DecodeProcesses, "_receive", interrupt)
            with pytest.raises(KeyboardInterrupt):
                two.generate(prompts[:1], SAMPLING)
        got = two.generate(prompts[1:], SAMPLING)
        one = HFRolloutBackend(two.model, tok, decode="static")
        assert_same(one.generate(prompts[1:], SAMPLING), got)
    finally:
        two.shutdown()


def test_shutdown_stops_the_processes(tok, prompts) -> None:
    two = HFRolloutBackend(eos_prone_model(tok, seed=5), tok, decode="static", procs=2)
    assert two._procs is not None and two._procs._workers == []  # started by the first call, not before
    two.generate(prompts[:2], SAMPLING)
    workers = list(two._procs._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    two.shutdown()
    assert not any(w.is_alive() for w in workers)
    two.shutdown()  # idempotent


def test_knob_and_bad_values(tok) -> None:
    model = build_tiny_qwen2(tok, seed=0, **TINY)
    cfg = load_config(recipe="tiny-dapo", overrides=["rollout.hf_procs=2"])
    backend = HFRolloutBackend.from_config(cfg, model=model, tokenizer=tok, model_path="unused")
    assert isinstance(backend, HFRolloutBackend) and backend._procs is not None and backend._procs.procs == 2
    assert (
        HFRolloutBackend.from_config(load_config(recipe="tiny-dapo"), model=model, tokenizer=tok, model_path="x")._procs
        is None
    )
    with pytest.raises(ValueError, match="hf_procs"):
        load_config(recipe="tiny-dapo", overrides=["rollout.hf_procs=0"])
    with pytest.raises(ValueError, match=r"procs \(0\) must be >= 1"):
        HFRolloutBackend(model, tok, procs=0)
    with torch.device("meta"):
        on_meta = build_tiny_qwen2(tok, seed=0, **TINY)
    with pytest.raises(ValueError, match=r"model is on meta: set rollout\.hf_procs: 1"):
        HFRolloutBackend(on_meta, tok, procs=2)


def test_a_daemonic_caller_is_told_to_use_one_process(tok, prompts, monkeypatch) -> None:
    import multiprocessing

    monkeypatch.setitem(multiprocessing.current_process()._config, "daemon", True)
    two = HFRolloutBackend(build_tiny_qwen2(tok, seed=0, **TINY), tok, decode="static", procs=2)
    two.model.train()  # as the trainer leaves it between steps
    with pytest.raises(RuntimeError, match=r"daemonic multiprocessing process.*rollout\.hf_procs: 1"):
        two.generate(prompts, SAMPLING)
    assert two.model.training  # the refused call gives the policy back in training mode
