"""Automatic prefix caching in the block manager: exact hits, isolation, eviction order, events."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, Commit, CommitResult, OutOfBlocks
from pagedkv.runtime.block_hash import CacheKey, block_hash, chain_hashes
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, OutOfRangeError

B = 4


def alloc(m, lease, tokens, key=CacheKey(), n=None):
    """Allocate a sequence for all of ``tokens`` (or ``n`` new ones) and return it."""
    (seq,) = m.allocate(lease, [Allocation(n or len(tokens), tuple(tokens), key)])
    return seq


def run(m, lease, tokens, key=CacheKey()):
    """Allocate, 'compute' everything, commit: what a client does for one prompt."""
    seq = alloc(m, lease, tokens, key)
    m.commit_computed(lease, [Commit(seq.seq_id, seq.num_tokens)])
    return seq


@pytest.fixture
def m():
    return BlockManager(num_blocks=12, block_size=B)


@pytest.fixture
def lease(m):
    return m.leases.create().lease_id


def test_same_prompt_twice_hits_every_full_block_but_the_last_token(m, lease):
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = run(m, lease, prompt)
    assert a.num_cached_tokens == 0 and a.block_ids == [0, 1, 2]
    b = alloc(m, lease, prompt)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == [0, 1] and b.block_ids[2] not in a.block_ids
    assert m.pool.ref_counts[:3] == [2, 2, 1]
    s = m.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)
    m.check_invariants()


def test_block_aligned_prompt_recomputes_its_last_block(m, lease):
    prompt = list(range(8))  # exactly 2 blocks
    a = run(m, lease, prompt)
    b = alloc(m, lease, prompt)
    # Only the first block is shared: the last one holds the last token, which must be recomputed,
    # into a fresh block (never written into a block with refcount > 1).
    assert b.num_cached_tokens == 4 and b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert m.pool.ref_counts[a.block_ids[1]] == 1


def test_prompts_differing_in_last_partial_block(m, lease):
    run(m, lease, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    b = alloc(m, lease, [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97])
    assert b.num_cached_tokens == 8
    c = alloc(m, lease, [1, 2, 3, 4, 5, 6, 7, 9, 9])  # differs inside the second block
    assert c.num_cached_tokens == 4


@pytest.mark.parametrize("other", [CacheKey(cache_salt="tenant-b"), CacheKey(model_id="another-model")])
def test_salt_and_model_identity_isolate(m, lease, other):
    prompt = list(range(9))
    run(m, lease, prompt, CacheKey(model_id="m", cache_salt="tenant-a") if other.cache_salt else CacheKey(model_id="m"))
    assert alloc(m, lease, prompt, other).num_cached_tokens == 0
    same = CacheKey(model_id="m", cache_salt="tenant-a") if other.cache_salt else CacheKey(model_id="m")
    assert alloc(m, lease, prompt, same).num_cached_tokens == 8


def test_hash_domains_are_separate():
    k = CacheKey()
    # Moving a value between fields never gives the same hash.
    assert block_hash(None, [1, 2], k) != block_hash(None, [1, 2], CacheKey(cache_salt="\x00"))
    assert block_hash(None, [], CacheKey(model_id="ab")) != block_hash(None, [], CacheKey(model_id="a", cache_salt="b"))
    assert block_hash(b"x" * 32, [1], k) != block_hash(None, [1], k)
    assert block_hash(None, [1, 2], k) != block_hash(None, [2, 1], k)


def test_hashes_stable_across_processes():
    here = chain_hashes(list(range(12)), 4, CacheKey("smollm2", "salt"), 3)
    code = ("from pagedkv.runtime.block_hash import CacheKey, chain_hashes;"
            "print([h.hex() for h in chain_hashes(list(range(12)), 4, CacheKey('smollm2', 'salt'), 3)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([h.hex() for h in here])


def test_freed_blocks_are_cached_then_evicted_lru_leaves_first(m, lease):
    a = run(m, lease, list(range(0, 12)) + [99])    # blocks 0,1,2 full + 3 partial
    b = run(m, lease, list(range(50, 58)) + [99])   # blocks 4,5 full + 6 partial
    m.free(lease, [a.seq_id])
    m.free(lease, [b.seq_id])
    s = m.stats()
    assert (s.cached_blocks, s.used_blocks, s.free_blocks) == (5, 0, 7)
    # Free (hash-less) blocks are reused first: partial blocks 6, 3 then never-used 7..11.
    first = alloc(m, lease, list(range(200, 228)))   # 7 blocks: takes every free block
    assert sorted(first.block_ids) == [3, 6, 7, 8, 9, 10, 11]
    assert m.stats().prefix_cache_evictions == 0
    # Then cached blocks go LRU: a's blocks (freed first) before b's, each sequence's leaf first.
    second = alloc(m, lease, list(range(300, 308)))  # 2 blocks
    assert second.block_ids == [2, 1]
    assert m.stats().prefix_cache_evictions == 2
    # a's first block is still cached: a prompt sharing it hits it.
    again = alloc(m, lease, list(range(0, 4)) + [7])
    assert again.num_cached_tokens == 4 and again.block_ids[0] == 0
    m.check_invariants()


def test_failed_allocation_evicts_nothing(m, lease):
    a = run(m, lease, list(range(13)))  # 4 blocks, 3 full and cached once freed
    m.free(lease, [a.seq_id])
    filler = alloc(m, lease, list(range(500, 536)))  # the 9 free blocks taken: 3 left, all cached
    assert m.stats().free_blocks == 0 and m.stats().cached_blocks == 3
    before = (list(m.pool.free_queue), dict(m.prefix_cache.cached), m.stats())
    result = m.allocate(lease, [Allocation(20, tuple(range(900, 920)))])
    assert isinstance(result, OutOfBlocks)
    assert (list(m.pool.free_queue), dict(m.prefix_cache.cached)) == before[:2]
    assert m.stats().prefix_cache_evictions == 0 and m.stats().cached_blocks == 3
    del filler


def test_hits_are_pinned_before_eviction_in_the_same_call(m, lease):
    prompt = list(range(9))                        # 2 full blocks cached
    a = run(m, lease, prompt)
    m.free(lease, [a.seq_id])
    alloc(m, lease, list(range(600, 636)))         # 9 of the 10 free blocks: 1 free + 2 cached left
    assert m.stats().cached_blocks == 2 and m.stats().available_blocks == 3
    # Needs its 2 hits plus 1 new block: exactly what is available without evicting its own hits.
    b = alloc(m, lease, prompt)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    m.check_invariants()


def test_commit_after_free_registers_nothing(m, lease):
    a = alloc(m, lease, list(range(9)))
    m.free(lease, [a.seq_id])
    assert m.commit_computed(lease, [Commit(a.seq_id, 9)]) == CommitResult(blocks_registered=0, skipped=1)
    assert m.stats().cached_blocks == 0 and not m.prefix_cache.cached
    with pytest.raises(NotFoundError):
        m.commit_computed(lease, [Commit(10**6, 1)])
    b = alloc(m, lease, list(range(9)))
    with pytest.raises(InvalidArgumentError):
        m.commit_computed(lease, [Commit(b.seq_id, 10)])


def test_only_committed_blocks_are_shared(m, lease):
    a = alloc(m, lease, list(range(10)))
    m.commit_computed(lease, [Commit(a.seq_id, 5)])  # only the first block's KV is written
    assert alloc(m, lease, list(range(10))).num_cached_tokens == 4


def test_decode_tokens_extend_the_cache_chain(m, lease):
    a = run(m, lease, [1, 2, 3, 4, 5, 6])
    m.append_slots(lease, [Append(a.seq_id, 2, (7, 8))])
    m.commit_computed(lease, [Commit(a.seq_id, 8)])
    assert alloc(m, lease, [1, 2, 3, 4, 5, 6, 7, 8, 9]).num_cached_tokens == 8


def test_events_in_order(m, lease):
    a = run(m, lease, list(range(9)))
    h0, h1 = chain_hashes(list(range(9)), B, CacheKey(), 2)
    stored = [(e.kind, e.block_id, e.block_hash, e.parent_hash) for e in m.prefix_cache.events]
    assert stored == [("stored", a.block_ids[0], h0, b""), ("stored", a.block_ids[1], h1, h0)]
    m.free(lease, [a.seq_id])
    assert m.reset_prefix_cache() == 2
    assert [e.kind for e in m.prefix_cache.events][-1] == "cleared"
    assert [e.sequence_number for e in m.prefix_cache.events] == list(range(1, len(m.prefix_cache.events) + 1))
    assert m.stats().cached_blocks == 0 and m.stats().free_blocks == 12


def test_event_cursor_replays_follows_and_refuses_dropped_events():
    m = BlockManager(12, B, max_events=3)
    lease = m.leases.create().lease_id
    cursor = m.prefix_cache.subscribe()  # only events from now on
    run(m, lease, list(range(9)))  # events 1, 2: two blocks stored
    assert [e.sequence_number for e in cursor.poll()] == [1, 2] and cursor.poll() == []
    for _ in range(3):
        m.reset_prefix_cache()  # events 3, 4, 5; the log keeps the last 3
    assert [e.kind for e in cursor.poll()] == ["cleared"] * 3
    with pytest.raises(FailedPreconditionError, match="resubscribe from 3"):
        m.prefix_cache.subscribe(2)
    assert [e.sequence_number for e in m.prefix_cache.subscribe(3).poll()] == [3, 4, 5]
    assert m.prefix_cache.subscribe(6).poll() == []  # the next event: waits for it
    for first in (7, 2**64 - 1):  # past it: refused, not silent
        with pytest.raises(OutOfRangeError, match=f"from_sequence_number {first} is past the next KV event"):
            m.prefix_cache.subscribe(first)


def test_prefix_caching_off(lease):
    m = BlockManager(12, B, prefix_caching=False)
    lease = m.leases.create().lease_id
    run(m, lease, list(range(9)))
    assert alloc(m, lease, list(range(9))).num_cached_tokens == 0
    assert not m.prefix_cache.cached and m.stats().prefix_cache_queries == 0


def test_batch_pins_every_hit_before_any_eviction(m, lease):
    """Request A (no hit) must not evict the cached blocks request B of the same call hits."""
    p1 = run(m, lease, list(range(1, 9)) + [100])      # blocks 0, 1 cached once freed; 2 partial
    p2 = run(m, lease, list(range(200, 208)) + [300])  # blocks 3, 4 cached once freed; 5 partial
    m.free(lease, [p1.seq_id])
    m.free(lease, [p2.seq_id])
    alloc(m, lease, list(range(400, 432)))             # the 8 hash-less blocks: LRU order 1, 0, 4, 3 is left
    assert list(m.pool.free_queue) == [1, 0, 4, 3]
    a, b = m.allocate(lease, [Allocation(1, (77,)), Allocation(9, tuple(range(1, 9)) + (5,))])
    assert b.num_cached_tokens == 8 and b.block_ids == [0, 1, 3]
    assert a.block_ids == [4]  # evicted p2's blocks, never b's hits
    assert m.stats().prefix_cache_evictions == 2
    m.check_invariants()


def test_a_chunked_prompt_caches_the_tokens_it_was_computed_with():
    # The first chunk's allocation sends the whole prompt (for the lookup) but holds slots for 8 tokens;
    # the next chunk's append sends its own tokens. The blocks after the prompt must hash the tokens
    # appended there, not the prompt's tail seen twice.
    m = BlockManager(16, 4)
    lease = m.leases.create().lease_id
    prompt = list(range(100, 112))
    (seq,) = m.allocate(lease, [Allocation(8, tuple(prompt))])
    assert seq.num_tokens == 8 and seq.token_ids == prompt[:8]
    m.append_slots(lease, [Append(seq.seq_id, 4, prompt[8:])])
    m.append_slots(lease, [Append(seq.seq_id, 4, [7, 8, 9, 10])])
    assert seq.token_ids == prompt + [7, 8, 9, 10]
    assert m.commit_computed(lease, [Commit(seq.seq_id, 16)]).blocks_registered == 4
    (again,) = m.allocate(lease, [Allocation(1, tuple(prompt + [7, 8, 9, 10, 11]))])
    assert again.num_cached_tokens == 16 and again.block_ids[:4] == seq.block_ids


def test_a_reset_in_steps_drops_what_was_cached_and_lets_the_cache_change_between_steps():
    m = BlockManager(16, 4)
    lease = m.leases.create().lease_id
    (seq,) = m.allocate(lease, [Allocation(24, tuple(range(24)))])
    m.commit_computed(lease, [Commit(seq.seq_id, 24)])
    m.free(lease, [seq.seq_id])
    assert m.stats().cached_blocks == 6
    steps = m.reset_prefix_cache_steps(2)
    assert next(steps) == 2 and m.stats().cached_blocks == 4
    # Between steps an allocation takes the 12 free blocks (2 of them dropped by the first step) and
    # evicts 3 of the 4 still cached.
    m.allocate(lease, [4 * 15])
    assert (m.stats().cached_blocks, m.prefix_cache.evictions) == (1, 3)
    assert next(steps) == 3  # the second step: one of its two blocks was still cached
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value == 3  # the last step's two blocks had both been evicted
    m.check_invariants()
    assert m.stats().cached_blocks == 0 and len(m.prefix_cache.cached) == 0
    assert m.prefix_cache.subscribe(1).poll()[-1].kind == "cleared"
