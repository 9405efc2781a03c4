"""The team stack's fixtures for tests/test_stack.py: a throwaway project (git + DVC, the project's files, a tiny
params.yaml, the raw data added to DVC) and the stack started on it on free ports by the CLI, stopped on the way out
with nothing of it left running."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest_data import REPO

from dapo_core.config import dump_yaml, load_config
from flows.services import postgres, stack
from flows.services.ui import free_port, port_in_use

BIN = Path(sys.executable).parent
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
TINY = [
    "curation.synthetic.n=400", "curation.val_size=12", "base_model.steps=4", "base_model.batch_size=8",
    "base_model.micro_batch_size=8", "base_model.heldout_size=6", "base_model.heldout_k=2",
    "base_model.warmup_steps=0", "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64", "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=0",
    "trainer.val_before_train=false", "data.train_batch_size=4", "data.gen_batch_size=4",
    "trainer.ppo_mini_batch_size=2", "rollout.n=4", "rollout.val_n=2", "data.max_response_length=24",
    "algorithm.overlong.buffer_length=6", "algorithm.dynamic_sampling.enable=false", "control.pipeline=[]",
    "tracking.log_system_metrics=false", "resources.num_cpus=2",
]  # fmt: skip
PROJECT_FILES = ["dvc.yaml", ".dvcignore", ".gitignore", "prefect.yaml", "dapo_core", "tasks", "flows"]


def run_ok(cwd: Path, env: dict[str, str], *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


def wait_for(check: Any, timeout: float, what: str, logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(1.0)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log")))
    raise AssertionError(f"{what}: not within {timeout:.0f}s\n{tails}")


@pytest.fixture(scope="module", name="project")
def project_fixture(tmp_path_factory) -> Path:
    """A git + DVC repo with the project's files, a tiny params.yaml and the raw data added to DVC."""
    root = tmp_path_factory.mktemp("team") / "project"
    root.mkdir()
    for rel in PROJECT_FILES:
        src, dst = REPO / rel, root / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    cfg = load_config(recipe="tiny-dapo", overrides=TINY, env={})
    (root / "params.yaml").write_text(dump_yaml(cfg))
    env = clean_env()
    for cmd in (
        ["git", "init", "-q"],
        ["dvc", "init", "-q"],
        ["dapo", "data", "generate"],
        ["dvc", "add", "-q", "data"],
    ):
        run_ok(root, env, *cmd)
    run_ok(root, env, "git", "add", "-A")
    run_ok(root, env, "git", "commit", "-qm", "the project")
    return root


def descendants(pids: list[int]) -> set[int]:
    found = set(pids)
    for pid in pids:
        try:
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module", name="team")
def team_fixture(project) -> Iterator[stack.StackSettings]:
    """`dapo stack start` (the CLI, as `make stack` runs it) on free ports; on the way out `dapo stack stop`, and
    nothing it started may be left running."""
    try:
        postgres.bin_dir()
    except postgres.PostgresError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the stack test: {exc}")
        pytest.skip(str(exc))
    # PostgreSQL runs as its own user when we are root: its folder must be reachable (pytest's tmp folders are 0700)
    state = Path(tempfile.mkdtemp(prefix="dapo-stack-"))
    state.chmod(0o755)
    ports = {opt: free_port() for opt in ("postgres", "mlflow", "prefect", "ray", "dashboard")}
    args = [arg for opt, port in ports.items() for arg in (f"--{opt}-port", str(port))]
    env = clean_env()
    started = subprocess.run(
        [str(BIN / "dapo"), "stack", "start", "--state-dir", str(state), "--project-dir", str(project),
         "--ray-cpus", "2", "--crash-after", "45", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    s = stack.saved_settings(str(state))
    pids = [int(p.read_text()) for p in state.glob("*.pid")]
    try:
        assert started.returncode == 0 and s is not None, started.stdout + started.stderr
        assert all(" answers " in v for v in stack.status(s).values()), stack.status(s)
        yield s
    finally:
        family = descendants(pids)
        stopped = subprocess.run([str(BIN / "dapo"), "stack", "stop", "--state-dir", str(state)], env=env,
                                 capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        left = {p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        busy = [port for port in ports.values() if port_in_use("127.0.0.1", port)]
        shutil.rmtree(state, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not left, f"still running after `dapo stack stop`: {left}"
        assert not busy, f"ports still taken after `dapo stack stop`: {busy}"


def mlflow_api(s: stack.StackSettings, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    r = httpx.request(method, f"{s.mlflow_url}/api/2.0/mlflow/{path}", timeout=30, **kwargs)
    assert r.status_code == 200, (path, r.status_code, r.text[:500])
    return r.json()
