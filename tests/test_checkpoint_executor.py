"""Checkpoints (atomic, pruned, pickle-free, bit-exact resume) and the LocalExecutor end to end on a tiny model."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_model_dir

from dapo_core.algorithm import group_advantages
from dapo_core.config import load_config
from dapo_core.engines import checkpoint as ckpt
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.executor import LocalExecutor, sampling_from
from dapo_core.seeding import derive_seed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "base")


def make_cfg(model_dir, **extra):
    sets = [
        f"model.path={model_dir}",
        "rollout.n=4",
        "data.max_response_length=12",
        "algorithm.overlong.buffer_length=4",
        "trainer.ppo_mini_batch_size=2",
        "data.train_batch_size=4",
        "data.gen_batch_size=4",
        "trainer.micro_batch_size=6",
        "trainer.lr=0.01",
        "trainer.max_ckpt_to_keep=2",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(recipe="tiny-dapo", overrides=sets, env={})


PROMPTS = ["Q: 1+2\n", "Q: 7*3\n", "Q: 9-4\n", "Q: 2*2\n"]


def rl_step(ex: LocalExecutor, step: int) -> dict:
    """One simplified Algorithm-1 step through the executor (reward: fraction of digits, so groups vary)."""
    tok = ex.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    results = ex.generate(prompts, sampling_from(ex.cfg, seed=derive_seed(ex.cfg.trainer.seed, step, 0)))
    scores = torch.tensor([sum(c.isdigit() for c in r.text) / max(1, len(r.text)) for r in results])
    gids = [r.prompt_index for r in results]
    batch = build_policy_batch(
        [r.prompt_ids for r in results],
        [r.response_ids for r in results],
        pad_token_id=tok.pad_token_id,
        group_ids=gids,
        advantages=group_advantages(scores, gids),
    )
    batch.old_log_probs, _ = ex.compute_log_probs(batch)
    metrics = ex.update(batch)
    ex.sync_weights()
    return metrics


def params(ex: LocalExecutor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ex.model.state_dict().items()}


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(model_dir, tmp_path):
    cfg = make_cfg(model_dir)
    straight = LocalExecutor(cfg)
    for step in (1, 2, 3):
        m = rl_step(straight, step)
        if step == 1:
            straight.save_checkpoint(tmp_path / "ckpts", step, {"mlflow_run_id": "abc", "data_position": 17})
    assert m["num_updates"] == 2.0

    resumed = LocalExecutor(cfg)
    meta = resumed.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "ckpts"))
    assert meta["mlflow_run_id"] == "abc" and meta["data_position"] == 17 and meta["step"] == 1
    assert resumed.weight_version == 1
    for step in (2, 3):
        rl_step(resumed, step)
    a, b = params(straight), params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.trainer.global_step == straight.trainer.global_step == 3


def test_checkpoint_is_a_loadable_hf_dir_and_restores_identical_tensors(model_dir, tmp_path):
    from dapo_core.engines.models import load_model

    ex = LocalExecutor(make_cfg(model_dir))
    rl_step(ex, 1)
    path = ex.save_checkpoint(tmp_path, 1, {})
    assert (path / "model.safetensors").is_file() and (path / ckpt.COMPLETE_MARKER).is_file()
    reloaded = load_model(str(path))
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, ex.model.state_dict()[k]), k
    state = torch.load(path / "trainer_state.pt", weights_only=True)  # no arbitrary unpickling needed
    assert "optimizer" in state and state["global_step"] == 1


def test_interrupted_save_leaves_no_partial_checkpoint(model_dir, tmp_path, monkeypatch):
    ex = LocalExecutor(make_cfg(model_dir))
    ex.save_checkpoint(tmp_path, 1, {})
    real_save = torch.save

    def crash(obj, f, *a, **k):
        if str(f).endswith("rng_state.pt"):
            raise KeyboardInterrupt("killed mid-save")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ex.save_checkpoint(tmp_path, 2, {})
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_only_newest_checkpoints_are_kept(model_dir, tmp_path):
    ex = LocalExecutor(make_cfg(model_dir))
    for step in (1, 2, 3, 4):
        ex.save_checkpoint(tmp_path, step, {})
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step_5").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step_5")
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_sync_bumps_weight_version_and_generation_is_seeded(model_dir):
    ex = LocalExecutor(make_cfg(model_dir))
    tok = ex.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    s = sampling_from(ex.cfg, seed=123)
    first = [r.response_ids for r in ex.generate(prompts, s)]
    again = [r.response_ids for r in ex.generate(prompts, s)]
    assert first == again
    assert ex.weight_version == 0
    rl_step(ex, 1)
    assert ex.weight_version == 1 and ex.rollout.weight_version == 1


def test_missing_model_names_the_key_and_the_fix(tmp_path):
    cfg = make_cfg(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        LocalExecutor(cfg)
