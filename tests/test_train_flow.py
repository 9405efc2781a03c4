"""The DAPO training flow end to end: real Prefect (test harness), MLflow on SQLite, the local executor."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from train_fixtures import make_train_cfg
from train_fixtures import metric_history as history
from train_fixtures import run_train as run

from dapo_core.algorithm import metric_names as mn
from flows.train import train_flow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def prefect_harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


def test_three_steps_log_every_metric_and_checkpoint(tmp_path):
    cfg = make_train_cfg(tmp_path)
    summary = run(cfg, tmp_path)
    rid = summary["run_id"]
    client = MlflowClient()
    data = client.get_run(rid).data
    for name in mn.training_metric_names():
        # save_freq=2 and the last step; test_freq=2 plus validation before training (step 0)
        want = {"timing_s/save_checkpoint": [2, 3], "timing_s/testing": [0, 2]}.get(name, [1, 2, 3])
        assert [s for s, _ in history(rid, name)] == want, name
    assert [v for _, v in history(rid, "train/step")] == [1.0, 2.0, 3.0]
    assert [s for s, _ in history(rid, "val/synthetic/acc/mean_at_2")] == [0, 2]
    assert {a.path for a in client.list_artifacts(rid, "samples")} == {
        "samples/step_000000.json",
        "samples/step_000002.json",
    }
    # 4 mini-batches of one group per step: the first is on-policy, later ones drift off it at this lr, so
    # clipping binds in the last mini-batch of every step (measured 22-37% of its tokens), on both sides of the
    # clip range (measured 6-12% of the step's tokens each), and each clipped token is on exactly one side
    assert all(v == 4.0 for _, v in history(rid, "actor/num_updates"))
    assert all(v > 0.1 for _, v in history(rid, "actor/pg_clipfrac_last"))
    clip = {k: [v for _, v in history(rid, f"actor/pg_clipfrac{k}")] for k in ("", "_high", "_low")}
    assert all(high > 0.02 and low > 0.02 for high, low in zip(clip["_high"], clip["_low"], strict=True)), clip
    assert clip[""] == pytest.approx([h + lo for h, lo in zip(clip["_high"], clip["_low"], strict=True)]), clip
    # counters never mix: gen batches total >= steps and is cumulative
    gb = [v for _, v in history(rid, "train/gen_batches_total")]
    assert gb == sorted(gb) and gb[-1] >= 3
    assert data.params["trainer.lr"] == "0.02" and data.tags["recipe"] == "tiny-dapo"
    assert data.tags["git.sha"] and data.tags["data.train_digest"]
    arts = {a.path for a in client.list_artifacts(rid)}
    assert {"checkpoints", "model", "plots"} <= arts
    assert {a.path for a in client.list_artifacts(rid, "checkpoints")} == {"checkpoints/step_2", "checkpoints/step_3"}
    # the registered model loads back with from_pretrained
    import mlflow
    from transformers import AutoModelForCausalLM

    local = mlflow.artifacts.download_artifacts(summary["registered_model"])
    model = AutoModelForCausalLM.from_pretrained(local)
    final = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, final.state_dict()[k])


def metric_table(rid, keys):
    return {k: history(rid, k) for k in keys}


def test_resume_after_a_crash_gives_identical_weights_and_history(tmp_path, monkeypatch):
    import flows.train as ft

    base = ("trainer.total_steps=4", "trainer.save_freq=2")
    straight = run(make_train_cfg(tmp_path / "a", *base, "tracking.run_name=straight"), tmp_path / "a")

    cfg = make_train_cfg(tmp_path / "b", *base, "tracking.run_name=crashy")
    real_step = ft._train_step

    def crash_at_4(run_state, step):
        if step == 4:
            raise RuntimeError("simulated crash in step 4")
        return real_step(run_state, step)

    monkeypatch.setattr(ft, "_train_step", crash_at_4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, tmp_path / "b")
    monkeypatch.setattr(ft, "_train_step", real_step)
    resumed = run(cfg, tmp_path / "b", resume=True)

    keys = [k for k in mn.training_metric_names() if not k.startswith(("timing_s/", "perf/"))]
    a = metric_table(straight["run_id"], keys)
    b = metric_table(resumed["run_id"], keys)
    for k in keys:
        assert [s for s, _ in b[k]] == [1, 2, 3, 4], k  # exactly one value per step, step 3 not twice
        assert [v for _, v in b[k]] == [v for _, v in a[k]], k
    from transformers import AutoModelForCausalLM

    wa = AutoModelForCausalLM.from_pretrained(straight["final_model"]).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(resumed["final_model"]).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dynamic_sampling_accumulates_generation_batches(tmp_path):
    cfg = make_train_cfg(
        tmp_path,
        "algorithm.reward_fn=test_half_hopeless",
        "trainer.total_steps=2",
        "algorithm.dynamic_sampling.max_num_gen_batches=20",
        "trainer.save_freq=0",
    )
    rid = run(cfg, tmp_path)["run_id"]
    nb = [v for _, v in history(rid, "train/num_gen_batches")]
    kept = [v for _, v in history(rid, "train/kept_groups_frac")]
    assert max(nb) >= 2 and all(k < 1.0 for k in kept)
    assert all(v == 4.0 for _, v in history(rid, "train/num_groups"))  # the batch is full every step
    totals = [v for _, v in history(rid, "train/gen_batches_total")]
    assert totals == [nb[0], nb[0] + nb[1]]


def test_grpo_recipe_runs_without_dynamic_sampling(tmp_path):
    # the whole batch in one mini-batch: the only update is on-policy (pi_old = pi_theta)
    sets = ("trainer.total_steps=1", "trainer.save_freq=0", "trainer.ppo_mini_batch_size=4")
    rid = run(make_train_cfg(tmp_path, *sets, recipe="tiny-grpo"), tmp_path)["run_id"]
    assert [v for _, v in history(rid, "train/num_gen_batches")] == [1.0]
    # on-policy: the ratio is 1 on every token, so nothing clips and the KL estimate is 0 (measured: exactly 0.0).
    # pi_old log-probs that are not the policy's own show here (checked: scaled by 1.05, 65% of the tokens clip)
    assert [v for _, v in history(rid, "actor/num_updates")] == [1.0]
    assert [v for _, v in history(rid, "actor/pg_clipfrac")] == [0.0]
    assert history(rid, "actor/ppo_kl")[0][1] == pytest.approx(0.0, abs=1e-6)
    assert MlflowClient().get_run(rid).data.params["algorithm.loss_agg"] == "seq-mean-token-mean"


def test_decode_processes_train_the_same_run_and_stop_with_it(tmp_path, monkeypatch):
    """``rollout.hf_procs=2`` through the flow (Prefect tasks, weight changes every step, validation decodes):
    the same samples, so the same metrics, as one process; the decode processes end with the flow."""
    import multiprocessing

    from dapo_core.engines.rollout.decode_procs import DecodeProcesses

    calls = []
    decode = DecodeProcesses.decode
    monkeypatch.setattr(DecodeProcesses, "decode", lambda self, *a: calls.append(len(a[0])) or decode(self, *a))
    sets = ("trainer.total_steps=2", "trainer.save_freq=0")
    one = run(make_train_cfg(tmp_path / "one", *sets), tmp_path / "one")["run_id"]
    assert calls == []
    two = run(make_train_cfg(tmp_path / "two", *sets, "rollout.hf_procs=2"), tmp_path / "two")["run_id"]
    assert sum(calls) >= 2 * 4 * 4  # every training row (2 steps x 4 prompts x 4 samples) went through them
    assert MlflowClient().get_run(two).data.params["rollout.hf_procs"] == "2"
    for name in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "val/synthetic/acc/mean_at_2"):
        a, b = history(one, name), history(two, name)
        assert [s for s, _ in a] == [s for s, _ in b] and a, name
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-5), name
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("dapo-decode")]


def test_bad_recipe_value_fails_before_any_work(tmp_path):
    from dapo_core.config import ConfigError

    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        train_flow(recipe="tiny-dapo", overrides=["trainer.ppo_mini_batch_size=7", f"trainer.output_dir={tmp_path}/o"])
    assert not (tmp_path / "o").exists()


def test_the_same_flow_runs_on_the_ray_executor(tmp_path, monkeypatch):
    """resources.executor=ray: same flow code, same step results as the in-process executor."""
    import os
    from pathlib import Path

    # Ray workers unpickle the test reward by reference: they must be able to import this test folder
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    base = ("trainer.total_steps=2", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false")
    local = run(make_train_cfg(tmp_path / "l", *base, "tracking.run_name=local"), tmp_path / "l")
    ray_cfg = make_train_cfg(tmp_path / "r", *base, "tracking.run_name=ray", "resources.executor=ray")
    on_ray = run(ray_cfg, tmp_path / "r")
    for key in ("train/acc/mean", "critic/rewards/mean", "response_length/mean", "train/num_gen_batches"):
        assert history(on_ray["run_id"], key) == history(local["run_id"], key), key
    for key in ("actor/pg_loss", "actor/entropy"):
        for (s1, v1), (s2, v2) in zip(history(on_ray["run_id"], key), history(local["run_id"], key), strict=True):
            assert s1 == s2 and v1 == pytest.approx(v2, abs=1e-4), key
    # the rollout/trainer mismatch is logged every step; hf samples with the trainer's own module (local) or a
    # weight-synced copy of it (the Ray rollout actor): ~0 either way
    for run_id in (local["run_id"], on_ray["run_id"]):
        worst = history(run_id, "mismatch/logp_abs_diff_max")
        assert [s for s, _ in worst] == [1, 2] and max(v for _, v in worst) < 1e-5, worst
        assert max(v for _, v in history(run_id, "mismatch/prob_abs_diff_max")) < 1e-5
    from transformers import AutoModelForCausalLM

    wl = AutoModelForCausalLM.from_pretrained(local["final_model"]).state_dict()
    wr = AutoModelForCausalLM.from_pretrained(on_ray["final_model"]).state_dict()
    # Adam at lr 0.02 moves each weight ~0.02 per step and turns float-order noise in tiny gradients (thread
    # counts differ between the actors and this process) into per-element differences: up to 1.1e-4 seen on fresh
    # clones; 5e-4 is 2.5% of one step. (Adam is scale-invariant: the loss/entropy checks above catch scaling bugs.)
    for k in wl:
        torch.testing.assert_close(wr[k], wl[k], rtol=1e-3, atol=5e-4)


def test_no_signal_skips_the_update_gracefully_or_fails_clearly(tmp_path):
    from dapo_core.algorithm import DynamicSamplingExhausted

    common = ("algorithm.reward_fn=test_always_wrong", "trainer.total_steps=2", "trainer.save_freq=0",
              "algorithm.dynamic_sampling.max_num_gen_batches=2", "trainer.val_before_train=false")  # fmt: skip
    cfg = make_train_cfg(tmp_path / "g", *common, "algorithm.dynamic_sampling.on_exhausted=continue")
    rid = run(cfg, tmp_path / "g")["run_id"]
    assert [v for _, v in history(rid, "train/update_skipped")] == [1.0, 1.0]
    assert [v for _, v in history(rid, "train/zero_std_groups_frac")] == [1.0, 1.0]
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches"):
        run(make_train_cfg(tmp_path / "e", *common, "algorithm.dynamic_sampling.on_exhausted=error"), tmp_path / "e")
