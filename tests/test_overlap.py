"""rollout.mode=one_step_off: step t+1 trains on samples of the weights of version t-1, with the ratio's pi_old taken
from those weights, and a resumed run is the uninterrupted one (in process and on Ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from train_fixtures import make_train_cfg
from train_fixtures import metric_history as history
from train_fixtures import run_train as run

from dapo_core.config import ConfigError, load_config
from dapo_core.engines.executor import LocalExecutor, load_policy_model, policy_trainer_from
from dapo_core.seeding import derive_seed
from dapo_core.training.step import ROLLOUT_LOG_PROBS

# one generation batch per step (no refills), so every step's batch is the one generated ahead
ONE_BATCH = ("algorithm.dynamic_sampling.enable=false", "trainer.test_freq=0", "trainer.val_before_train=false")
OFF = "rollout.mode=one_step_off"


@pytest.fixture(scope="module")
def harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


def test_the_knobs_and_their_checks():
    cfg = load_config(recipe="tiny-dapo", overrides=[OFF], env={})
    assert (cfg.rollout.mode, cfg.rollout.max_staleness) == ("one_step_off", 1)
    assert load_config(recipe="tiny-dapo", env={}).rollout.mode == "sync"  # the default stays on-policy
    with pytest.raises(ConfigError, match=r"rollout.max_staleness \(2\) only applies to rollout.mode=one_step_off"):
        load_config(recipe="tiny-dapo", overrides=["rollout.max_staleness=2"], env={})
    with pytest.raises(ConfigError, match="vLLM returns raw log-probs"):
        load_config(recipe="tiny-dapo", overrides=[OFF, "rollout.backend=vllm", "rollout.temperature=0.8"], env={})
    # with the correction on, pi_old is the trainer's recomputation at the temperature: allowed
    load_config(
        recipe="tiny-dapo",
        overrides=[OFF, "rollout.backend=vllm", "rollout.temperature=0.8", "algorithm.rollout_correction.enable=true"],
        env={},
    )
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(recipe="tiny-dapo", overrides=[OFF, "rollout.max_staleness=0"], env={})


def _digest_of(state: dict[str, torch.Tensor]) -> float:
    """A position-weighted sum of every weight: equal for the same weights, different once an update moved them."""
    return float(sum((v.double() * (i + 1)).sum() for i, v in enumerate(state.values())))


@pytest.mark.slow
def test_step_t_plus_1_trains_on_version_t_minus_1_samples_and_ratio(tmp_path, monkeypatch, harness):
    gens, updates, snapshots = [], [], {}
    real_generate, real_update = LocalExecutor.generate, LocalExecutor.update

    def generate(self, prompts, sampling):
        gens.append((sampling.seed, self.weight_version, _digest_of(self.model.state_dict())))
        return real_generate(self, prompts, sampling)

    def update(self, batch):
        snapshots[self.weight_version] = {k: v.clone() for k, v in self.model.state_dict().items()}
        updates.append((self.weight_version, batch))
        return real_update(self, batch)

    monkeypatch.setattr(LocalExecutor, "generate", generate)
    monkeypatch.setattr(LocalExecutor, "update", update)
    cfg = make_train_cfg(tmp_path / "off", *ONE_BATCH, OFF, "trainer.save_freq=0")
    off = run(cfg, tmp_path / "off")
    seed = cfg.trainer.seed

    # generation order: step 1 (v0), step 2 submitted before update 1 (v0 still), step 3 before update 2 (v1)
    assert [(s, v) for s, v, _ in gens] == [(derive_seed(seed, "train", t, 0), v) for t, v in ((1, 0), (2, 0), (3, 1))]
    assert [v for v, _ in updates] == [0, 1, 2]
    # the weights that sampled step t+1 are those before update t, i.e. version t-1 (bit for bit)
    assert gens[1][2] == gens[0][2] and gens[2][2] == _digest_of(snapshots[1])
    assert gens[2][2] != _digest_of(snapshots[2])  # not the trainer's weights when step 3 trained

    # the ratio's pi_old is the behaviour policy: the sampler's log-probs, which the version t-1 weights reproduce
    model = load_policy_model(cfg, cfg.model.path, torch.device("cpu"))
    trainer = policy_trainer_from(cfg, model, torch.device("cpu"))
    for version, batch in updates[1:]:  # steps 2 and 3: trained at version t-1 on samples of version t-2
        assert torch.equal(batch.old_log_probs, batch.extras[ROLLOUT_LOG_PROBS])
        mask = batch.response_mask.bool()
        model.load_state_dict(snapshots[version - 1])
        behaviour, _ = trainer.compute_log_probs(batch)
        torch.testing.assert_close(behaviour[mask], batch.old_log_probs[mask], rtol=0, atol=1e-5)
        model.load_state_dict(snapshots[version])
        current, _ = trainer.compute_log_probs(batch)
        assert (current - batch.old_log_probs)[mask].abs().mean() > 1e-3  # the trainer had moved on (lr 0.02)
    assert history(off["run_id"], "rollout/staleness_max") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert history(off["run_id"], "rollout/off_policy_groups_frac") == [(1, 0.0), (2, 1.0), (3, 1.0)]

    # against sync: the same first step (same samples, same weights), then the schedules part
    monkeypatch.setattr(LocalExecutor, "generate", real_generate)
    monkeypatch.setattr(LocalExecutor, "update", real_update)
    sync = run(make_train_cfg(tmp_path / "sync", *ONE_BATCH, "trainer.save_freq=0"), tmp_path / "sync")
    assert history(sync["run_id"], "rollout/staleness_max") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    for key in ("train/acc/mean", "response_length/mean", "actor/pg_loss"):
        h_off, h_sync = history(off["run_id"], key), history(sync["run_id"], key)
        # step 1 on-policy in both; pi_old is the sampler's here and the trainer's there (equal up to float order)
        assert h_off[0] == pytest.approx(h_sync[0], abs=1e-5), key
    # steps 2-3 sample from other weights (version t-1 here, t there): other responses
    lengths = [history(r["run_id"], "response_length/mean")[1:] for r in (off, sync)]
    assert lengths[0] != lengths[1], lengths


def _crash_then_resume(cfg, root: Path, monkeypatch, crash_step: int) -> dict:
    import flows.train as ft

    real_step = ft._train_step

    def crash(run_state, step):
        if step == crash_step:
            raise RuntimeError(f"simulated crash in step {step}")
        return real_step(run_state, step)

    monkeypatch.setattr(ft, "_train_step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, root)
    monkeypatch.setattr(ft, "_train_step", real_step)
    return run(cfg, root, resume=True)


def _assert_same_run(a: dict, b: dict, steps: list[int], *, exact: bool = True) -> None:
    from transformers import AutoModelForCausalLM

    for key in ("actor/pg_loss", "train/acc/mean", "critic/rewards/mean", "rollout/staleness_max"):
        ha, hb = history(a["run_id"], key), history(b["run_id"], key)
        assert [s for s, _ in hb] == steps, key
        assert [v for _, v in hb] == pytest.approx([v for _, v in ha], abs=0 if exact else 1e-5), key
    wa = AutoModelForCausalLM.from_pretrained(a["final_model"]).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b["final_model"]).state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0 if exact else 1e-6)


@pytest.mark.slow
def test_resume_keeps_the_batch_generated_ahead(tmp_path, monkeypatch, harness):
    """Killed in step 4 after the step-2 checkpoint: the resumed run trains step 3 on the batch generated with the
    version-1 weights (saved in the checkpoint), not on a fresh one, and ends bit-identical."""
    base = (*ONE_BATCH, OFF, "trainer.total_steps=4", "trainer.save_freq=2")
    straight = run(make_train_cfg(tmp_path / "a", *base, "tracking.run_name=straight"), tmp_path / "a")
    cfg = make_train_cfg(tmp_path / "b", *base, "tracking.run_name=crashy")
    resumed = _crash_then_resume(cfg, tmp_path / "b", monkeypatch, crash_step=4)
    _assert_same_run(straight, resumed, [1, 2, 3, 4])
    meta = json.loads((tmp_path / "b/outputs/crashy/checkpoints/step_2/trainer_state.json").read_text())
    queued = meta["prefetched"]
    assert [(q["step"], q["version"]) for q in queued] == [(3, 1)]
    assert len(queued[0]["results"]) == cfg.data.gen_batch_size * cfg.rollout.n


@pytest.mark.slow
def test_overlapped_run_on_ray_matches_in_process_and_resumes_exactly(tmp_path, monkeypatch, harness):
    here = str(Path(__file__).parent)  # Ray workers import the test reward from this folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    base = (*ONE_BATCH, OFF, "trainer.total_steps=3", "trainer.save_freq=2")
    local = run(make_train_cfg(tmp_path / "l", *base, "tracking.run_name=local"), tmp_path / "l")
    ray_sets = (*base, "resources.executor=ray", "resources.num_cpus=2")
    straight = run(make_train_cfg(tmp_path / "r", *ray_sets, "tracking.run_name=ray"), tmp_path / "r")
    # same schedule and samples as in process (the weights agree up to float summation order across threads)
    for key in ("train/acc/mean", "critic/rewards/mean", "rollout/staleness_max"):
        assert history(straight["run_id"], key) == history(local["run_id"], key), key
    cfg = make_train_cfg(tmp_path / "c", *ray_sets, "tracking.run_name=ray-crashy")
    resumed = _crash_then_resume(cfg, tmp_path / "c", monkeypatch, crash_step=3)
    _assert_same_run(straight, resumed, [1, 2, 3], exact=False)


def test_hf_rollout_workers_are_not_put_to_sleep_so_generation_can_overlap_the_update():
    """A sleep call would queue behind the generation in flight and hold the update until it ends; hf has no engine
    memory to free. vLLM engines (a lazy backend, never imported here) still sleep when colocated."""
    import types

    from dapo_core.distributed.executor import RayExecutor

    for backend, sleeps in (("hf", 0), ("vllm", 1)):
        cfg = load_config(
            recipe="tiny-dapo", overrides=[f"rollout.backend={backend}", "resources.placement=colocate"], env={}
        )
        group = types.SimpleNamespace(calls=0)
        group.sleep = lambda g=group, **_: setattr(g, "calls", g.calls + 1)
        RayExecutor._free_rollout_memory(types.SimpleNamespace(cfg=cfg, _groups=lambda g=group: (None, g, None)))
        assert group.calls == sleeps, backend
