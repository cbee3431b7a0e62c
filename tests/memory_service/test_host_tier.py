"""The host tier behind the pool, block by block: offload on eviction, reload on a hit, host-tier
eviction order, a full host tier, swap out and in; exact block ids, copies, counters and events.

Device pool of 4 blocks of 4 tokens and a host tier of 4 blocks unless a test says otherwise. A
"step" plays an honest worker: it does the copies its grant names and hands in the receipt for
every position it holds, listing the tier copies it did.
"""

from __future__ import annotations

import dataclasses

import pytest

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, BlockCopy, OutOfBlocks, Receipt
from memory_service.tiers.manager import DEVICE, HOST
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import (
    HOST_TIER_OFF,
    SWAP_LOST,
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfHostBlocksError,
)
from pagedkv.runtime.grants import token_digest

BS = 4


def manager(num_blocks=4, host=4) -> tuple[BlockManager, str]:
    m = BlockManager(num_blocks, BS, host_num_blocks=host)
    lease, _ = m.leases.open(None, "test")
    return m, lease.lease_id


def offload(src: int, dst: int) -> BlockCopy:
    return BlockCopy(src, dst, src_medium=DEVICE, dst_medium=HOST)


def reload(src: int, dst: int) -> BlockCopy:
    return BlockCopy(src, dst, src_medium=HOST, dst_medium=DEVICE)


def granted(m: BlockManager, seq) -> list[BlockCopy]:
    """The tier copies the grant of ``seq``'s next step carries (what the server signs)."""
    return m.tiers.grant_copies(seq)


def step(m: BlockManager, lease_id: str, seq, copies: list[BlockCopy] | None = None, *, do_copies: bool = True):
    """An honest worker step over every position ``seq`` holds that is not proven yet; returns the
    commit result. ``copies``: the grant's tier copies (default: take them now)."""
    copies = granted(m, seq) if copies is None else copies
    done = tuple(m.tiers.copy_key(c) for c in copies) if do_copies else ()
    start, end = seq.num_proven, seq.num_tokens
    first, last = start // BS, -(-end // BS)
    ids = tuple(seq.block_ids[first:last])
    r = Receipt(seq.seq_id, start, end, token_digest(seq.token_ids[start:end]), ids,
                tuple(int(e) for e in m.pool.epochs[list(ids)]), done)
    result = m.commit_receipts(lease_id, [r])
    m.check_invariants()
    return result


def events(m: BlockManager) -> list[tuple[str, int, int]]:
    """(kind, block id, medium) of every KV event so far."""
    return [(e.kind, e.block_id, e.medium) for e in m.prefix_cache.events]


A = tuple(range(100, 109))  # 9 tokens: 2 full blocks + 1
B = tuple(range(200, 216))  # 16 tokens: 4 full blocks


def cached_then_evicted(m: BlockManager, lease_id: str):
    """A computes 9 tokens (blocks 0, 1 cached) and is freed; B takes the whole pool, evicting 1 then 0."""
    (a,) = m.allocate(lease_id, [Allocation(9, A)])
    assert a.block_ids == [0, 1, 2]
    step(m, lease_id, a)
    m.free(lease_id, [a.seq_id])
    assert list(m.pool.free_queue) == [2, 3, 1, 0]  # free blocks first, then cached leaf before parent
    (b,) = m.allocate(lease_id, [Allocation(16, B)])
    return a, b


def test_evicted_blocks_are_offloaded_in_the_new_owners_step_and_are_hits_only_once_proven():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    assert b.block_ids == [2, 3, 1, 0]
    copies = granted(m, b)
    assert copies == [offload(1, 0), offload(0, 1)]  # A's leaf to host 0, its first block to host 1
    assert m.tiers.grant_copies(b) == []  # an offload is granted once
    s = m.stats()
    assert (s.host_used_blocks, s.host_cached_blocks, s.offloads) == (2, 0, 0)  # pending: not a hit yet
    # A lookup now does not reach the pending host blocks.
    assert m.tiers.host_hits(list(A), m.sequences[b.seq_id].cache_key, None, 0) == []
    step(m, lease, b, copies)
    s = m.stats()
    assert (s.host_used_blocks, s.host_cached_blocks, s.offloads, s.prefix_cache_evictions) == (0, 2, 2, 2)
    assert events(m)[2:6] == [("removed", 1, DEVICE), ("removed", 0, DEVICE), ("stored", 0, HOST), ("stored", 1, HOST)]


