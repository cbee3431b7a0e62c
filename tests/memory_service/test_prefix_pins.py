"""Prefix pins and retention priorities in the block manager: exact block ids evicted under pressure.

A pinned prompt's blocks are never evicted while pinned; once unpinned they keep the pin's
retention priority, and eviction takes the free blocks, then plain cached blocks (LRU), then the
lowest priority first (LRU within it).
"""

from __future__ import annotations

import math

import pytest

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, Commit, OutOfBlocks
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
)

KEY = CacheKey("model", "salt")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cached_prompt(m: BlockManager, lease: str, base: int) -> list[int]:
    """Allocate, compute and free a 9-token prompt (2 full blocks cached, the third not); its ids."""
    tokens = list(range(base, base + 9))
    (seq,) = m.allocate(lease, [Allocation(9, tuple(tokens), KEY)])
    m.commit_computed(lease, [Commit(seq.seq_id, 9)])
    m.free(lease, [seq.seq_id])
    return tokens


@pytest.fixture
def m() -> BlockManager:
    return BlockManager(num_blocks=16, block_size=4, clock=FakeClock())


def admin_lease(m: BlockManager, ttl: float | None = None) -> str:
    """A lease the admin opened (exempt): only those may give a retention priority."""
    return m.leases.open(ttl, exempt=True)[0].lease_id


def test_eviction_order_pinned_prioritised_plain(m: BlockManager):
    lease = admin_lease(m)
    a, b, c, d = (cached_prompt(m, lease, base) for base in (100, 200, 300, 400))
    # Each prompt reuses the previous one's freed partial block: A holds 0, 1; B 2, 3; C 4, 5; D 6, 7
    # (cached); 8-15 are free.
    pin_a = m.pin_prefix(lease, a, KEY, ttl=60, priority=0, label="tenant-a")
    assert pin_a is not None and m.sequences[pin_a.seq_id].block_ids == [0, 1] and pin_a.num_tokens == 8
    assert m.pool.ref_counts[:2] == [1, 1]
    for tokens, priority in ((b, 50), (c, 10)):
        pin = m.pin_prefix(lease, tokens, KEY, ttl=60, priority=priority)
        assert m.unpin_prefix(lease, pin.pin_id) == 2
    assert m.pool.retention[:8] == [0, 0, 50, 50, 10, 10, 0, 0]
    assert [p.pin_id for p in m.live_pins()] == [pin_a.pin_id]
    stats = m.stats()
    assert stats.pins == dict(num_pins=1, pinned_blocks=2, pinned_tokens=8, retained_blocks=4, expired=0)
    assert stats.available_blocks == 14
    m.check_invariants()

    # The free blocks go first, then D's plain cached blocks (leaf first), then C's (priority 10),
    # then B's (50); A's pinned blocks never.
    (big,) = m.allocate(lease, [10 * 4])
    assert big.block_ids == [8, 9, 10, 11, 12, 13, 14, 15, 7, 6]
    (next2,) = m.allocate(lease, [2 * 4])
    assert next2.block_ids == [5, 4]  # priority 10 before 50
    (last,) = m.allocate(lease, [2 * 4])
    assert last.block_ids == [3, 2]
    refused = m.allocate(lease, [4])
    assert isinstance(refused, OutOfBlocks) and refused.available == 0
    assert m.prefix_cache.evictions == 6
    assert m.prefix_cache.lookup(a, KEY).block_ids == [0, 1]  # still cached, still pinned
    m.check_invariants()


def test_pin_expires_and_keeps_its_priority(m: BlockManager):
    lease = admin_lease(m, ttl=10_000)
    a = cached_prompt(m, lease, 100)
    cached_prompt(m, lease, 200)  # B: blocks 2, 3, plain
    pin = m.pin_prefix(lease, a, KEY, ttl=30, priority=70)
    m.leases.clock.now += 29.9
    assert m.expire_pins() == 0
    m.leases.clock.now += 0.2
    assert m.expire_pins() == 1 and m.live_pins() == [] and m.stats().pins["expired"] == 1
    assert m.pool.ref_counts[:2] == [0, 0] and m.pool.retention[:2] == [70, 70]
    # B's blocks (plain) are evicted before A's (70), though A's were freed later.
    (seq,) = m.allocate(lease, [14 * 4])
    assert seq.block_ids[-2:] == [3, 2] and 0 not in seq.block_ids
    (seq2,) = m.allocate(lease, [4])
    assert seq2.block_ids == [1]
    with pytest.raises(NotFoundError):
        m.unpin_prefix(lease, pin.pin_id)
    m.check_invariants()


