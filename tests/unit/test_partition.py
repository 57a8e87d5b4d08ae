"""Splitting batches across ranks: equal counts, balanced tokens, nothing lost or counted twice."""

import dataclasses

import pytest
import torch

from keel.distributed.ray_cluster import Devices, reserve
from keel.errors import NOT_ENOUGH_DEVICES, RAY_MISSING, KeelError
from keel.trainer.roles import combine_metrics
from keel.training.batching import balanced_partitions, shard_batch, unshard_rows

from tests_helpers import make_batch


def test_partitions_have_equal_counts_and_balanced_tokens():
    lengths = torch.tensor([100, 1, 1, 1, 50, 50, 2, 2])
    parts = balanced_partitions(lengths, 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    totals = [int(lengths[p].sum()) for p in parts]
    # 104 vs 103; a split by position would give 103 vs 104 by luck
    assert abs(totals[0] - totals[1]) <= 2
    # by position the first rank would get 190 tokens
    lengths = torch.tensor([100, 90, 1, 1])
    assert sorted(int(lengths[p].sum()) for p in balanced_partitions(lengths, 2)) == [91, 101]


def test_uneven_batch_is_padded_with_masked_samples_and_unsharded_in_order():
    batch = make_batch([1, 2, 3, 4, 5])
    index, parts = shard_batch(batch, 2)
    # equal sizes: ranks run the same number of forwards
    assert [len(p) for p in parts] == [3, 3]
    # filler adds none
    assert sum(int(p.response_mask.sum()) for p in parts) == int(batch.response_mask.sum())
    per_rank = [p.response_ids.float() for p in parts]
    assert torch.equal(unshard_rows(index, per_rank), batch.response_ids.float())


def test_a_mini_batch_smaller_than_the_ranks_gives_the_empty_ranks_masked_fillers():
    from keel.training.batching import plan_minibatches

    # 3 samples left (reward.on_error=mask), mini-batches of 2, on 2 ranks
    batch = make_batch([1, 2, 3])
    batch = dataclasses.replace(
        batch, advantages=torch.ones_like(batch.response_mask, dtype=torch.float32)
    )
    per_rank = plan_minibatches(
        batch, 2, epochs=1, shuffle=False, seed=0, norm_length=None, world_size=2
    )
    # the last mini-batch holds one sample
    last = [ranks[-1].samples for ranks in per_rank]
    assert [len(part) for part in last] == [1, 1]
    # one real, one masked filler
    assert sorted(int(part.response_mask.sum()) for part in last) == [0, 3]
    index, parts = shard_batch(batch.select([2]), 2)
    assert [len(i) for i in index] == [1, 0]
    rows = unshard_rows(index, [p.response_ids.float() for p in parts])
    assert torch.equal(rows, batch.select([2]).response_ids.float())


def test_metrics_from_ranks_add_up_except_replicated_ones():
    combined = combine_metrics(
        [
            {"actor/pg_loss": 0.25, "actor/grad_norm": 2.0, "actor/lr": 1e-3},
            {"actor/pg_loss": 0.5, "actor/grad_norm": 2.0, "actor/lr": 1e-3},
        ]
    )
    assert combined == {"actor/pg_loss": 0.75, "actor/grad_norm": 2.0, "actor/lr": 1e-3}


class _Cluster:
    """What `reserve` asks a Ray cluster: its resources."""

    def __init__(self, resources):
        self.resources = resources

    def cluster_resources(self):
        return self.resources


def test_more_workers_than_the_cluster_has_devices_is_refused(tiny_config):
    from keel.config.load import load_config

    cfg = load_config(tiny_config, ["trainer.n_gpus_per_node=4", "trainer.device=cpu"])
    with pytest.raises(KeelError) as info:
        reserve(_Cluster({"CPU": 2.0}), Devices.of(cfg), cfg.world_size)
    assert (
        info.value.code == NOT_ENOUGH_DEVICES
        and "4 workers" in info.value.message
        and "has 2" in info.value.message
    )


def test_ray_missing_is_a_coded_error(tiny_config, monkeypatch):
    import sys

    from keel.config.load import load_config
    from keel.distributed.ray_cluster import connect_ray

    # what an environment without Ray looks like
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(KeelError) as info:
        connect_ray(Devices.of(load_config(tiny_config, ["trainer.n_gpus_per_node=2"])))
    assert info.value.code == RAY_MISSING


def test_large_parameters_left_unsharded_are_reported(caplog):
    from keel.distributed.fsdp import REPLICATED_WARN_NUMEL, sharding_report

    model = torch.nn.Sequential(
        torch.nn.Embedding(REPLICATED_WARN_NUMEL // 8, 8), torch.nn.Linear(8, 2)
    )
    with caplog.at_level("WARNING", logger="keel"):
        report = sharding_report(model, "actor")
    assert report["fsdp/actor_sharded_gb"] == 0 and report["fsdp/actor_replicated_gb"] > 0
    assert "not sharded" in caplog.text and "0.weight" in caplog.text
