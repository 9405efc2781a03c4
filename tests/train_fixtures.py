"""Fixtures for train-flow tests: a tiny model dir, tiny verl parquet files, a test reward with variance."""

from __future__ import annotations

from pathlib import Path

from _tiny import tiny_model_dir

from dapo_core.config import load_config
from dapo_core.data.schema import write_rl_parquet
from dapo_core.data.synthetic import generate_problems, synthetic_records
from dapo_core.rewards import register_reward


@register_reward("test_even_length")
def even_length_reward(completion: str, ground_truth: str) -> dict:
    """A reward with variance for an untrained model: +1 when the response has an even number of characters."""
    ok = len(completion) % 2 == 0
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": str(len(completion))}


def write_dataset(root: Path, n_train: int = 16, n_val: int = 4, seed: int = 0) -> tuple[Path, Path]:
    records = synthetic_records(generate_problems(n_train + n_val, seed=seed, max_ops=2))
    train = write_rl_parquet(records[:n_train], root / "train.parquet")
    val = write_rl_parquet(records[n_train:], root / "val.parquet")
    return train, val


def make_train_cfg(root: Path, *extra: str, recipe: str = "tiny-dapo"):
    model_dir = root / "model"
    if not model_dir.exists():
        tiny_model_dir(model_dir)
    train, val = write_dataset(root)
    sets = [
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"tracking.artifact_location={root}/mlartifacts",
        "tracking.log_system_metrics=false",
        "tracking.run_name=t",
        f"trainer.output_dir={root}/outputs",
        "trainer.total_steps=3",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        "trainer.lr=0.02",
        "trainer.lr_warmup_steps=0",  # the tests size their expectations to full-lr Adam steps from step 1
        "trainer.micro_batch_size=16",
        "trainer.ppo_mini_batch_size=1",
        "data.train_batch_size=4",
        "data.gen_batch_size=4",
        "rollout.n=4",
        "rollout.val_n=2",
        "data.max_response_length=16",
        "algorithm.overlong.buffer_length=4",
        "algorithm.reward_fn=test_even_length",
        *extra,
    ]
    return load_config(recipe=recipe, overrides=sets, env={})


@register_reward("test_slow_even_length")
def slow_even_length_reward(completion: str, ground_truth: str) -> dict:
    """test_even_length taking 50 ms a sample: a run slow enough to outlast a stopped tracking server."""
    import time

    time.sleep(0.05)
    return even_length_reward(completion, ground_truth)


@register_reward("test_half_hopeless")
def half_hopeless_reward(completion: str, ground_truth: str) -> dict:
    """Zero-variance groups on purpose: prompts with an even ground truth can never be solved (all -1)."""
    ok = int(ground_truth) % 2 != 0 and len(completion) % 2 == 0
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": str(len(completion))}


@register_reward("test_always_wrong")
def always_wrong_reward(completion: str, ground_truth: str) -> dict:
    """No group ever has signal (a model that solves nothing yet)."""
    return {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def run_train(cfg, root: Path, **kw):
    """``train_flow`` on ``cfg`` written to ``root/cfg.yaml`` (needs a Prefect API: the harness or a server)."""
    from dapo_core.config import dump_yaml
    from flows.train import train_flow

    cfg_file = root / "cfg.yaml"
    cfg_file.write_text(dump_yaml(cfg))
    return train_flow(config_path=str(cfg_file), **kw)


def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of a run of the current MLflow store, by step."""
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: m.step)]