def test_an_offload_the_step_did_not_prove_is_dropped():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    step(m, lease, b, do_copies=False)  # a receipt without the copies: the host blocks never got the KV
    s = m.stats()
    assert (s.host_free_blocks, s.host_cached_blocks, s.offloads, s.offloads_dropped) == (4, 0, 0, 2)


def test_a_sequence_freed_before_its_step_drops_its_offloads():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    granted(m, b)
    m.free(lease, [b.seq_id])
    m.check_invariants()
    s = m.stats()
    assert (s.host_free_blocks, s.offloads_dropped, s.used_blocks, s.host_used_blocks) == (4, 2, 0, 0)


def test_a_host_hit_is_reloaded_into_fresh_device_blocks_and_counts_as_cached():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    step(m, lease, b)
    m.free(lease, [b.seq_id])
    assert list(m.pool.free_queue) == [0, 1, 3, 2]
    (c,) = m.allocate(lease, [Allocation(9, A)])
    assert c.block_ids == [0, 1, 3]
    assert (c.num_cached_tokens, c.num_reloaded_tokens, c.num_proven) == (8, 8, 8)  # only token 8 to compute
    copies = granted(m, c)
    # B's blocks 0 and 1 are offloaded first (host 2, 3), then A's KV comes back from host 1 and 0;
    # B's block 3 found no host room (hosts 0 and 1 are pinned by the reload, 2 and 3 pending).
    assert copies == [offload(0, 2), offload(1, 3), reload(1, 0), reload(0, 1)]
    s = m.stats()
    assert (s.host_cache_hits, s.offloads_dropped, s.prefix_cache_hits) == (8, 1, 8)
    # Reloaded blocks are pending: another lookup of A does not hit them on the device.
    assert m.prefix_cache.lookup(list(A), c.cache_key).block_ids == []
    assert granted(m, c) == [reload(1, 0), reload(0, 1)]  # reloads stay in every grant until proven
    step(m, lease, c, copies)
    s = m.stats()
    assert (s.reloads, s.offloads) == (2, 4)
    assert m.prefix_cache.lookup(list(A), c.cache_key).block_ids == [0, 1]  # proven: device hits now
    assert granted(m, c) == []


def test_a_receipt_without_its_reloads_ends_caching_for_the_sequence():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    step(m, lease, b)
    m.free(lease, [b.seq_id])
    (c,) = m.allocate(lease, [Allocation(9, A)])
    step(m, lease, c, do_copies=False)
    assert c.token_ids is None and len(c.reloads) == 2  # nothing it computes enters the cache
    assert m.prefix_cache.lookup(list(A), c.cache_key).block_ids == []
    m.free(lease, [c.seq_id])
    m.check_invariants()
    s = m.stats()
    assert (s.used_blocks, s.host_used_blocks, s.reloads) == (0, 0, 0)


def test_the_host_tier_evicts_least_recently_used_leaves_before_parents():
    m, lease = manager(num_blocks=4, host=2)
    (a,) = m.allocate(lease, [Allocation(9, A)])
    step(m, lease, a)
    m.free(lease, [a.seq_id])
    (b,) = m.allocate(lease, [Allocation(16, B)])
    step(m, lease, b)  # host 0 = A's leaf (offloaded first), host 1 = A's first block
    m.free(lease, [b.seq_id])
    (c,) = m.allocate(lease, [Allocation(5, (300, 301, 302, 303, 304))])
    # Two of B's blocks are evicted; the host tier is full of A's blocks: the least recent is A's leaf.
    assert granted(m, c) == [offload(0, 0), offload(1, 1)]
    assert [e for e in events(m) if e[0] == "removed" and e[2] == HOST] == [("removed", 0, HOST), ("removed", 1, HOST)]
    assert m.stats().host_cache_evictions == 2


def test_swap_out_keeps_shared_blocks_and_reserves_host_blocks_for_its_own():
    m, lease = manager(num_blocks=8, host=4)
    (p,) = m.allocate(lease, [Allocation(6, tuple(range(6)))])
    step(m, lease, p)
    (child,) = m.fork(lease, [p.seq_id])
    m.append_slots(lease, [Append(child.seq_id, 3, (7, 8, 9))])
    assert (p.block_ids, child.block_ids) == ([0, 1], [0, 2, 3])  # child copied the shared last block into 2
    released, reserved = m.swap_out(lease, [child.seq_id])
    assert (released, reserved) == (2, 2)
    info = m.sequence_info(child.seq_id)
    assert (info.block_ids, info.media, info.ref_counts,
            info.swapped) == ((0, 0, 1), (DEVICE, HOST, HOST), (2, 1, 1), True)
    assert list(m.pool.free_queue)[-2:] == [3, 2]  # kept, last in line
    m.check_invariants()
    with pytest.raises(FailedPreconditionError):
        m.append_slots(lease, [Append(child.seq_id, 1)])
    # Nothing needed the blocks: swap-in takes them back with no copy.
    (back,), _ = m.swap_in(lease, [child.seq_id])
    assert back.block_ids == [0, 2, 3] and granted(m, back) == []
    s = m.stats()
    assert (s.swap_outs, s.swap_ins, s.swapped_sequences, s.host_used_blocks, s.used_blocks) == (1, 1, 0, 0, 4)


