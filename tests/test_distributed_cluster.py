"""Two simulated nodes (``ray.cluster_utils.Cluster``): the executor joins by address, spreads its actors over both
nodes, and a DAPO step across them (gloo between the nodes' trainer ranks) equals the in-process step."""

from __future__ import annotations

import os

import pytest
import ray
from _tiny import tiny_model_dir
from conftest_distributed import assert_same_step, dapo_step, max_weight_diff, ray_weights, tiny_cfg
from ray.cluster_utils import Cluster

from dapo_core.distributed import RayExecutor, RayOptions, connect, shutdown
from dapo_core.distributed.cluster import default_temp_dir
from dapo_core.engines.executor import LocalExecutor
from dapo_core.env import apply_quiet_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a Ray hang fails the test, not CI


@pytest.fixture(scope="module")
def two_nodes():
    apply_quiet_env()
    # Cluster writes its address file under $RAY_TMPDIR/ray (default /tmp/ray): keep it in our own short dir
    saved, os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR"), default_temp_dir()
    os.makedirs(os.path.join(default_temp_dir(), "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": default_temp_dir()},
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    shutdown()
    cluster.shutdown()
    if saved is None:
        os.environ.pop("RAY_TMPDIR")
    else:
        os.environ["RAY_TMPDIR"] = saved


def test_workers_land_on_both_nodes_and_the_step_matches_the_local_one(two_nodes, tmp_path):
    model_dir = tiny_model_dir(tmp_path / "base")
    cfg = tiny_cfg(
        model_dir,
        **{
            "resources.ray_address": two_nodes.address,
            "resources.nnodes": 2,
            "resources.rollout_workers": 2,
            "resources.trainer_world_size": 2,
        },
    )
    info = connect(cfg.resources)
    assert not info.started_local and info.num_nodes == 2
    remote = RayExecutor(cfg, options=RayOptions(start_timeout_s=120.0))
    try:
        nodes = remote.placement_report()
        assert len(set(nodes["rollout"])) == 2 and len(set(nodes["trainer"])) == 2
        assert set(nodes["rollout"]) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        local = LocalExecutor(cfg)
        a, b = dapo_step(local, 1), dapo_step(remote, 1)
        assert_same_step(a, b)
        assert remote.rollout_versions() == [1, 1]
        assert max_weight_diff(local, ray_weights(remote)) <= 1e-6
    finally:
        remote.shutdown()
