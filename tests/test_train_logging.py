"""The train flow's validation task: one fixed sampling seed for every step, so the curve compares like with like.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_train_logging.py -q
"""

from __future__ import annotations

from typing import Any

from train_fixtures import make_train_cfg

from dapo_core.data.schema import read_rl_parquet
from dapo_core.engines.executor import LocalExecutor
from dapo_core.training.prompts import encode_prompts
from tasks import tracking
from tasks.evaluate import evaluate_items
from tasks.train_logging import validate


def test_validation_at_different_steps_of_an_unchanged_policy_gives_identical_metrics(tmp_path, monkeypatch):
    logged: list[tuple[str, Any]] = []
    monkeypatch.setattr(tracking, "log_table", lambda rows, name, **_: logged.append((name, rows)))
    monkeypatch.setattr(tracking, "log_metrics", lambda metrics, step, **_: logged.append((f"step {step}", metrics)))
    cfg = make_train_cfg(tmp_path, "rollout.val_n=4")
    with LocalExecutor(cfg) as executor:
        items = encode_prompts(read_rl_parquet(cfg.data.val_files[0]), executor.tokenizer, max_prompt_length=64)
        first = validate.fn(executor, items, cfg, step=2)
        second = validate.fn(executor, items, cfg, step=4)
        # the noise this guards against: per-step seeds do give different samples of this policy
        per_step = [evaluate_items(executor, items, cfg, seed_parts=("val", s))[1] for s in (2, 4)]
    for metrics in (first, second):
        assert metrics.pop("timing_s/testing") >= 0  # wall time: the one value allowed to differ
    assert first == second and any(k.endswith("response_length/mean") for k in first)
    assert logged[0][1] == logged[1][1]  # the same sample table at both steps
    assert [name for name, _ in logged] == ["samples/step_000002.json", "samples/step_000004.json"]
    assert per_step[0] != per_step[1], "per-step seeds should differ here, else this test proves nothing"


def test_validation_before_training_also_logs_the_metrics_at_step_zero(tmp_path, monkeypatch):
    logged: dict[str, Any] = {}
    monkeypatch.setattr(tracking, "log_table", lambda rows, name, **_: logged.setdefault("table", name))
    monkeypatch.setattr(tracking, "log_metrics", lambda metrics, step, **_: logged.setdefault("step", step))
    cfg = make_train_cfg(tmp_path)
    with LocalExecutor(cfg) as executor:
        items = encode_prompts(read_rl_parquet(cfg.data.val_files[0]), executor.tokenizer, max_prompt_length=64)
        validate.fn(executor, items, cfg, step=0)
    assert logged == {"table": "samples/step_000000.json", "step": 0}