def test_a_swapped_block_handed_out_is_offloaded_then_reloaded_on_swap_in():
    m, lease = manager(num_blocks=4, host=4)
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    assert v.block_ids == [0, 1]
    m.swap_out(lease, [v.seq_id])
    (w,) = m.allocate(lease, [Allocation(12, tuple(range(400, 412)))])
    assert w.block_ids == [2, 3, 1]  # free blocks first, then V's last block (its first stays)
    copies = granted(m, w)
    assert copies == [offload(1, 1)]  # to the host block held for it
    step(m, lease, w, copies)
    m.free(lease, [w.seq_id])
    # Back, with a slot for its next token in the same call: the reply's one grant carries every copy.
    (back,), appended = m.swap_in(lease, [v.seq_id], [Append(v.seq_id, 1, (307,))])
    assert back.block_ids == [0, 1] and back.num_tokens == 8 and appended.updates == []
    copies = granted(m, back)  # block 0 kept; block 1 (W's now, cached) gives its KV to the host first
    assert copies == [offload(1, 2), reload(1, 1)]
    step(m, lease, back, copies)  # no positions to compute: the receipt of its next token proves the reload
    s = m.stats()
    assert (s.swap_outs, s.swap_ins, s.offloads, s.reloads, s.host_used_blocks,
            s.host_cached_blocks) == (1, 1, 2, 1, 0, 1)



def test_a_receipt_writing_over_a_swap_reload_it_left_out_is_stale():
    """V's last block is half computed (positions 4-6 of 7) when it is swapped out and handed to W;
    back in, its next token goes into that block after the reload. A step that writes the token but
    leaves the reload out computed over KV never restored, and the reload repeated later would copy
    over the token: the receipt is stale, and the next honest step (reload, then write) proves both."""
    m, lease = manager(num_blocks=4, host=4)
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    m.swap_out(lease, [v.seq_id])
    (w,) = m.allocate(lease, [Allocation(12, tuple(range(400, 412)))])
    step(m, lease, w)  # proves the offload of V's block 1 into host block 1
    m.free(lease, [w.seq_id])
    (back,), _ = m.swap_in(lease, [v.seq_id], [Append(v.seq_id, 1, (307,))])
    copies = granted(m, back)
    assert copies[-1] == reload(1, 1) and back.num_proven == 7
    result = step(m, lease, back, copies, do_copies=False)
    assert (result.skipped, back.num_proven, [r.copy for r in back.reloads]) == (1, 7, [reload(1, 1)])
    assert granted(m, back)[-1] == reload(1, 1)  # still in the next grant
    result = step(m, lease, back)
    assert (result.skipped, back.num_proven, back.reloads, m.stats().reloads) == (0, 8, [], 1)
def test_swap_in_of_a_block_whose_offload_was_never_proven_is_swap_lost():
    m, lease = manager(num_blocks=4, host=4)
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    m.swap_out(lease, [v.seq_id])
    (w,) = m.allocate(lease, [Allocation(12, tuple(range(400, 412)))])
    step(m, lease, w, do_copies=False)
    before = m.stats()
    with pytest.raises(FailedPreconditionError) as e:
        m.swap_in(lease, [v.seq_id])
    assert e.value.reason == SWAP_LOST and m.stats() == before
    m.free(lease, [v.seq_id, w.seq_id])
    m.check_invariants()
    s = m.stats()
    assert (s.used_blocks, s.host_used_blocks, s.swapped_sequences) == (0, 0, 0)


def test_swap_out_is_all_or_nothing_when_the_host_tier_is_full():
    m, lease = manager(num_blocks=8, host=2)
    seqs = m.allocate(lease, [Allocation(5, tuple(range(10, 15))), Allocation(3, (1, 2, 3))])
    for s in seqs:
        step(m, lease, s)
    before = (m.stats(), [list(s.block_ids) for s in seqs], list(m.pool.free_queue))
    with pytest.raises(OutOfHostBlocksError) as e:
        m.swap_out(lease, [s.seq_id for s in seqs])  # 3 own blocks, 2 host blocks
    assert e.value.metadata == {"required": "3", "available": "2"}
    assert (m.stats(), [list(s.block_ids) for s in seqs], list(m.pool.free_queue)) == before
    m.check_invariants()


