"""RayExecutor on a local Ray (num_cpus=2): the same DAPO step as LocalExecutor, weight sync, faults, reward bounds.

One Ray session and one pair of executors (local, Ray with 2 rollout workers and 2 gloo trainer ranks) serve the
whole module: every test runs its steps on both, so each comparison stands on its own.
"""

from __future__ import annotations

import itertools
import time

import pytest
import ray
import torch
from _tiny import plain_sampling, random_batch, tiny_model_dir
from conftest_distributed import (
    assert_same_step,
    dapo_step,
    max_weight_diff,
    ray_weights,
    tiny_cfg,
)

from dapo_core.distributed import ActorFailureError, RayExecutor, RayOptions, RewardPool, connect, shutdown
from dapo_core.distributed.executor import TrainerWeights
from dapo_core.distributed.faults import ManagedActor
from dapo_core.distributed.rollout_group import RolloutGroup, RolloutSleepError
from dapo_core.engines.executor import LocalExecutor, sampling_from
from dapo_core.engines.models import load_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a Ray hang fails the test, not CI


@pytest.fixture(scope="module")
def ray_session():
    cfg = tiny_cfg("unused")
    info = connect(cfg.resources)
    assert info.started_local and info.resources["CPU"] == 2.0
    yield info
    shutdown()
    assert not ray.is_initialized()


class Pair:
    def __init__(self, local: LocalExecutor, remote: RayExecutor) -> None:
        self.local, self.remote = local, remote
        self._steps = itertools.count(1)

    def step(self):
        step = next(self._steps)
        return dapo_step(self.local, step), dapo_step(self.remote, step)


@pytest.fixture(scope="module")
def pair(ray_session, tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("model") / "base")
    cfg = tiny_cfg(model_dir, **{"resources.rollout_workers": 2, "resources.trainer_world_size": 2})
    options = RayOptions(reward_timeout_s=5.0, max_actor_failures=2, start_timeout_s=120.0)
    remote = RayExecutor(cfg, options=options)
    yield Pair(LocalExecutor(cfg), remote)
    remote.shutdown()
    assert ray.is_initialized()  # the executor joined the module's session: it must not stop it


def test_dapo_step_equals_the_local_step_and_every_sync_bumps_the_version(pair):
    initial = ray_weights(pair.remote)
    for expected_version in (1, 2):
        a, b = pair.step()
        assert_same_step(a, b)
        assert b.metrics["num_updates"] == 3.0  # 5 groups in mini-batches of 2: the last piece is one group
        assert pair.remote.weight_version == pair.local.weight_version == expected_version
        assert pair.remote.rollout_versions() == [expected_version, expected_version]
        weights = ray_weights(pair.remote)
        assert max_weight_diff(pair.local, weights) <= 1e-6
    moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    assert moved > 1e-5  # the comparison is not between two untouched models


def test_rollout_worker_killed_mid_generate_is_restarted_and_the_step_still_matches(pair):
    victim = pair.remote.rollout.actors[1]
    pid_before = victim.node["pid"]
    ray.get(victim.handle.exit_on_next_generate.remote())
    a, b = pair.step()  # worker 1 exits inside generate; Ray restarts it; its share is retried on new weights
    assert_same_step(a, b)
    assert victim.failures == 1 and victim.node["pid"] != pid_before
    assert pair.remote.rollout_versions() == [b.version, b.version]
    assert max_weight_diff(pair.local, ray_weights(pair.remote)) <= 1e-6


def test_worker_restarted_between_steps_refuses_stale_weights_and_is_resynced(pair):
    victim = pair.remote.rollout.actors[0]
    pid_before = victim.node["pid"]
    ray.kill(victim.handle, no_restart=False)  # dies idle; Ray brings it back with the base model (version 0)
    while victim.node["pid"] == pid_before:  # wait for the new process (pytest-timeout bounds this loop)
        victim.wait_alive(60.0)
    assert ray.get(victim.handle.weight_version.remote()) == 0
    a, b = pair.step()  # generate refuses version 0; the controller pushes the latest weights and redoes the share
    assert_same_step(a, b)
    assert victim.failures == 1 and victim.last_cause.startswith("StaleWeightsError")
    assert max_weight_diff(pair.local, ray_weights(pair.remote)) <= 1e-6


