"""Shared test settings: deterministic hypothesis profile, quiet/offline tool environment, and stores of the
tests' own (before anything imports Prefect or MLflow, so they never see the user's).

The user's stores stay untouched: `make test` exports PREFECT_HOME=<repo>/.prefect (env.mk), and a shell may
export PREFECT_API_URL (a running `make ui`) or MLFLOW_TRACKING_URI. Here every test session gets a fresh
PREFECT_HOME (its profiles and the ephemeral server's database) and a SQLite MLflow store in a temporary folder,
and the Prefect API/database/profile variables are dropped; child processes (`dapo ...`, `dvc repro`) inherit
the same. Tests that need other stores pass them explicitly (`tracking.uri=...`, `prefect_test_harness`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# ---- isolation first: nothing above this line may import prefect or mlflow ----
TEST_STORES = Path(tempfile.mkdtemp(prefix="dapo-tests-"))
USER_PREFECT_HOME = os.environ.get("PREFECT_HOME")  # what the session was given (make: <repo>/.prefect)
for _var in (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_UI_URL",
    "PREFECT_PROFILE",
    "PREFECT_PROFILES_PATH",
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_UI_API_URL",
    "DAPO_MLFLOW_UI_URL",
):
    os.environ.pop(_var, None)
os.environ["PREFECT_HOME"] = str(TEST_STORES / "prefect")
TEST_MLFLOW_URI = f"sqlite:///{TEST_STORES / 'mlflow.db'}"
os.environ["MLFLOW_TRACKING_URI"] = TEST_MLFLOW_URI  # note: mlflow.set_tracking_uri() later rewrites this variable

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}.items():
    os.environ.setdefault(key, value)


# `make check`'s tier: the unit and property tests of these files (their tests not marked slow), ~2 minutes with
# ruff on 2 cores; measured with `pytest --durations=0`, files whose non-slow tests take a few seconds at most, and
# none that starts Prefect, MLflow, Ray or a training run. `make test` runs everything.
CHECK_TIER = frozenset(
    {
        "test_ablation_journal.py", "test_algorithm_loss.py", "test_algorithm_parts.py", "test_checkpoint_executor.py",
        "test_cli.py", "test_config.py", "test_data_card.py", "test_data_curate.py", "test_data_loaders.py",
        "test_data_schema.py", "test_data_templates.py", "test_demonstrations.py", "test_engine_settings.py",
        "test_evaluation_metrics.py", "test_evaluation_runner.py", "test_function_length.py", "test_log_prob_memory.py",
        "test_models.py", "test_objectives.py", "test_plan.py", "test_readme.py", "test_rewards.py",
        "test_rewards_properties.py", "test_rollout_correction.py", "test_rollout_hf.py", "test_rollout_static.py",
        "test_self_contained.py", "test_stage_params.py", "test_synthetic.py", "test_trainer.py",
        "test_training_step.py", "test_trl_settings.py", "test_update_direction.py", "test_weight_buckets.py",
    }
)  # fmt: skip


# `make test` runs the suite on pytest-xdist workers, a test file per worker at a time (--dist loadfile, so a
# module's fixtures are built once); the slowest files go first, so that none of them starts last and keeps the
# run waiting on it alone. Ordered by their time in a full run (`pytest --durations=0`, summed per file), longest
# first; the other files keep pytest's order after them.
SLOW_FIRST = (
    "reliability/test_crash_points_ray.py",
    "test_stack.py",
    "test_ablation.py",
    "test_overlap.py",
    "test_train_flow.py",
    "reliability/test_crash_points.py",
    "test_distributed_ray.py",
    "test_overfit.py",
    "test_serve.py",
    "test_rollout_procs.py",
    "test_fsdp.py",
    "test_console_output.py",
    "test_ui_browser.py",
    "reliability/test_scorer_fuzz.py",
    "test_gpu_check.py",
    "reliability/test_resume_edges.py",
    "test_ui_cli.py",
    "reliability/test_kill_leaves_nothing.py",
    "reliability/test_resume_remote_tracking.py",
    "test_data_dvc.py",
    "test_distributed_cluster.py",
    "test_base_model.py",
    "test_readme.py",
)


def pytest_collection_modifyitems(config, items):
    """``check`` marks the tests of CHECK_TIER's files (a name there that no longer exists fails the run, so a
    rename cannot shrink the tier unnoticed); SLOW_FIRST's files are moved to the front; tests marked ``gpu`` run
    only where CUDA is available."""
    here = Path(__file__).parent
    missing = sorted(name for name in CHECK_TIER | set(SLOW_FIRST) if not (here / name).is_file())
    if missing:
        raise pytest.UsageError(
            f"tests/conftest.py CHECK_TIER or SLOW_FIRST names missing test files: {', '.join(missing)}"
        )
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def order(item: pytest.Item) -> int:
        name = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        return rank.get(name, len(rank))

    items.sort(key=order)  # stable: the other files keep their order
    for item in items:
        if item.path.name in CHECK_TIER and item.path.parent == Path(__file__).parent:
            item.add_marker(pytest.mark.check)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (``item.rep_call.failed``): fixtures that keep evidence of a failure
    (the browser test's screenshot) read it at teardown."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_unconfigure(config):
    """Stop Prefect's temporary API servers (flows run without an API URL start one), then remove the session's
    own stores. Prefect would stop them at exit, logging to a stream pytest has closed by then: a "Logging error"
    traceback that pushed the failure summary out of the end of CI's log."""
    import logging
    import sys

    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is not None:
        logging.getLogger("prefect").disabled = True  # its "Stopping temporary server" line has nowhere to go
        for server in list(server_module.SubprocessASGIServer._instances.values()):
            server.stop()
    shutil.rmtree(TEST_STORES, ignore_errors=True)


@pytest.fixture(scope="session")
def _prefect_test_server():
    """The session's Prefect test server (tests/prefect_shared.py), started by the first module that asks."""
    from prefect_shared import start_server

    server, db_url = start_server()
    yield server, db_url
    server.stop()


@pytest.fixture(scope="module")
def prefect_api(_prefect_test_server):
    """Flows of this module (in process, or `dapo` subprocesses given this URL) report to the session's test
    server; its API URL. Modules that do not ask never see it."""
    from prefect_shared import entered

    with entered(*_prefect_test_server) as url:
        yield url
