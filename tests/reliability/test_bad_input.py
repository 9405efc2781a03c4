"""Bad input through `dapo train`: a missing model, unreadable or wrong-schema data, an empty training set, a full
disk while writing a checkpoint. Each ends in one clear error line (what, where, how to fix; exit 2), and
nothing already produced is lost. Bad config values, unknown recipes and malformed overrides: tests/test_cli.py."""

from __future__ import annotations

import errno

import pandas as pd
import pytest
from prefect.testing.utilities import prefect_test_harness
from train_fixtures import make_train_cfg
from typer.testing import CliRunner

from dapo_core.config import dump_yaml
from dapo_core.engines.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def train(cfg, root, *args):
    from flows.cli import app

    (root / "cfg.yaml").write_text(dump_yaml(cfg))
    return CliRunner().invoke(app, ["train", "--config", str(root / "cfg.yaml"), *args])


def _clear_error(result, *needles):
    """Exit 2 and a last line `error: ...` naming each needle (Prefect's own log lines may come before it)."""
    assert result.exit_code == 2, result.output[-3000:] + repr(result.exception)
    err = result.stderr[result.stderr.rfind("error: ") :]
    assert err.startswith("error: "), result.stderr[-3000:]
    for needle in needles:
        assert needle in " ".join(err.split()), (needle, err)


def test_missing_model(tmp_path):
    cfg = make_train_cfg(tmp_path, f"model.path={tmp_path}/no-such-model")
    _clear_error(train(cfg, tmp_path), f"{tmp_path}/no-such-model", "model.path")


def test_unreadable_training_data(tmp_path):
    cfg = make_train_cfg(tmp_path)
    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    _clear_error(train(cfg, tmp_path), str(bad))


def test_wrong_schema_training_data(tmp_path):
    cfg = make_train_cfg(tmp_path)
    pd.DataFrame({"question": ["1+1"], "answer": ["2"]}).to_parquet(tmp_path / "train.parquet")
    _clear_error(train(cfg, tmp_path), str(tmp_path / "train.parquet"), "prompt")


def test_empty_training_set(tmp_path):
    cfg = make_train_cfg(tmp_path)
    full = pd.read_parquet(tmp_path / "train.parquet")
    full.iloc[:0].to_parquet(tmp_path / "train.parquet")
    _clear_error(train(cfg, tmp_path), str(tmp_path / "train.parquet"))


def test_full_disk_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import dapo_core.engines.checkpoint as ckpt

    cfg = make_train_cfg(tmp_path, "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=0")
    root = tmp_path / "outputs" / "t" / "checkpoints"
    real_save = ckpt.torch.save

    def full_disk_at_step_4(obj, f, *a, **k):
        if "step_4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk_at_step_4)
    result = train(cfg, tmp_path)
    _clear_error(result, "step-4 checkpoint", "No space left on device", "step_2", "dapo train --resume")
    assert [s for s, _ in list_checkpoints(root)] == [2]  # the previous checkpoint is intact
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written kept
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    resumed = train(cfg, tmp_path, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]