def test_a_sync_streamed_in_small_buckets_leaves_every_worker_with_the_trainer_weights(pair):
    remote = pair.remote
    source = TrainerWeights(remote.trainers, limit_bytes=16 << 10, dtype="float32")  # the tiny model is ~76 kB
    plan = source.plan()
    trainer = ray_weights(remote)
    assert len(plan) >= 3 and sorted(n for bucket in plan for n in bucket) == sorted(trainer)
    stats = remote.rollout.stream_weights(source, remote.weight_version)
    expected = sum(t.numel() * t.element_size() for t in trainer.values())
    assert [(s["bytes"], s["buckets"]) for s in stats] == [(expected, len(plan))] * len(remote.rollout.actors)
    for actor in remote.rollout.actors:
        held = ray.get(actor.handle.__ray_call__.remote(lambda w: dict(w.backend.model.state_dict())))
        assert all(torch.equal(held[k].float(), trainer[k]) for k in trainer)


def test_a_generation_submitted_before_an_update_runs_while_the_update_does(pair):
    """rollout.mode=one_step_off's premise on Ray: the next step's generation, submitted just before this step's
    update, runs on the rollout workers while the trainer ranks update (their wall-clock spans intersect). The local
    executor takes the same update and sync, so the pair stays in step for the other tests."""
    ex = pair.remote
    batch = random_batch(0)
    batch.old_log_probs, _ = ex.compute_log_probs(batch)
    prompts = [ex.tokenizer.encode(f"Q: {a}+{b}\n") for a in range(16) for b in range(8)]
    pending = ex.submit_generate(prompts, plain_sampling(n=8, max_new_tokens=200, seed=7))  # ~1 s of decoding
    ex.update(batch)
    assert len(pending.result()) == 128 * 8
    spans = ex.phase_spans()
    gen_start, gen_end = min(s[1] for s in spans["rollout"][-2:]), max(s[2] for s in spans["rollout"][-2:])
    upd_start, upd_end = min(s[1] for s in spans["trainer"][-2:]), max(s[2] for s in spans["trainer"][-2:])
    assert gen_start < upd_start < gen_end, spans  # the update began while the generation was running
    assert gen_start < upd_end  # the two spans intersect
    pair.local.update(batch)
    assert pair.local.sync_weights() == ex.sync_weights()
    assert max_weight_diff(pair.local, ray_weights(ex)) <= 1e-6


def test_engines_that_do_not_release_memory_in_time_stop_the_update_with_the_knob(ray_session):
    @ray.remote
    class BusyWorker:  # a worker whose engine is still generating (one_step_off), as sleep() waits behind it
        def sleep(self) -> bool:
            time.sleep(30)
            return True

    group = RolloutGroup.__new__(RolloutGroup)
    group.actors = [ManagedActor("rollout worker", 0, BusyWorker.remote())]
    group.start_timeout_s, group.max_failures = 300.0, 2
    t0 = time.perf_counter()
    with pytest.raises(RolloutSleepError, match="rollout_sleep_timeout_s"):
        group.sleep(timeout_s=1.0)
    assert time.perf_counter() - t0 < 15  # the sleep's own timeout, not the start timeout
    ray.kill(group.actors[0].handle)


def test_checkpoint_and_export_go_through_rank0_and_restore_every_rank(pair, tmp_path):
    ckpt = pair.remote.save_checkpoint(tmp_path / "ckpts", 7, {"mlflow_run_id": "abc"})
    assert (ckpt / "model.safetensors").is_file()
    saved = load_model(str(ckpt)).state_dict()
    assert max_weight_diff(pair.local, saved) <= 1e-6
    exported = pair.remote.export_model(tmp_path / "export")
    assert max_weight_diff(pair.local, load_model(str(exported)).state_dict()) <= 1e-6
    meta = pair.remote.load_checkpoint(ckpt)
    assert meta["mlflow_run_id"] == "abc" and meta["step"] == 7
    assert meta["weight_version"] == pair.remote.weight_version
    assert pair.remote.rollout_versions() == [pair.remote.weight_version] * 2


