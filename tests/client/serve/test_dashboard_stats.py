"""The dashboard snapshot's pool stats (client.serve.dashboard.snapshot.stats_dict), and the disk tier's
counters summed over nodes (client.backend.total_pool_stats): plain JSON values, the disk tier's as a
nested object only when the pool has one."""

from __future__ import annotations

import json

from client.backend import total_pool_stats
from client.serve.dashboard.snapshot import stats_dict
from pagedkv.memory.v1 import memory_service_pb2 as pb


def test_the_disk_tier_is_a_nested_object_only_when_there_is_one():
    plain = stats_dict(pb.GetStatsResponse(total_blocks=8, used_blocks=2))
    assert plain["total_blocks"] == 8 and "disk" not in plain
    with_disk = stats_dict(pb.GetStatsResponse(total_blocks=8, disk=pb.DiskTierStats(blocks=3, slots=10, hits=16,
                                                                                      checksum_failures=1)))
    assert with_disk["disk"] == {"blocks": 3, "bytes": 0, "slots": 10, "hits": 16, "writes": 0, "reads": 0,
                                 "dropped": 0, "checksum_failures": 1, "evictions": 0, "recovered": 0}
    json.dumps(with_disk)  # what the feed sends


def test_nodes_disk_counters_add_up_and_a_node_without_one_adds_nothing():
    a = pb.GetStatsResponse(total_blocks=8, disk=pb.DiskTierStats(blocks=3, hits=8))
    b = pb.GetStatsResponse(total_blocks=4)
    c = pb.GetStatsResponse(total_blocks=4, disk=pb.DiskTierStats(blocks=2, hits=4, dropped=1))
    total = total_pool_stats([a, b, c])
    assert total.total_blocks == 16 and (total.disk.blocks, total.disk.hits, total.disk.dropped) == (5, 12, 1)
    assert not total_pool_stats([b, pb.GetStatsResponse(total_blocks=2)]).HasField("disk")


def test_prefix_pins_are_a_nested_object_and_add_up_over_nodes():
    a = pb.GetStatsResponse(total_blocks=8, pins=pb.PinStats(num_pins=1, pinned_blocks=2, pinned_tokens=32,
                                                             retained_blocks=1))
    b = pb.GetStatsResponse(total_blocks=8, pins=pb.PinStats(num_pins=2, pinned_blocks=3, pinned_tokens=48,
                                                             expired=4))
    assert stats_dict(a)["pins"] == {"num_pins": 1, "pinned_blocks": 2, "pinned_tokens": 32, "retained_blocks": 1,
                                     "expired": 0}
    total = total_pool_stats([a, b]).pins
    assert (total.num_pins, total.pinned_blocks, total.pinned_tokens, total.retained_blocks, total.expired) == (
        3, 5, 80, 1, 4)