def test_pins_count_against_the_quota_and_end_with_the_lease():
    m = BlockManager(num_blocks=16, block_size=4, clock=FakeClock(), max_blocks_per_lease=3)
    owner = m.leases.create().lease_id
    a = cached_prompt(m, owner, 100)
    other = m.leases.create().lease_id
    (held,) = m.allocate(other, [8])  # 2 of its 3 entries
    before = (list(m.pool.ref_counts), list(m.pool.retention), len(m.sequences))
    with pytest.raises(QuotaExceededError):
        m.pin_prefix(other, a, KEY, ttl=60, priority=0)
    with pytest.raises(PermissionDeniedError):  # a tenant's lease cannot order eviction
        m.pin_prefix(other, a, KEY, ttl=60, priority=5)
    assert (list(m.pool.ref_counts), list(m.pool.retention), len(m.sequences)) == before
    m.free(other, [held.seq_id])
    pin = m.pin_prefix(other, a, KEY, ttl=60, priority=0)
    with pytest.raises(NotFoundError):  # another lease's pin
        m.unpin_prefix(owner, pin.pin_id)
    m.leases.release(other)
    m.drain_released()
    assert m.live_pins() == [] and m.pool.ref_counts[:2] == [0, 0] and m.pool.retention[:2] == [0, 0]
    m.check_invariants()


@pytest.mark.parametrize("ttl, priority, label", [(0, 0, ""), (-1, 0, ""), (math.nan, 0, ""), (86_401, 0, ""),
                                                  (10, 101, ""), (10, 0, "x" * 129)])
def test_bad_pins_change_nothing(m: BlockManager, ttl, priority, label):
    lease = admin_lease(m)
    a = cached_prompt(m, lease, 100)
    before = (list(m.pool.ref_counts), list(m.pool.retention), len(m.sequences))
    with pytest.raises(InvalidArgumentError):
        m.pin_prefix(lease, a, KEY, ttl=ttl, priority=priority, label=label)
    assert (list(m.pool.ref_counts), list(m.pool.retention), len(m.sequences)) == before


def test_nothing_cached_pins_nothing_and_expired_lease_is_refused(m: BlockManager):
    lease = m.leases.create(ttl=5).lease_id
    assert m.pin_prefix(lease, list(range(9)), KEY, ttl=60, priority=0) is None
    a = cached_prompt(m, lease, 100)
    assert m.pin_prefix(lease, a, CacheKey("model", "other-salt"), ttl=60, priority=0) is None  # salts apart
    assert len(m.sequences) == 0
    m.leases.clock.now += 6
    with pytest.raises((FailedPreconditionError, NotFoundError)):
        m.pin_prefix(lease, a, KEY, ttl=60, priority=0)


def test_a_reset_of_the_prefix_cache_drops_a_pinned_prompts_content_not_the_pin(m: BlockManager):
    lease = admin_lease(m)
    a = cached_prompt(m, lease, 100)
    pin = m.pin_prefix(lease, a, KEY, ttl=60, priority=30)
    assert m.reset_prefix_cache() == 0  # nothing refcount-0 was cached: the pin holds A's blocks
    assert m.pool.retention[:2] == [0, 0] and m.pool.ref_counts[:2] == [1, 1]
    assert m.prefix_cache.lookup(a, KEY).block_ids == []
    m.check_invariants()
    assert m.unpin_prefix(lease, pin.pin_id) == 2
    assert m.pool.num_free == 16 and m.pool.num_retained == 0  # no content left: plain free blocks
    m.check_invariants()


def test_a_pins_sequence_is_refused_to_every_call_but_free(m: BlockManager):
    """The pin's sequence is in its lease's table, so its id can be named: growing, forking or
    swapping it is FAILED_PRECONDITION and changes nothing; FreeSequences ends the pin."""
    lease = admin_lease(m)
    prompt = cached_prompt(m, lease, 100)
    pin = m.pin_prefix(lease, prompt, KEY, ttl=60, priority=0, label="")
    seq = m.sequences.lookup(pin.seq_id)
    before = (seq.num_tokens, list(seq.block_ids), m.pool.num_free)
    for call in (lambda: m.append_slots(lease, [Append(pin.seq_id, 1)]),
                 lambda: m.fork(lease, [pin.seq_id]),
                 lambda: m.swap_out(lease, [pin.seq_id])):
        with pytest.raises(FailedPreconditionError, match="prefix pin"):
            call()
        assert (seq.num_tokens, list(seq.block_ids), m.pool.num_free) == before
        m.check_invariants()
    m.free(lease, [pin.seq_id])
    assert m.live_pins() == []
    m.check_invariants()