def test_reward_item_that_sleeps_forever_is_failed_within_its_bound(ray_session):
    def reward(completion: str, ground_truth: str) -> dict:
        if completion == "HANG":
            time.sleep(10**6)
        if completion == "RAISE":
            raise ValueError("bad item")
        return {"score": 1.0 if completion == ground_truth else -1.0, "acc": completion == ground_truth, "pred": "x"}

    pool = RewardPool(reward, num_workers=2, item_timeout_s=1.0, start_timeout_s=60.0)
    try:
        texts = ["1", "HANG", "2", "RAISE", "3", "4"]
        start = time.monotonic()
        scored = pool.score(texts, ["1", "0", "0", "0", "3", "4"])
        elapsed = time.monotonic() - start
        assert scored.num_failed == 2
        assert [r["pred"] for r in scored.results][1:4:2] == ["[TIMEOUT]", "[ERROR]"]
        assert [r["acc"] for r in scored.results] == [True, False, False, False, True, True]
        assert [r["score"] for r in scored.results] == [1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
        assert 1.0 <= elapsed < 60.0  # waited for the bound, then moved on (the hung process was killed)
        again = pool.score(["HANG", "5"], ["0", "5"])  # the killed worker came back and the pool still works
        assert again.num_failed == 1 and again.results[1]["acc"]
    finally:
        pool.kill()


def test_reward_worker_killed_mid_step_gives_the_undisturbed_result(ray_session):
    """A reward worker SIGKILLed from outside while it scores: restarted, its item scored again, the batch's
    result identical to an undisturbed pool's; an item that kills its worker every time is a [CRASH] failure."""
    import os
    import signal
    import threading

    def slow_parity(completion: str, ground_truth: str) -> dict:  # defined here: Ray ships it by value
        if completion == "EXIT":  # an item that kills whatever worker scores it
            os._exit(1)
        time.sleep(0.2)
        ok = int(completion) % 2 == int(ground_truth) % 2
        return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": completion}

    texts, truths = [str(i) for i in range(12)], [str(i % 3) for i in range(12)]
    pool = RewardPool(slow_parity, num_workers=2, item_timeout_s=30.0, start_timeout_s=60.0)
    try:
        clean = pool.score(texts, truths)
        victim = pool.actors[0]
        pid = victim.node["pid"]
        threading.Timer(0.5, lambda: os.kill(pid, signal.SIGKILL)).start()  # mid-step: ~2 of its 6 items done
        disturbed = pool.score(texts, truths)
        assert victim.node["pid"] != pid  # it was killed and came back
        assert disturbed.num_failed == 0 and disturbed.results == clean.results
        killer = pool.score(["1", "EXIT", "3"], ["1", "0", "1"])
        assert killer.num_failed == 1 and [r["pred"] for r in killer.results] == ["1", "[CRASH]", "3"]
    finally:
        pool.kill()


def test_the_failure_limit_raises_an_error_naming_actor_node_and_cause(pair):
    victim = pair.remote.rollout.actors[1]
    victim.failures = pair.remote.options.max_actor_failures - 1  # one more failure reaches the limit
    ray.get(victim.handle.exit_on_next_generate.remote())
    with pytest.raises(ActorFailureError) as info:
        pair.remote.generate([[5, 6, 7]] * 2, sampling_from(pair.remote.cfg, seed=1))
    message = str(info.value)
    assert "rollout worker 1" in message and f"node {victim.node['ip']}" in message
    # a process that exits mid-call reads as died or (while Ray notices) unavailable; either way it is named
    assert info.value.cause.startswith(("ActorDiedError", "ActorUnavailableError")) and info.value.node in message
    assert "max_actor_failures=2" in message
