"""The DVC round trip in a throwaway git repo: `dapo data generate` + `dvc add data`, `dvc repro` (curate stage
of the project's dvc.yaml), a second repro is a no-op, a curation param change reruns it, an unrelated param does
not, and a deleted data/ is re-created bit-identically (a fresh clone needs no remote)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest_data import REPO
from mlflow.tracking import MlflowClient

from dapo_core.data.loaders import file_md5
from dapo_core.data.schema import read_rl_parquet

pytestmark = pytest.mark.slow  # three `dapo` commands and three DVC runs (~1 min on 2 busy cores)

CODE_DEPS = ["dapo_core/data", "dapo_core/rewards/math_dapo.py", "dapo_core/engines/tokenizer.py", "tasks/data.py",
             "flows/curate.py"]  # fmt: skip
OUTS = ["train.parquet", "val.parquet", "card.json", "card.md"]


def _run(repo: Path, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _set_val_size(repo: Path, value: int) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["curation"]["val_size"] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def repo(tmp_path, prefect_api):
    """A git + DVC repo holding the project's dvc.yaml, params.yaml (+ a small curation section), code deps."""
    root = tmp_path / "clone"
    root.mkdir()
    for rel in ["dvc.yaml", ".dvcignore", ".gitignore", *CODE_DEPS]:  # .gitignore: outputs/ is ignored there
        src, dst = REPO / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    # only the curate stage: this test is about curation (the later stages train models)
    pipeline = yaml.safe_load((root / "dvc.yaml").read_text())
    pipeline["stages"] = {"curate": pipeline["stages"]["curate"]}
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params.setdefault("curation", {}).update({"val_size": 20, "synthetic": {"n": 300}})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    bin_dir = str(Path(sys.executable).parent)  # after PATH: an activated venv (or a test shim) comes first
    env = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}{os.pathsep}{bin_dir}", "DVC_NO_ANALYTICS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    env["PREFECT_API_URL"] = prefect_api
    _run(root, env, "git", "init", "-q")
    _run(root, env, "dvc", "init", "-q")
    return root, env


def test_dvc_round_trip(repo):
    root, env = repo
    _run(root, env, "dapo", "data", "generate")
    _run(root, env, "dvc", "add", "-q", "data")
    recorded = yaml.safe_load((root / "data.dvc").read_text())["outs"][0]["md5"]

    out = _run(root, env, "dvc", "repro")
    assert "Running stage 'curate'" in out
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["curate"]
    lock_md5 = {Path(o["path"]).name: o["md5"] for o in lock["outs"]}
    assert lock_md5 == {name: file_md5(root / "outputs/curated" / name) for name in OUTS}
    assert next(d["md5"] for d in lock["deps"] if d["path"] == "data") == recorded
    assert len(read_rl_parquet(root / "outputs/curated/val.parquet")) == 20

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("dapo-flow").experiment_id])
    assert {name: run.data.tags[f"dvc.md5.{name}"] for name in OUTS} == lock_md5  # the run names DVC's versions
    assert (run.data.tags["data.dvc_md5"], run.data.tags["data.dvc_matches"]) == (recorded, "true")
    card = json.loads((root / "outputs/curated/card.json").read_text())
    assert run.data.tags["data.digest"] == card["dataset_digest"]

    out = _run(root, env, "dvc", "repro")
    assert "Running stage" not in out and "didn't change" in out
    assert "up to date" in _run(root, env, "dvc", "status")

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["trainer"]["lr"] = 0.5  # not a curate param: the stage stays up to date
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert "up to date" in _run(root, env, "dvc", "status")

    _set_val_size(root, 30)
    status = _run(root, env, "dvc", "status")
    assert "curate" in status and "curation" in status
    assert "Running stage 'curate'" in _run(root, env, "dvc", "repro")
    assert len(read_rl_parquet(root / "outputs/curated/val.parquet")) == 30
    assert len(client.search_runs([run.info.experiment_id])) == 2

    shutil.rmtree(root / "data")  # what a fresh clone has: no data/, no remote
    assert "deleted" in _run(root, env, "dvc", "status", "data.dvc")
    _run(root, env, "dapo", "data", "generate")
    assert "up to date" in _run(root, env, "dvc", "status")  # bit-identical: data.dvc and dvc.lock match
