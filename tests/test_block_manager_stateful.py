"""A Hypothesis state machine over allocate / append / fork / free / lease expiry.

Beside the block manager it keeps a model of what a worker would hold: a slot
store written through each block table, with copy-on-write copies applied
before writes. Prompts share prefixes and every computed token is committed,
so the prefix cache hits, evicts and re-registers blocks as it would in
service. After every step, DESIGN.md's invariants hold and every live
sequence reads back exactly its own token history through its block table:
so a copy-on-write that was missing, misdirected or shared a written block,
or a prefix-cache hit on the wrong content, would fail here.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory_service.block_manager import BlockManager
from memory_service.requests import Allocation, Append, Commit, OutOfBlocks
from pagedkv.errors import FailedPreconditionError

NUM_BLOCKS = 12
BLOCK_SIZE = 3
TTL = 5.0
#: Shared prompt prefixes (tokens from a tiny vocabulary, so contents repeat and the cache hits).
PREFIXES = [(), (1, 2, 3, 1, 2, 3), (1, 2, 3, 3, 2, 1, 0), (2, 2, 2, 2, 2, 2, 2, 2, 2, 2)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.m = BlockManager(NUM_BLOCKS, BLOCK_SIZE, lease_ttl=TTL, clock=self.clock)
        self.leases = [self.m.leases.create().lease_id, self.m.leases.create().lease_id]
        self.renewed = {lease: 0.0 for lease in self.leases}
        #: seq_id -> (lease, token history)
        self.history: dict[int, tuple[str, list[int]]] = {}
        #: slot store: slot -> token, as a worker's KV cache would hold it
        self.slots: dict[int, int] = {}

    # -- helpers
    def _write(self, seq_id: int, block_ids: list[int], start: int, tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            p = start + i
            self.slots[block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = t

    def _live_lease(self, i: int) -> str:
        return self.leases[i % len(self.leases)]

    def _forget_expired(self) -> None:
        for lease, t in self.renewed.items():
            if self.clock.now >= t + TTL:
                for s in [s for s, (l, _) in self.history.items() if l == lease]:
                    del self.history[s]

    # -- rules
    @rule(lease=st.integers(0, 1), prompts=st.lists(
        st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=4)), min_size=1, max_size=3))
    def allocate(self, lease, prompts):
        lease_id = self._live_lease(lease)
        token_lists = [list(prefix) + tail for prefix, tail in prompts]
        token_lists = [t or [0] for t in token_lists]
        try:
            result = self.m.allocate(lease_id, [Allocation(len(t), tuple(t)) for t in token_lists])
        except FailedPreconditionError:
            assert self.clock.now >= self.renewed[lease_id] + TTL
            return
        if isinstance(result, OutOfBlocks):
            assert result.required > result.available
            return
        for seq, toks in zip(result, token_lists):
            assert seq.num_tokens == len(toks) and seq.num_cached_tokens < len(toks)
            # The worker computes only what the cache does not hold.
            self._write(seq.seq_id, seq.block_ids, seq.num_cached_tokens, toks[seq.num_cached_tokens:])
            self.history[seq.seq_id] = (lease_id, toks)
        self.m.commit_computed(lease_id, [Commit(seq.seq_id, seq.num_tokens) for seq in result])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def append(self, data):
        ids = sorted(self.history)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        lease_id = self.history[chosen[0]][0]
        chosen = [s for s in chosen if self.history[s][0] == lease_id]
        news = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)) for _ in chosen]
        tables = {s: list(self.m.get_sequence(s).block_ids) for s in chosen}  # a client's copy
        result = self.m.append_slots(lease_id, [Append(s, len(t), tuple(t)) for s, t in zip(chosen, news)])
        if isinstance(result, OutOfBlocks):
            return
        seqs = [self.m.get_sequence(s) for s in chosen]
        # The deltas bring the client's copy of each table up to date.
        for u in result.updates:
            tables[u.seq_id][u.first_changed:] = u.block_ids
        assert [tables[s.seq_id] for s in seqs] == [s.block_ids for s in seqs]
        # The worker does every copy before any write.
        for c in result.copies:
            for o in range(BLOCK_SIZE):
                if c.src * BLOCK_SIZE + o in self.slots:
                    self.slots[c.dst * BLOCK_SIZE + o] = self.slots[c.src * BLOCK_SIZE + o]
        for seq, new in zip(seqs, news):
            lease, toks = self.history[seq.seq_id]
            self._write(seq.seq_id, seq.block_ids, len(toks), new)
            toks.extend(new)
        self.m.commit_computed(lease_id, [Commit(seq.seq_id, seq.num_tokens) for seq in seqs])

    @precondition(lambda self: self.history)
    @rule(data=st.data(), copies=st.integers(1, 3))
    def fork(self, data, copies):
        parent = data.draw(st.sampled_from(sorted(self.history)))
        lease_id, toks = self.history[parent]
        for child in self.m.fork(lease_id, [parent] * copies):
            assert child.block_ids == self.m.get_sequence(parent).block_ids
            self.history[child.seq_id] = (lease_id, list(toks))

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.history)))
        lease_id, _ = self.history.pop(sid)
        self.m.free(lease_id, [sid])

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def advance_clock(self, seconds):
        self.clock.now += seconds
        self._forget_expired()
        self.m.leases.expire()
        for i, lease in enumerate(self.leases):
            if lease not in self.m.leases:
                self.leases[i] = self.m.leases.create().lease_id
                self.renewed[self.leases[i]] = self.clock.now

    @rule(lease=st.integers(0, 1))
    def keep_alive(self, lease):
        lease_id = self._live_lease(lease)
        self.m.leases.keep_alive(lease_id)
        self.renewed[lease_id] = self.clock.now

    # -- invariants
    @invariant()
    def invariants_hold(self):
        self.m.check_invariants()
        s = self.m.stats()
        assert s.free_blocks + s.cached_blocks + s.used_blocks == s.total_blocks == NUM_BLOCKS
        assert set(self.m.sequences) == set(self.history)

    @invariant()
    def every_sequence_reads_its_own_history(self):
        for sid, (_, toks) in self.history.items():
            seq = self.m.get_sequence(sid)
            assert seq.num_tokens == len(toks)
            read = [self.slots[seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] for p in range(len(toks))]
            assert read == toks, f"sequence {sid} reads {read}, wrote {toks}"

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for b in self.m.prefix_cache.cached.values():
            written = tuple(self.slots.get(b * BLOCK_SIZE + o) for o in range(BLOCK_SIZE))
            assert written == self.m.prefix_cache.block_tokens[b], f"cached block {b} holds {written}"

    def teardown(self):
        for lease in list(self.m.leases):
            self.m.leases.release(lease)
        s = self.m.stats()
        assert s.used_blocks == 0 and s.available_blocks == NUM_BLOCKS


# `make test` runs a bounded search; `make test-full` (PAGEDKV_TEST_FULL=1) a long one.
FULL = os.environ.get("PAGEDKV_TEST_FULL") == "1"
TestBlockManagerMachine = pytest.mark.slow(BlockManagerMachine.TestCase)
TestBlockManagerMachine.settings = settings(
    max_examples=2000 if FULL else 150, stateful_step_count=60 if FULL else 40, deadline=None)
