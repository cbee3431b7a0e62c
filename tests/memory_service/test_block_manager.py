"""Scenario tests of the block manager: exact block ids, refcounts and free counts, step by step."""

from __future__ import annotations

import itertools

import pytest

from memory_service.manager import block_manager
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, BlockCopy, BlockTableUpdate, OutOfBlocks
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from pagedkv.runtime.limits import MAX_FORK_CHILDREN


class FakeClock:
    """A clock tests advance by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(m: BlockManager):
    """Everything an all-or-nothing failure must leave unchanged."""
    return (
        list(m.pool.ref_counts),
        list(m.pool.fill),
        list(m.pool.free_queue),
        {s: (q.num_tokens, list(q.block_ids)) for s, q in m.sequences.items()},
        m.pool.tokens_stored,
    )


@pytest.fixture
def m() -> BlockManager:
    return BlockManager(num_blocks=10, block_size=4, clock=FakeClock())


def test_allocate_append_fork_cow_free_step_by_step(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [6])
    assert (a.seq_id, a.block_ids, a.num_tokens) == (0, [0, 1], 6)
    assert m.pool.ref_counts[:3] == [1, 1, 0] and m.stats().free_blocks == 8
    assert m.stats().tokens_stored == 6

    # Append inside the last block: no new block.
    copies = m.append_slots(lease, [Append(a.seq_id, 2)]).copies
    assert a.block_ids == [0, 1] and copies == [] and m.stats().free_blocks == 8
    # Append across the boundary: one new block, id 2.
    copies = m.append_slots(lease, [Append(a.seq_id, 1)]).copies
    assert a.block_ids == [0, 1, 2] and a.num_tokens == 9 and m.stats().free_blocks == 7

    # Fork twice: children share every block.
    b, c = m.fork(lease, [a.seq_id, a.seq_id])
    assert (b.seq_id, c.seq_id) == (1, 2)
    assert b.block_ids == c.block_ids == [0, 1, 2] and b.parent_seq_id == 0
    assert m.pool.ref_counts[:4] == [3, 3, 3, 0] and m.stats().free_blocks == 7
    assert m.stats().shared_block_refs == 9

    # Copy-on-write on each child: last block 2 is partly filled (1 of 4) and shared.
    copies = m.append_slots(lease, [Append(b.seq_id, 1)]).copies
    assert copies == [BlockCopy(2, 3)] and b.block_ids == [0, 1, 3]
    assert m.pool.ref_counts[:5] == [3, 3, 2, 1, 0]
    copies = m.append_slots(lease, [Append(c.seq_id, 1)]).copies
    assert copies == [BlockCopy(2, 4)] and c.block_ids == [0, 1, 4]
    assert m.pool.ref_counts[:5] == [3, 3, 1, 1, 1]
    # The parent is now alone on block 2: it writes in place.
    copies = m.append_slots(lease, [Append(a.seq_id, 1)]).copies
    assert copies == [] and a.block_ids == [0, 1, 2]
    assert m.stats().free_blocks == 5 and m.stats().used_blocks == 5
    # Stored tokens: blocks 0, 1 full (8) + block 2, 3, 4 with 2 each.
    assert m.stats().tokens_stored == 14
    m.check_invariants()

    assert m.free(lease, [b.seq_id]) == 1  # block 3
    assert m.pool.ref_counts[:5] == [2, 2, 1, 0, 1]
    assert m.free(lease, [a.seq_id]) == 1  # block 2
    assert m.pool.ref_counts[:5] == [1, 1, 0, 0, 1]
    assert m.free(lease, [c.seq_id]) == 3  # blocks 4, 1, 0
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.available_blocks, s.tokens_stored) == (0, 10, 10, 0)
    m.check_invariants()


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_free_in_every_order(m: BlockManager, order):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [9])  # blocks 0, 1, 2
    b, c = m.fork(lease, [a.seq_id, a.seq_id])
    m.append_slots(lease, [Append(b.seq_id, 1)])  # b -> [0, 1, 3]
    m.append_slots(lease, [Append(c.seq_id, 4)])  # c -> [0, 1, 4, 5]
    seqs = [a.seq_id, b.seq_id, c.seq_id]
    exclusive = {a.seq_id: {2}, b.seq_id: {3}, c.seq_id: {4, 5}}
    live = set(seqs)
    for i in order:
        sid = seqs[i]
        live.discard(sid)
        expected = len(exclusive[sid]) + (2 if not live else 0)
        assert m.free(lease, [sid]) == expected
        m.check_invariants()
    assert m.stats().used_blocks == 0 and m.stats().available_blocks == 10


def test_batched_append_copies_in_order(m: BlockManager):
    """Two children and the parent append in one call: two copies, the parent stays in place."""
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [5])  # [0, 1]
    b, c = m.fork(lease, [0, 0])
    result = m.append_slots(lease, [Append(b.seq_id, 1), Append(c.seq_id, 1), Append(a.seq_id, 1)])
    assert result.copies == [BlockCopy(1, 2), BlockCopy(1, 3)]
    assert [s.block_ids for s in (b, c, a)] == [[0, 2], [0, 3], [0, 1]]
    # Only the copied tables changed, from their last entry on; the parent's is not reported.
    assert result.updates == [BlockTableUpdate(b.seq_id, 6, 1, (2,)), BlockTableUpdate(c.seq_id, 6, 1, (3,))]
    assert m.pool.ref_counts[:4] == [3, 1, 1, 1]
    m.check_invariants()


def test_block_aligned_fork_needs_no_copy(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [8])  # [0, 1], both full
    (b,) = m.fork(lease, [a.seq_id])
    copies = m.append_slots(lease, [Append(b.seq_id, 1)]).copies
    assert copies == [] and b.block_ids == [0, 1, 2]
    assert m.pool.ref_counts[:3] == [2, 2, 1]


def test_a_failover_fork_keeps_the_proven_tokens_and_leaves_the_step_in_flight_its_blocks(m: BlockManager):
    """A (9 tokens, 6 proven) had a step in flight writing positions 6-8 when its worker failed. Its
    proven-only child holds blocks 0 and 1 only; block 2, which the lost step may still write, stays
    the parent's alone, and the child's recompute of position 6 goes into a copy of block 1."""
    from memory_service.manager.requests import Commit

    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [Allocation(9, tuple(range(9)))])  # [0, 1, 2]
    m.commit_computed(lease, [Commit(a.seq_id, 6)])
    (b,) = m.fork(lease, [a.seq_id], [True])
    assert (b.block_ids, b.num_tokens, b.num_proven, b.token_ids) == ([0, 1], 6, 6, list(range(6)))
    assert m.pool.ref_counts[:4] == [2, 2, 1, 0]
    result = m.append_slots(lease, [Append(b.seq_id, 3, (6, 7, 8))])
    assert result.copies == [BlockCopy(1, 3)] and b.block_ids == [0, 3, 4]
    assert m.pool.ref_counts[:5] == [2, 1, 1, 1, 1]
    m.check_invariants()
    assert m.free(lease, [a.seq_id]) == 2  # the lost step's block 2, and block 1
    assert m.pool.ref_counts[:5] == [1, 0, 0, 1, 1]
    # B's copy of block 1 into 3 is not proven (its step did not come back): block 3 does not hold
    # B's proven positions 4-5 yet, so B's own failover child ends before it.
    (c,) = m.fork(lease, [b.seq_id], [True])
    assert (c.block_ids, c.num_tokens, c.num_proven) == ([0], 4, 4) and m.pool.ref_counts[:5] == [2, 0, 0, 1, 1]
    m.free(lease, [c.seq_id])
    m.commit_computed(lease, [Commit(b.seq_id, 9)])  # its step came back: block 3 holds them now
    (c,) = m.fork(lease, [b.seq_id], [True])
    assert (c.block_ids, c.num_tokens) == ([0, 3, 4], 9) and m.pool.ref_counts[:5] == [2, 0, 0, 2, 2]
    (d,) = m.allocate(lease, [Allocation(3, (1, 2, 3))])  # its prefill was the step lost: nothing proven
    (e,) = m.fork(lease, [d.seq_id], [True])
    assert (e.block_ids, e.num_tokens) == ([], 0)
    assert m.append_slots(lease, [Append(e.seq_id, 3, (1, 2, 3))]).copies == [] and e.num_tokens == 3
    assert len(e.block_ids) == 1 and e.block_ids != d.block_ids
    m.free(lease, [d.seq_id, e.seq_id])
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="proven_only names 1 forks of 2"):
        m.fork(lease, [b.seq_id, b.seq_id], [True])
    assert snapshot(m) == before
    m.check_invariants()


def test_out_of_blocks_changes_nothing(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [30])  # 8 blocks, 2 left
    (b,) = m.fork(lease, [a.seq_id])
    before = snapshot(m)
    # 3 blocks needed (1 + 2), 2 available: refused whole.
    result = m.allocate(lease, [4, 8])
    assert result == OutOfBlocks(required=3, available=2)
    assert snapshot(m) == before
    # a: copy-on-write of shared block 7 (1 block); b, now alone on 7: 30 -> 37 tokens
    # needs 2 more blocks. 3 > 2: refused whole, a's copy is not half-applied.
    result = m.append_slots(lease, [Append(a.seq_id, 2), Append(b.seq_id, 7)])
    assert result == OutOfBlocks(required=3, available=2)
    assert snapshot(m) == before
    assert m.stats().allocation_failures == 2
    m.check_invariants()


def test_bad_input_changes_nothing(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [5])
    other = m.leases.create().lease_id
    before = snapshot(m)
    cases = [
        (InvalidArgumentError, lambda: m.allocate(lease, [])),
        (InvalidArgumentError, lambda: m.allocate(lease, [0])),
        (InvalidArgumentError, lambda: m.allocate(lease, [-3])),
        (InvalidArgumentError, lambda: m.allocate(lease, [4, 41])),  # more than the pool could ever hold
        (InvalidArgumentError, lambda: m.allocate(lease, [Allocation(1, tuple(range(41)))])),  # token ids too
        (InvalidArgumentError, lambda: m.append_slots(lease, [Append(a.seq_id, 0)])),
        (InvalidArgumentError, lambda: m.append_slots(lease, [Append(a.seq_id, 1), Append(a.seq_id, 1)])),
        (NotFoundError, lambda: m.append_slots(lease, [Append(a.seq_id, 1), Append(999, 1)])),
        (NotFoundError, lambda: m.free(lease, [a.seq_id, 77])),
        (NotFoundError, lambda: m.free(other, [a.seq_id])),
        (NotFoundError, lambda: m.fork(lease, [12345])),
        (InvalidArgumentError, lambda: m.fork(lease, [a.seq_id] * (MAX_FORK_CHILDREN + 1))),  # bounded work
        (NotFoundError, lambda: m.allocate("nope", [4])),
        (InvalidArgumentError, lambda: m.allocate("", [4])),
        (InvalidArgumentError, lambda: m.leases.create(ttl=-1)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert snapshot(m) == before


def test_fork_whose_reply_would_not_fit_changes_nothing(m: BlockManager, monkeypatch):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [9])  # 3 blocks of 4
    monkeypatch.setattr(block_manager, "MAX_FORK_BLOCK_IDS", 10)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="12 entries"):
        m.fork(lease, [a.seq_id] * 4)
    assert snapshot(m) == before
    assert len(m.fork(lease, [a.seq_id] * 3)) == 3  # 9 entries fit


def test_double_free_is_an_error(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [5])
    m.free(lease, [a.seq_id])
    with pytest.raises(NotFoundError, match="already freed"):
        m.free(lease, [a.seq_id])
    assert m.stats().used_blocks == 0


def test_lease_expiry_frees_everything(m: BlockManager):
    clock = m.leases.clock
    lease = m.leases.create(ttl=5).lease_id
    keep = m.leases.create(ttl=5).lease_id
    (a,) = m.allocate(lease, [10])
    m.fork(lease, [a.seq_id])
    (k,) = m.allocate(keep, [3])
    clock.now += 4
    m.leases.keep_alive(keep)
    clock.now += 2  # lease is 6 s old, keep renewed 2 s ago
    s = m.stats()
    assert (s.num_leases, s.num_sequences, s.used_blocks) == (1, 1, 1)
    with pytest.raises(FailedPreconditionError, match="expired"):
        m.allocate(lease, [1])
    with pytest.raises(NotFoundError, match="already freed"):
        m.get_sequence(a.seq_id)
    assert m.leases.release(keep) == 1
    assert m.stats().used_blocks == 0 and m.stats().num_leases == 0
    m.check_invariants()


def test_utilization_counts_shared_blocks_once(m: BlockManager):
    lease = m.leases.create().lease_id
    (a,) = m.allocate(lease, [6])  # 6 tokens in 2 blocks of 4
    m.fork(lease, [a.seq_id, a.seq_id])
    s = m.stats()
    assert s.tokens_stored == 6 and s.used_blocks == 2 and s.utilization == pytest.approx(6 / 8)
