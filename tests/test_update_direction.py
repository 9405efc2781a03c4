"""One policy update moves each response's log-probability the way its advantage says.

A tiny Qwen2 policy, three prompt groups with fixed responses: two with mixed-sign advantages, one with all-zero
advantages (a zero-variance group, which dynamic sampling would have dropped). After ONE optimizer step (AdamW):

- every positive-advantage response is more likely and every negative one less likely (a sign error in the loss,
  or advantages attached to the wrong rows, fails this);
- the zero-advantage group pushes nothing: the signed responses change exactly as when that group is left out.

Why not "the zero-advantage responses change much less than the others": in a tiny random model every context
shares the same few parameters, and Adam's first step moves each parameter by about lr whatever its gradient's size,
so responses nobody pushed drift as much as weakly pushed ones (measured: up to 0.5-3x the smallest signed change
across seeds and sizes, with SGD too). The exact counterfactual above holds instead: the first Adam step is
lr * g / (|g| + eps), blind to the gradient's scale, and a zero-advantage row only rescales the loss through the
token / sequence denominators.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_update_direction.py -q
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from _tiny import loss_config, optim_config

from dapo_core.engines.batch import PolicyBatch, build_policy_batch
from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.engines.trainer import PolicyTrainer

Group = tuple[str, list[tuple[str, float]]]  # (prompt, [(response, advantage), ...])

# No two rows of opposite advantage share a response, and the zero group's characters appear in no other response.
SIGNED: list[Group] = [
    ("Q: 2+3", [("5", 1.0), ("7", -1.0), ("Answer: 5", 1.0), ("x=9", -1.0)]),
    ("Q: 4*2", [("8", 1.5), ("6", -0.5), ("12", -0.5), ("nope", -0.5)]),
]
ZERO: Group = ("Q: 9-1", [("kk", 0.0), ("vWv", 0.0), ("jj j", 0.0), ("Z", 0.0)])
# a real push is >= 3e-2 here; leaving the zero group out changes the signed rows' deltas by ~2e-6 (float noise)
SAME_STEP_ATOL = 1e-4


def _batch(tok, groups: Sequence[Group]) -> PolicyBatch:
    prompts, responses, gids, advs = [], [], [], []
    for g, (prompt, rows) in enumerate(groups):
        for response, adv in rows:
            prompts.append(tok.encode(prompt))
            responses.append(tok.encode(response))
            gids.append(g)
            advs.append(adv)
    return build_policy_batch(
        prompts, responses, pad_token_id=tok.pad_token_id, group_ids=gids, advantages=torch.tensor(advs)
    )


def log_prob_change(groups: Sequence[Group], loss_agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response: summed log-prob after ONE update minus before, and its advantage. (N,) each."""
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(
        tok,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        seed=0,
    )
    trainer = PolicyTrainer(model, optim_config(lr=1e-3, weight_decay=0.0, grad_clip=1e9), micro_batch_size=8)
    batch = _batch(tok, groups)
    old, _ = trainer.compute_log_probs(batch)  # (N, T), zero past each response
    batch.old_log_probs = old
    loss_cfg = loss_config(loss_agg=loss_agg, clip_c=10.0)
    metrics = trainer.update(batch, loss_cfg, ppo_epochs=1, mini_batch_groups=len(groups))
    assert metrics["num_updates"] == 1.0  # exactly one optimizer step
    new, _ = trainer.compute_log_probs(batch)  # (N, T)
    assert batch.advantages is not None
    return (new - old).sum(dim=1), batch.advantages  # (N,), (N,)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_one_update_moves_log_probs_along_the_advantage(loss_agg: str) -> None:
    delta, adv = log_prob_change([*SIGNED, ZERO], loss_agg)
    positive, negative = adv > 0, adv < 0
    assert bool((delta[positive] > 0).all()), f"positive-advantage responses must gain: {delta[positive]}"
    assert bool((delta[negative] < 0).all()), f"negative-advantage responses must lose: {delta[negative]}"

    # the zero-advantage group adds no push of its own: without it the signed responses move the same
    without_zero, _ = log_prob_change(SIGNED, loss_agg)
    signed = positive | negative  # (N,): the first rows, in the same order as ``without_zero``
    assert int(signed.sum()) == without_zero.numel()
    torch.testing.assert_close(delta[signed], without_zero, rtol=0, atol=SAME_STEP_ATOL)
    assert float(delta[signed].abs().min()) > 100 * SAME_STEP_ATOL  # the tolerance is far below a real push
