"""`pagedkv stats`'s prefix-pin table (client.ops.report): shown when pins live or left retained
blocks, one row per pin, and not at all otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from client.ops.report import print_stats
from pagedkv.memory.v1 import memory_service_pb2 as pb


def render(stats, pins=()) -> str:
    out = io.StringIO()
    print_stats(stats, [], console=Console(file=out, width=200), pins=pins)
    return out.getvalue()


def test_pins_print_with_their_blocks_and_priority_and_only_when_there_are_some():
    plain = pb.GetStatsResponse(total_blocks=8, block_size=16)
    assert "Prefix pins" not in render(plain)
    stats = pb.GetStatsResponse(total_blocks=8, block_size=16, pins=pb.PinStats(num_pins=1, pinned_blocks=2,
                                                                                pinned_tokens=32, retained_blocks=3))
    pin = pb.PrefixPin(pin_id="pin-00aa", label="tenant:a", seq_id=7, num_tokens=32, block_ids=[4, 5], priority=40,
                       expires_in_seconds=59.6)
    text = render(stats, [pin])
    assert "Prefix pins: 1 live, 2 blocks, 32 tokens; 3 cached blocks with a retention priority; 0 expired" in text
    row = next(line for line in text.splitlines() if "pin-00aa" in line)
    assert row.split("│")[1:-1] and [c.strip() for c in row.split("│")[1:-1]] == [
        "pin-00aa", "tenant:a", "7", "32", "2", "40", "60"]
