"""Quiet, offline-capable defaults for the tools dapo-flow drives (Prefect, MLflow, DVC, Ray, Hugging Face).

Each value was measured to be needed here; the comment beside it says why. The Makefile's env.mk sets the same
ones. Every variable is set with `os.environ.setdefault`, so anything the user exported wins.

    from dapo_core.env import apply_quiet_env
    apply_quiet_env()              # before importing prefect / mlflow / ray
    DAPO_OFFLINE=1 dapo ...        # additionally forbid Hugging Face hub calls
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

QUIET_ENV: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # else telemetry and a "database is locked" traceback
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # the default 20 s is too short on 2 busy cores
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # else the server spawns a job runner + consumers (~1.4 GB)
    "DVC_NO_ANALYTICS": "1",  # else every dvc command spawns an analytics daemon
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",  # avoids the fork warning (and deadlocks) under Ray / DataLoader workers
}
OFFLINE_ENV: dict[str, str] = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
OFFLINE_SWITCH = "DAPO_OFFLINE"
RAY_BOOTSTRAP_FILE = "ray_bootstrap_config.yaml"


def apply_quiet_env(project_root: Path | None = None, offline: bool | None = None) -> dict[str, str]:
    """Set the quiet/offline environment (never overriding what is already set) and return what it set.

    Args:
        project_root: where `.prefect/` lives (PREFECT_HOME); default: the current directory.
        offline: also set HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE; default: True iff env DAPO_OFFLINE=1.

    Also creates an empty `$HOME/ray_bootstrap_config.yaml` when absent: with it, Ray skips its probe of the
    cloud-metadata address at start-up.
    """
    root = (project_root or Path.cwd()).resolve()
    wanted = {"PREFECT_HOME": str(root / ".prefect"), **QUIET_ENV}
    if offline if offline is not None else os.environ.get(OFFLINE_SWITCH) == "1":
        wanted.update(OFFLINE_ENV)
    applied = {key: value for key, value in wanted.items() if key not in os.environ}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    _ensure_ray_bootstrap_file()
    logger.debug("quiet environment applied: %s", applied)
    return applied


def _ensure_ray_bootstrap_file() -> None:
    path = Path.home() / RAY_BOOTSTRAP_FILE
    try:
        if not path.exists():
            path.touch()
    except OSError as exc:  # a read-only home only costs Ray a slower start
        logger.debug("could not create %s: %s", path, exc)
