"""Ray execution layer: one controller, actor groups (rollout workers, trainer ranks, reward pool), weight sync.

    from dapo_core.distributed import RayExecutor, connect, shutdown
    with RayExecutor(cfg) as ex:   # resources.executor = ray
        ...                        # the same Executor interface as dapo_core.engines.executor.LocalExecutor

Ray is imported only under this package. Names are loaded on first use, so a reward worker (which imports
``dapo_core.distributed.reward_pool``) does not pay for torch and transformers when it starts or restarts.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ActorFailureError": "dapo_core.distributed.faults",
    "ClusterInfo": "dapo_core.distributed.cluster",
    "PlacementPlan": "dapo_core.distributed.placement",
    "RayConnectionError": "dapo_core.distributed.cluster",
    "RayExecutor": "dapo_core.distributed.executor",
    "RayOptions": "dapo_core.distributed.executor",
    "RewardPool": "dapo_core.distributed.reward_pool",
    "connect": "dapo_core.distributed.cluster",
    "plan_placement": "dapo_core.distributed.placement",
    "shutdown": "dapo_core.distributed.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dapo_core.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
