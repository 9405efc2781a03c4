"""Bad input through `dapo train`: a missing model, unreadable or wrong-schema data, an empty training set, a full
disk while writing a checkpoint; through `dapo curate`: a source file changed while the curation reads it or works
on it. Each ends in one clear error line (what, where, how to fix; exit 2), and nothing already produced is lost.
Bad config values, unknown recipes and malformed overrides: tests/test_cli.py."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from train_fixtures import make_train_cfg
from typer.testing import CliRunner

from dapo_core.config import dump_yaml
from dapo_core.data import loaders
from dapo_core.data.loaders import SourceSpec, get_loader
from dapo_core.engines.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def prefect_harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


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


# ---- a source file changed under a running curation ----

TOUCHED: list[str] = []  # files the "test-touching" loader appends a line to, right after it has read its own


def _touching_jsonl(spec: SourceSpec):
    """Reads a jsonl source like the real loader, then another writer appends a problem to each file in TOUCHED."""
    rows = get_loader("jsonl")(spec)
    for path in TOUCHED:
        with open(path, "a") as f:
            f.write(json.dumps({"problem": "Q: 1 + 1", "answer": "2"}) + "\n")
    return rows


def _curate(root, sources, out="curated"):
    from flows.cli import app

    problems = [{"problem": f"Q: {i} + {i}", "answer": str(2 * i)} for i in range(60)]
    for name, _ in sources:
        part = problems[:30] if name == "a.jsonl" else problems[30:]
        (root / name).write_text("".join(json.dumps(p) + "\n" for p in part))
    cfg = yaml.safe_load((REPO / "params.yaml").read_text())  # the default (tiny) config, these sources
    cfg["curation"] = {"sources": [{"path": str(root / n), "format": f} for n, f in sources], "val_size": 5}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    args = ["curate", "--config", str(root / "cfg.yaml"), "--no-track", "--output-dir", str(root / out)]
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("when", ["while it was being read", "after it was read"])
def test_a_source_changed_under_a_running_curation_is_refused_and_keeps_the_last_output(tmp_path, when, monkeypatch):
    monkeypatch.setitem(loaders._LOADERS, "test-touching", _touching_jsonl)  # for this test only
    TOUCHED.clear()
    done = _curate(tmp_path, [("a.jsonl", "jsonl"), ("b.jsonl", "jsonl")])
    assert done.exit_code == 0, done.output
    before = {p.name: p.read_bytes() for p in (tmp_path / "curated").iterdir()}
    assert {"train.parquet", "val.parquet", "card.json", "card.md"} <= before.keys()

    # b's loader writes to b itself (during its own read), or to a (read before it: a changes mid-curation)
    changed = tmp_path / ("b.jsonl" if when.startswith("while") else "a.jsonl")
    TOUCHED.append(str(changed))
    try:
        again = _curate(tmp_path, [("a.jsonl", "jsonl"), ("b.jsonl", "test-touching")])
    finally:
        TOUCHED.clear()
    _clear_error(again, str(changed), f"changed {when}", "Nothing was written", "again")
    assert {p.name: p.read_bytes() for p in (tmp_path / "curated").iterdir()} == before  # the last output, whole
