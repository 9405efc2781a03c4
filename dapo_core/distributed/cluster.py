"""Joining or starting Ray: one place that calls ``ray.init``, quietly and offline.

    from dapo_core.distributed import connect, shutdown
    info = connect(cfg.resources)      # RAY_ADDRESS / resources.ray_address -> join; else a local Ray
    ...
    shutdown()                         # stops what connect started (actors, raylet, GCS)

Address resolution: ``resources.ray_address`` (the config loader already maps ``RAY_ADDRESS`` onto it), else the
``RAY_ADDRESS`` environment variable, else a fresh local cluster with ``resources.num_cpus`` CPUs (no dashboard,
no usage stats, a short ``_temp_dir`` under /tmp so socket paths stay under the 107-byte limit). A ``host:port``
address is probed with a plain TCP connect first, so an unreachable cluster is a clear error in seconds instead of
Ray's long retry loop.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray

from dapo_core.config.schema import ResourcesConfig
from dapo_core.env import QUIET_ENV, apply_quiet_env

logger = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
CONNECT_PROBE_TIMEOUT_S = 5.0

# Environment forwarded to workers of a cluster we join (a local cluster inherits this process's environment).
_FORWARDED_ENV = (*QUIET_ENV, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "DAPO_OFFLINE")

_started_here = False


class RayConnectionError(ConnectionError):
    """The configured Ray cluster cannot be reached (or a local one cannot be started)."""


@dataclass(frozen=True)
class ClusterInfo:
    """What ``connect`` joined: the address (``"local"`` when started here), nodes and total resources."""

    address: str
    started_local: bool
    num_nodes: int
    resources: dict[str, float]


def default_temp_dir() -> str:
    """A short per-user Ray temp dir: Ray's unix socket paths must stay under 107 bytes."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"/tmp/ray-{uid}"


def resolve_address(resources: ResourcesConfig) -> str | None:
    """The cluster to join: the config's ``ray_address``, else ``$RAY_ADDRESS``, else None (start locally)."""
    return resources.ray_address or os.environ.get(RAY_ADDRESS_ENV) or None


def _probe(address: str) -> None:
    """TCP-connect to ``host:port`` (GCS) or ``ray://host:port`` (client server); raise a clear error if closed."""
    target = address.split("://", 1)[-1]
    if address in ("auto", "local") or ":" not in target:
        return  # "auto" is resolved by Ray from the local session files; nothing to probe
    host, _, port_text = target.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise RayConnectionError(
            f"resources.ray_address / RAY_ADDRESS ({address!r}) is not host:port: use e.g. 10.0.0.1:6379, "
            "ray://10.0.0.1:10001, or unset it to start a local Ray"
        ) from None
    try:
        with socket.create_connection((host, port), timeout=CONNECT_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayConnectionError(
            f"cannot reach the Ray cluster at {address!r} (resources.ray_address or RAY_ADDRESS): "
            f"{type(exc).__name__}: {exc}. Start it with `ray start --head --port {port}` on {host}, fix the "
            "address, or unset it to run on a local Ray"
        ) from exc


def _summary(started_local: bool, address: str) -> ClusterInfo:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return ClusterInfo(
        address=address,
        started_local=started_local,
        num_nodes=len(nodes),
        resources={k: float(v) for k, v in ray.cluster_resources().items()},
    )


def connect(resources: ResourcesConfig, *, temp_dir: str | None = None, **init_kwargs: Any) -> ClusterInfo:
    """Join the configured cluster or start a local one; reuse the current session if Ray is already up.

    ``init_kwargs`` go to ``ray.init`` (e.g. ``include_dashboard=True`` to get the dashboard back).

    Raises:
        RayConnectionError: the address is unreachable or malformed, or Ray fails to start or join.
    """
    global _started_here
    apply_quiet_env()  # usage stats off, auth off, $HOME/ray_bootstrap_config.yaml (no cloud-metadata probe)
    if ray.is_initialized():
        return _summary(_started_here, "local" if _started_here else (resolve_address(resources) or "existing"))
    address = resolve_address(resources)
    options: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,  # worker logs stay in <temp_dir>/session_latest/logs; errors come back as exceptions
        "logging_level": logging.WARNING,
        **init_kwargs,
    }
    try:
        if address is None:
            ray.init(address="local", num_cpus=resources.num_cpus, _temp_dir=temp_dir or default_temp_dir(), **options)
            _started_here = True
            logger.info("started a local Ray with %s CPUs", resources.num_cpus or "all")
        else:
            _probe(address)
            env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
            ray.init(address=address, runtime_env={"env_vars": env} if env else None, **options)
            _started_here = False
            logger.info("joined the Ray cluster at %s", address)
    except RayConnectionError:
        raise
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray"
        raise RayConnectionError(
            f"could not connect to {where}: {type(exc).__name__}: {exc}. Check resources.ray_address / RAY_ADDRESS "
            f"(unset both to run locally) and the logs under {temp_dir or default_temp_dir()}"
        ) from exc
    return _summary(_started_here, address or "local")


def shutdown() -> None:
    """Disconnect from Ray; a cluster started by ``connect`` is stopped with it (raylet, GCS, workers)."""
    global _started_here
    if ray.is_initialized():
        ray.shutdown()
        logger.info("Ray %s", "stopped" if _started_here else "disconnected")
    _started_here = False
