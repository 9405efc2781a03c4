"""The Ray layer's pure parts, without a cluster: shard cuts, placement plans, the connect error, seeded offsets."""

from __future__ import annotations

import socket
import time
from collections import Counter

import pytest
import torch
from _tiny import loss_config, optim_config, plain_sampling, random_batch, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.config.schema import ResourcesConfig
from dapo_core.distributed import RayConnectionError, RayOptions, connect, plan_placement
from dapo_core.distributed.sharding import shard_for_update, shard_rows, split_evenly
from dapo_core.engines.batch import split_by_groups
from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.rollout import HFRolloutBackend
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.engines.trainer import PolicyTrainer, short_mini_batch_scales


@given(n=st.integers(0, 60), parts=st.integers(1, 9))
def test_split_evenly_covers_every_index_once_in_order_with_sizes_within_one(n, parts):
    ranges = split_evenly(n, parts)
    assert len(ranges) == parts
    assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _tagged(seed: int, groups: int, g: int):
    batch = random_batch(seed, groups=groups, g=g)
    batch.old_log_probs = torch.zeros_like(batch.response_mask)
    batch.extras["row"] = torch.arange(batch.num_responses)  # (N,) to trace rows through the cut
    return batch


@given(
    seed=st.integers(0, 99),
    groups=st.integers(1, 7),
    g=st.integers(1, 3),
    mini=st.integers(1, 4),
    world=st.integers(1, 4),
)
def test_update_shards_hold_each_minibatch_split_by_whole_groups_in_lock_step(seed, groups, g, mini, world):
    batch = _tagged(seed, groups, g)
    local_minis = split_by_groups(batch, mini)
    shards = shard_for_update(batch, mini, world)
    per_rank = [split_by_groups(s, 1) for s in shards]
    assert all(len(p) == len(local_minis) for p in per_rank)  # same number of optimizer steps on every rank
    for k, local in enumerate(local_minis):
        owner: dict[int, int] = {}
        real_rows: list[int] = []
        for rank, rank_minis in enumerate(per_rank):
            piece = rank_minis[k]
            real = piece.response_mask.sum(dim=1) > 0  # (n,): dummies have no token in the loss
            assert torch.all(piece.advantages[~real] == 0)
            for row in piece.extras["row"][real].tolist():
                real_rows.append(row)
                assert owner.setdefault(int(batch.group_index[row]), rank) == rank  # a group is never split
        assert Counter(real_rows) == Counter(local.extras["row"].tolist())


def test_single_rank_update_on_its_shard_is_bit_identical_to_the_plain_update():
    batch = _tagged(3, groups=5, g=3)
    batch.extras.clear()
    models = [tiny_model(seed=1), tiny_model(seed=1)]
    trainers = [PolicyTrainer(m, optim_config(lr=1e-2), micro_batch_size=4) for m in models]
    batch.old_log_probs, _ = trainers[0].compute_log_probs(batch)
    plain = trainers[0].update(batch, loss_config(), ppo_epochs=2, mini_batch_groups=2)
    (shard,) = shard_for_update(batch, 2, world=1)
    # the shard relabels each mini-batch as one group: the short last mini-batch's lr scale (1 of 2 groups)
    # comes from the whole batch, as TrainerGroup.update passes it
    scales = short_mini_batch_scales(batch, 2)
    assert scales == [1.0, 1.0, 0.5]
    sharded = trainers[1].update(shard, loss_config(), ppo_epochs=2, mini_batch_groups=1, mini_batch_scales=scales)
    assert plain == sharded
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_row_shards_are_contiguous_and_an_empty_share_is_one_masked_dummy():
    batch = _tagged(0, groups=1, g=3)
    shards = shard_rows(batch, 4)
    assert [n for _, n in shards] == [1, 1, 1, 0]
    assert [s.extras["row"].tolist() for s, _ in shards[:3]] == [[0], [1], [2]]
    dummy, _ = shards[3]
    assert dummy.num_responses == 1 and float(dummy.response_mask.sum()) == 0.0


def _resources(**kw) -> ResourcesConfig:
    return ResourcesConfig(executor="ray", **kw)


def test_cpu_colocated_plan_shares_one_bundle_per_rank_pair_and_splits_it():
    plan = plan_placement(_resources(rollout_workers=2, trainer_world_size=2), cpus_per_node=2)
    assert plan.bundles == {"shared": [[{"CPU": 1.0}, {"CPU": 1.0}]]}
    assert [s.bundle for s in plan.trainer_slots] == [0, 1] == [s.bundle for s in plan.rollout_slots]
    assert plan.trainer_request == {"num_cpus": 0.5, "num_gpus": 0.0} and plan.threads == 1
    single = plan_placement(_resources(), cpus_per_node=2)
    assert single.bundles == {"shared": [[{"CPU": 2.0}]]} and single.threads == 2


def test_cpu_split_plan_over_two_nodes_gives_each_node_its_own_group():
    plan = plan_placement(
        _resources(rollout_workers=2, trainer_world_size=2, nnodes=2, placement="split"), cpus_per_node=4
    )
    assert plan.bundles == {"trainer": [[{"CPU": 2.0}, {"CPU": 2.0}]], "rollout": [[{"CPU": 2.0}, {"CPU": 2.0}]]}
    colocated = plan_placement(_resources(rollout_workers=2, trainer_world_size=2, nnodes=2), cpus_per_node=1)
    assert [s.pg for s in colocated.rollout_slots] == [0, 1]  # one placement group per node


