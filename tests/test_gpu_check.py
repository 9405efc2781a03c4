"""scripts/gpu_check.py: its dry run (2 gloo ranks, tiny shapes) passes every section, and it imports on the bare GPU
image (torch + transformers, no pydantic / Ray / Prefect / MLflow / vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SECTIONS = {
    "fsdp_bf16_update",
    "cpu_offload_clip",
    "dcp_round_trip",
    "rank0_materialise",
    "release_before_wake",
    "planner",
}

# Refuses the packages the GPU image lacks, then imports the script (and so every dapo_core module it uses).
_BLOCKED_IMPORT = """
import importlib.abc, importlib.util, sys
BLOCKED = {"pydantic", "ray", "prefect", "mlflow", "vllm"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked (absent on the GPU image)", name=name)
        return None
sys.meta_path.insert(0, Block())
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = module
spec.loader.exec_module(module)
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def test_the_script_imports_without_pydantic_ray_prefect_mlflow_or_vllm():
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


# `make test` exports PYTHON=python3 (the Makefile's venv-building interpreter, without torch): the script must not
# take it for its own; this test's interpreter is handed over explicitly
SCRIPT_ENV = {**os.environ, "PYTHON": "python3", "GPU_CHECK_PYTHON": sys.executable}


@pytest.mark.timeout(300)
def test_dry_run_passes_every_section_and_writes_json_and_markdown(tmp_path):
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
        env=SCRIPT_ENV,
    )
    assert (tmp_path / "gpu.json").is_file(), done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    failed = {s["name"]: s.get("error") for s in result["sections"] if not s.get("ok")}
    assert not failed, failed
    assert done.returncode == 0, done.stderr[-3000:]
    assert result["passed"] and result["dry_run"] and result["world"] == 2 and result["backend"] == "gloo"
    assert {s["name"] for s in result["sections"]} == SECTIONS
    figures = {s["name"]: s["figures"] for s in result["sections"]}
    offload = figures["cpu_offload_clip"]
    assert offload["clip_coefficient"] < 1 and offload["grad_devices"] == ["cpu"]  # the clip binds, on CPU grads
    assert offload["grad_norm_after_clip"] == pytest.approx(offload["grad_clip"], rel=1e-2)
    assert figures["dcp_round_trip"]["resumed_pg_loss"] == figures["dcp_round_trip"]["next_step_pg_loss"]
    assert all(s["seconds"] > 0 for s in result["sections"])
    md = (tmp_path / "gpu.md").read_text()
    assert "all passed" in md and all(f"| {name} | pass |" in md for name in SECTIONS)
    assert not list(tmp_path.glob("gpu_check-*"))  # the ranks' scratch directory is removed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_section_is_recorded_the_others_still_run_and_the_run_exits_non_zero(tmp_path):
    env = {**SCRIPT_ENV, "GPU_CHECK_INJECT_FAILURE": "release_before_wake"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--world", "1", "--out", str(tmp_path),
         "--sections", "release_before_wake,planner"],
        capture_output=True, text=True, cwd=ROOT, timeout=280, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    failed, after = result["sections"]
    assert not failed["ok"] and "injected failure" in failed["error"] and "Traceback" in failed["traceback"]
    assert after["name"] == "planner" and after["ok"]  # recorded, then the next section ran
    assert not result["passed"] and "FAILED" in (tmp_path / "gpu.md").read_text()
    unknown = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sections", "nonsense"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert unknown.returncode == 2 and "unknown sections ['nonsense']" in unknown.stderr
