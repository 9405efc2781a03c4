"""Resume at the edges users of RL libraries hit: a checkpoint exactly on an epoch boundary of the prompt sampler, a
resume with a changed config (refused, the keys named, unless --force), a resume of a run that already finished
(says so, does nothing), and of one killed after its final model but before its end (finishes it)."""

from __future__ import annotations

import pytest
import torch
from train_fixtures import make_train_cfg
from train_fixtures import metric_history as history
from train_fixtures import run_train as run

from dapo_core.algorithm import metric_names as mn
from flows.train import ResumeConfigError, config_changes

pytestmark = pytest.mark.slow

# 16 training prompts, 4 per step, dynamic sampling off: every 4th step ends an epoch of the prompt sampler
EPOCH = ("data.train_batch_size=4", "data.gen_batch_size=4", "algorithm.dynamic_sampling.enable=false")


@pytest.fixture(scope="module", autouse=True)
def prefect_harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


def _weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_a_checkpoint_on_an_epoch_boundary_resumes_bit_for_bit(tmp_path, monkeypatch):
    import flows.train as ft

    base = (*EPOCH, "trainer.total_steps=6", "trainer.save_freq=4", "trainer.test_freq=0")
    straight = run(make_train_cfg(tmp_path / "a", *base, "tracking.run_name=straight"), tmp_path / "a")
    cfg = make_train_cfg(tmp_path / "b", *base, "tracking.run_name=edge")
    real_step = ft._train_step
    epochs_at_crash = []

    def crash_at_5(run_state, step):
        if step == 5:
            epochs_at_crash.append(run_state.sampler.state_dict())
            raise RuntimeError("simulated crash in step 5, right after the epoch-boundary checkpoint")
        return real_step(run_state, step)

    monkeypatch.setattr(ft, "_train_step", crash_at_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, tmp_path / "b")
    monkeypatch.setattr(ft, "_train_step", real_step)
    resumed = run(cfg, tmp_path / "b", resume=True)

    # the crash came right after the sampler had handed out exactly one epoch (16 prompts, 4 steps of 4)
    state = epochs_at_crash[0]
    assert state["num_items"] == 16 and state["offset"] in (0, 16), state
    keys = [k for k in mn.training_metric_names() if not k.startswith(("timing_s/", "perf/"))]
    for k in keys:
        a, b = history(straight["run_id"], k), history(resumed["run_id"], k)
        assert [s for s, _ in b] == [1, 2, 3, 4, 5, 6], k  # steps 5 and 6 ran (not zero steps), none twice
        assert [v for _, v in b] == [v for _, v in a], k
    wa, wb = _weights(straight["final_model"]), _weights(resumed["final_model"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_refuses_a_changed_config_naming_the_keys_unless_forced(tmp_path, monkeypatch):
    import flows.train as ft

    cfg = make_train_cfg(tmp_path, *EPOCH, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=0")
    real_step = ft._train_step

    def crash_at_2(run_state, step):
        if step == 2:
            raise RuntimeError("simulated crash")
        return real_step(run_state, step)

    monkeypatch.setattr(ft, "_train_step", crash_at_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, tmp_path)
    monkeypatch.setattr(ft, "_train_step", real_step)

    changed = make_train_cfg(tmp_path, *EPOCH, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=0",
                             "trainer.lr=0.05", "algorithm.clip_high=0.3")  # fmt: skip
    with pytest.raises(ResumeConfigError) as err:
        run(changed, tmp_path, resume=True)
    msg = str(err.value)
    assert "trainer.lr" in msg and "algorithm.clip_high" in msg and "--force" in msg and "2 key(s)" in msg
    assert not (tmp_path / "outputs" / "t" / "final").exists()  # refused before any work
    # --force continues with the new values, from the checkpoint (step 1), exactly once per step
    forced = run(changed, tmp_path, resume=True, force=True)
    assert [s for s, _ in history(forced["run_id"], "train/step")] == [1, 2, 3]
    # running longer, saving or validating more often is not a changed config
    same = {"trainer.total_steps": "3", "trainer.save_freq": "1", "trainer.lr": "0.1"}
    assert config_changes(same, {**same, "trainer.total_steps": "9", "trainer.save_freq": "2"}) == {}
    assert config_changes(same, {**same, "trainer.lr": "0.2"}) == {"trainer.lr": ("0.1", "0.2")}


def test_resume_of_a_finished_run_says_so_and_does_nothing(tmp_path):
    cfg = make_train_cfg(tmp_path, *EPOCH, "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=0")
    done = run(cfg, tmp_path)
    final = tmp_path / "outputs" / "t" / "final" / "model.safetensors"
    mtime = final.stat().st_mtime_ns
    again = run(cfg, tmp_path, resume=True)
    assert again["already_finished"] is True and again["run_id"] == done["run_id"]
    assert final.stat().st_mtime_ns == mtime  # nothing rewritten
    assert [s for s, _ in history(done["run_id"], "train/step")] == [1, 2]  # nothing logged twice


def test_resume_after_a_kill_between_the_final_model_and_the_run_end_finishes_the_run(tmp_path):
    """Killed after writing final/ but before registering the model and ending the MLflow run: the run is still
    RUNNING, so `--resume` is not "already finished": it runs no step, registers the model and ends the run."""
    from mlflow.tracking import MlflowClient

    cfg = make_train_cfg(tmp_path, *EPOCH, "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=0")
    done = run(cfg, tmp_path)
    client = MlflowClient()  # the store the run used ($MLFLOW_TRACKING_URI beats the file's tracking.uri)
    client.update_run(done["run_id"], status="RUNNING")  # what the kill leaves in the store
    again = run(cfg, tmp_path, resume=True)
    assert not again.get("already_finished") and again["run_id"] == done["run_id"]
    assert client.get_run(done["run_id"]).info.status == "FINISHED"
    assert again["registered_model"] is not None and (tmp_path / "outputs" / "t" / "final").is_dir()
    assert [s for s, _ in history(done["run_id"], "train/step")] == [1, 2]  # no step run or logged twice
    assert run(cfg, tmp_path, resume=True)["already_finished"] is True  # and now it is finished