def test_gpu_plans_place_ranks_on_gpu_bundles_and_reject_what_does_not_fit():
    res = _resources(nnodes=2, n_gpus_per_node=4, trainer_world_size=8, rollout_workers=4)
    plan = plan_placement(res, cpus_per_node=32, rollout_tp=2)
    assert plan.use_gpu and plan.bundles["shared"] == [[{"GPU": 1.0, "CPU": 8.0}] * 4] * 2
    assert [(s.pg, s.bundle) for s in plan.rollout_slots] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert plan.trainer_request == {"num_cpus": 4.0, "num_gpus": 0.5}
    # TP 2: each engine's vLLM workers take half of bundles (b, b+1); the driver actor holds no GPU
    assert plan.rollout_engine_bundles == [[0, 1], [2, 3], [0, 1], [2, 3]] and plan.rollout_engine_gpu_share == 0.5
    assert plan.rollout_request == {"num_cpus": 4.0, "num_gpus": 0.0}
    one = plan_placement(res, cpus_per_node=32, rollout_tp=1)  # TP 1: the actor itself holds its GPU share
    assert one.rollout_engine_bundles == [] and one.rollout_request == {"num_cpus": 4.0, "num_gpus": 0.5}
    split = plan_placement(
        res.model_copy(update={"placement": "split", "trainer_world_size": 4, "rollout_workers": 2}),
        cpus_per_node=32,
        rollout_tp=2,
    )
    assert split.rollout_engine_bundles == [[0, 1], [2, 3]] and split.rollout_engine_gpu_share == 1.0
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide resources.n_gpus_per_node \(4\)"):
        plan_placement(res.model_copy(update={"rollout_workers": 1}), cpus_per_node=32, rollout_tp=3)
    with pytest.raises(ValueError, match=r"split placement needs .* <= GPUs \(2 x 4 = 8\)"):
        plan_placement(res.model_copy(update={"placement": "split"}), cpus_per_node=32, rollout_tp=2)
    with pytest.raises(ValueError, match="colocated placement needs"):
        plan_placement(res.model_copy(update={"trainer_world_size": 16}), cpus_per_node=32)


def test_unreachable_cluster_address_is_a_clear_error_within_seconds():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RayConnectionError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}'.*ray start"):
        connect(_resources(ray_address=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 30
    with pytest.raises(RayConnectionError, match="is not host:port"):
        connect(_resources(ray_address="10.0.0.1:head"))


def test_ray_options_reject_impossible_limits():
    with pytest.raises(ValueError, match="reward_timeout_s"):
        RayOptions(reward_timeout_s=0)
    with pytest.raises(ValueError, match="max_actor_failures"):
        RayOptions(max_actor_failures=0)


def test_hf_shards_generated_with_their_offsets_equal_one_whole_call():
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=0)
    backend = HFRolloutBackend(model, tok, micro_batch_size=5)
    prompts = [tok.encode(t) for t in ["Q: 1+2", "Q: 71-57*6", "Q: 3", "Q: 9*9-1", "Q: 5-5"]]
    sampling = plain_sampling(n=3, max_new_tokens=10, seed=11, return_log_probs=True)
    whole = backend.generate(prompts, sampling)
    parts = [backend.generate(prompts[a:b], sampling, prompt_index_offset=a) for a, b in split_evenly(5, 2)]
    joined = [r for part in parts for r in part]
    assert [(r.prompt_index, r.sample_index, r.response_ids) for r in joined] == [
        (r.prompt_index, r.sample_index, r.response_ids) for r in whole
    ]
    unshifted = backend.generate(prompts[3:], sampling)
    assert [r.response_ids for r in unshifted] != [r.response_ids for r in whole[9:]]  # the offset matters
    with pytest.raises(ValueError, match="prompt_index_offset"):
        backend.generate(prompts, sampling, prompt_index_offset=-1)


def test_reward_worker_streams_chunks_in_item_order():
    from dapo_core.distributed.reward_pool import RewardWorker

    def fn(completion: str, ground_truth: str) -> dict:
        if completion == "RAISE":
            raise ValueError("bad item")
        if completion == "SLOW":
            time.sleep(0.3)
        return {"score": 1.0, "acc": True, "pred": completion}

    worker = RewardWorker(fn)
    texts = ["a", "b", "RAISE", "c", "SLOW", "d", "e"]
    one_each = list(worker.score_stream(texts, ["x"] * len(texts), 0.0))
    assert [len(c) for c in one_each] == [1] * len(texts)
    chunks = list(worker.score_stream(texts, ["x"] * len(texts), 0.2))
    # the fast items before the slow one wait for it; the slow one makes the chunk due; the rest go at the end
    assert [[r["pred"] for r, _ in c] for c in chunks] == [["a", "b", "[ERROR]", "c", "SLOW"], ["d", "e"]]
    assert [failed for c in chunks for _, failed in c] == [False, False, True, False, False, False, False]
    assert [item for c in chunks for item in c] == [item for c in one_each for item in c]