def test_swap_out_without_a_host_tier_is_refused():
    m, lease = manager(host=0)
    (s,) = m.allocate(lease, [Allocation(3, (1, 2, 3))])
    with pytest.raises(FailedPreconditionError) as e:
        m.swap_out(lease, [s.seq_id])
    assert e.value.reason == HOST_TIER_OFF


def test_swap_in_that_does_not_fit_changes_nothing():
    m, lease = manager(num_blocks=4, host=4)
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    m.swap_out(lease, [v.seq_id])
    (w,) = m.allocate(lease, [Allocation(16, tuple(range(400, 416)))])  # takes all four, both of V's
    step(m, lease, w)
    before = m.stats()
    assert m.swap_in(lease, [v.seq_id]) == OutOfBlocks(2, 0)
    after = m.stats()
    assert (after.used_blocks, after.host_used_blocks, after.swapped_sequences) == (
        before.used_blocks, before.host_used_blocks, 1)


def test_an_expired_lease_frees_its_blocks_in_both_tiers():
    now = [0.0]
    m = BlockManager(4, BS, host_num_blocks=4, clock=lambda: now[0], lease_ttl=1.0)
    lease = m.leases.open(None, "t")[0].lease_id
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    m.swap_out(lease, [v.seq_id])
    other = m.leases.open(None, "u")[0].lease_id
    (w,) = m.allocate(other, [Allocation(12, tuple(range(400, 412)))])
    granted(m, w)  # V's block 1 offload pending in W's step
    now[0] = 5.0
    m.leases.expire()
    m.drain_released()
    m.check_invariants()
    s = m.stats()
    assert (s.used_blocks, s.host_used_blocks, s.num_sequences, s.swapped_sequences) == (0, 0, 0, 0)
    assert s.available_blocks == s.total_blocks and s.host_free_blocks + s.host_cached_blocks == s.host_total_blocks


def test_an_allocation_that_does_not_fit_pins_nothing_in_either_tier():
    m, lease = manager()
    _, b = cached_then_evicted(m, lease)
    step(m, lease, b)  # A's two blocks are cached on the host; B holds the whole pool
    before = m.stats()
    assert m.allocate(lease, [Allocation(9, A)]) == OutOfBlocks(3, 0)
    after = m.stats()
    assert after.allocation_failures == before.allocation_failures + 1
    assert dataclasses.replace(after, allocation_failures=before.allocation_failures) == before
    assert m.tiers.host.pins == [0, 0, 0, 0]
    m.check_invariants()


def test_a_swap_in_with_a_bad_append_changes_nothing():
    m, lease = manager(num_blocks=4, host=4)
    (v,) = m.allocate(lease, [Allocation(7, tuple(range(300, 307)))])
    step(m, lease, v)
    m.swap_out(lease, [v.seq_id])
    before = (m.stats(), m.sequence_info(v.seq_id))
    for bad in ([Append(v.seq_id + 1, 1)], [Append(v.seq_id, 1), Append(v.seq_id, 1)], [Append(v.seq_id, 0)],
                [Append(v.seq_id, 2, (1,))], [Append(v.seq_id, 4 * 4)]):
        with pytest.raises(InvalidArgumentError):
            m.swap_in(lease, [v.seq_id], bad)
        assert (m.stats(), m.sequence_info(v.seq_id)) == before
    m.check_invariants()


def test_lookup_prefix_counts_both_tiers_and_changes_nothing():
    m, lease = manager()
    a, b = cached_then_evicted(m, lease)
    key = a.cache_key
    assert m.lookup_prefix(list(A), key) == (0, 0)  # A's blocks are pending on the host: not yet
    step(m, lease, b)
    before, lru = m.stats(), list(m.tiers.host.lru)
    assert m.lookup_prefix(list(A), key) == (0, 8)  # both full blocks, on the host
    assert m.lookup_prefix(list(A[:8]), key) == (0, 4)  # never the block holding the last token
    assert m.lookup_prefix(list(A), CacheKey("other-model")) == (0, 0)
    assert (m.stats(), list(m.tiers.host.lru)) == (before, lru)  # read-only
    m.free(lease, [b.seq_id])
    (c,) = m.allocate(lease, [Allocation(9, A)])
    step(m, lease, c)  # the reloads proven: A's blocks are device hits again
    assert m.lookup_prefix(list(A), key) == (8, 0)
