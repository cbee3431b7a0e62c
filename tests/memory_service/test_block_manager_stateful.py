"""A Hypothesis state machine over allocate / append / fork / free / lease expiry and release, worker
steps with receipts, and the host tier behind the pool: offload, reload, swap out and in.

Beside the block manager it keeps a model of the KV bytes both tiers hold (tests/helpers/kv_tiers_model.py):
every call's grant copies (what the server puts in the grant) are done by a worker step in worker
order (offloads, reloads, copy-on-write, then writes), which hands in a receipt, honest (its tier
copies listed) or not (left out). Prompts share prefixes from a tiny vocabulary, so blocks are hit,
evicted to the host tier, reloaded and re-registered as they would be in service. After every step
DESIGN.md's invariants hold in both tiers, and:

- every live sequence reads back exactly its own proven KV through its block table (a swapped-out
  one: through the device blocks it keeps and the host blocks whose copies were proven);
- every prefix-cache entry of either tier holds exactly the KV its tokens say, and so does every hit
  an allocation returns (device hits, and reloads' host sources);
- a refused call (out of blocks, out of host blocks, a swap that cannot be done) changes nothing.

So a copy that was missing, misdirected, run in the wrong order, or proven by a receipt that did
not list it, would fail here.
"""

from __future__ import annotations

import os

import pytest
from helpers.kv_tiers_model import Clock, Job, KvContent, run_step, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, OutOfBlocks
from memory_service.tiers.host_tier import CACHED, FREE, HELD, PENDING
from memory_service.tiers.manager import DEVICE, HOST
from pagedkv.runtime.block_hash import CacheKey, chain_hashes
from pagedkv.runtime.errors import SWAP_LOST, FailedPreconditionError, OutOfHostBlocksError

NUM_BLOCKS = 12
HOST_BLOCKS = 6
BLOCK_SIZE = 3
TTL = 5.0
#: Shared prompt prefixes (tokens from a tiny vocabulary, so contents repeat and the cache hits).
PREFIXES = [(), (1, 2, 3, 1, 2, 3), (1, 2, 3, 3, 2, 1, 0), (2, 2, 2, 2, 2, 2, 2, 2, 2, 2),
            (0, 1, 0, 1, 0, 1, 3), (3, 3, 0, 0, 1, 1, 2, 2, 3, 3), (0, 0, 0, 3, 2, 1, 0)]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.m = BlockManager(NUM_BLOCKS, BLOCK_SIZE, lease_ttl=TTL, clock=self.clock, host_num_blocks=HOST_BLOCKS)
        self.leases = [self.m.leases.create().lease_id, self.m.leases.create().lease_id]
        self.renewed = {lease: 0.0 for lease in self.leases}
        #: seq_id -> (lease, token history)
        self.history: dict[int, tuple[str, list[int]]] = {}
        #: seq_id -> each grant it was given that no worker step ran yet, oldest first: its copies,
        #: each with its key as signed (pagedkv.runtime.grants.copy_tuple: the epochs a worker checks)
        self.grants: dict[int, list[list]] = {}
        #: Sequences swapped out, oldest first (as a scheduler swaps them back in).
        self.swapped: dict[int, None] = {}
        #: The KV bytes of both tiers.
        self.kv = KvContent(NUM_BLOCKS, HOST_BLOCKS, BLOCK_SIZE)
        #: Block hash -> the token ids up to that block's end (every prefix a sequence was given).
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    # -- helpers
    def _live_lease(self, i: int) -> str:
        return self.leases[i % len(self.leases)]

    def _forget(self, sid: int) -> None:
        del self.history[sid]
        self.grants.pop(sid, None)
        self.swapped.pop(sid, None)

    def _forget_expired(self) -> None:
        for lease, t in self.renewed.items():
            if self.clock.now >= t + TTL:
                for s in [s for s, (l, _) in self.history.items() if l == lease]:
                    self._forget(s)

    def _learn_prefixes(self, toks: list[int]) -> None:
        n = len(toks) // BLOCK_SIZE
        for i, k in enumerate(chain_hashes(toks, BLOCK_SIZE, CacheKey(), n)):
            self.prefix_of[k] = tuple(toks[:(i + 1) * BLOCK_SIZE])

    def _grant(self, seq, cow=()) -> list:
        """The copies of ``seq``'s grant as the server builds it (tier copies, then its copy-on-write)."""
        copies = [*self.m.tiers.grant_copies(seq), *(c for c in cow if c.seq_id == seq.seq_id)]
        self.grants.setdefault(seq.seq_id, []).append([(c, self.m.tiers.copy_key(c)) for c in copies])
        return copies

    def _ids(self, lease_id: str, ok) -> list[int]:
        return sorted(s for s, (l, _) in self.history.items() if l == lease_id and ok(self.m.sequences[s]))

    def _unchanged(self, before: tuple) -> None:
        assert snapshot(self.m) == before, "a refused call changed the manager's state"

    # -- rules
    @rule(data=st.data(), lease=st.integers(0, 1), prompts=st.lists(
        st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=4)), min_size=1, max_size=3))
    def allocate(self, data, lease, prompts):
        lease_id = self._live_lease(lease)
        token_lists = [list(prefix) + tail for prefix, tail in prompts]
        self._allocate(data, lease_id, [t or [0] for t in token_lists], retry=True)

    def _allocate(self, data, lease_id: str, token_lists: list[list[int]], retry: bool) -> None:
        before = snapshot(self.m) if not self.m.releasing_refs else None
        result = self.m.allocate(lease_id, [Allocation(len(t), tuple(t)) for t in token_lists])
        if isinstance(result, OutOfBlocks):
            assert result.required > result.available
            if before is not None:
                self._unchanged(before)
            if self._preempt(data, lease_id) and retry:  # and schedule again
                self._allocate(data, lease_id, token_lists, retry=False)
            return
        for seq, toks in zip(result, token_lists):
            assert seq.num_tokens == len(toks) and seq.num_proven == seq.num_cached_tokens < len(toks)
            assert seq.num_reloaded_tokens == len(seq.reloads) * BLOCK_SIZE
            device_hits = (seq.num_cached_tokens - seq.num_reloaded_tokens) // BLOCK_SIZE
            for i, b in enumerate(seq.block_ids[:device_hits]):
                assert not self.kv.wrong_slots(DEVICE, b, toks, i), f"device hit {b} holds other KV"
            for i, r in enumerate(seq.reloads, device_hits):
                assert (r.copy.dst, r.copy.dst_medium, r.copy.src_medium) == (seq.block_ids[i], DEVICE, HOST)
                assert self.m.tiers.host.state[r.copy.src] == CACHED
                assert not self.kv.wrong_slots(HOST, r.copy.src, toks, i), f"host hit {r.copy.src} holds other KV"
            self.history[seq.seq_id] = (lease_id, toks)
            self._learn_prefixes(toks)
            self._grant(seq)
        if data.draw(st.integers(0, 3)):  # most calls are followed by their step at once
            self._step(data, lease_id, [seq.seq_id for seq in result])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def append(self, data):
        lease_id = self._live_lease(data.draw(st.integers(0, 1)))
        # A client appends to a sequence whose last step ran (its receipt handed in).
        ids = self._ids(lease_id, lambda s: s.swap is None and s.num_proven == s.num_tokens)
        if not ids:
            return
        self._append(data, lease_id, data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True)))

    def _append(self, data, lease_id: str, chosen: list[int]) -> None:
        """Append tokens to ``chosen`` (sequences of ``lease_id`` whose last step ran); maybe step."""
        news = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)) for _ in chosen]
        tables = {s: list(self.m.sequences[s].block_ids) for s in chosen}  # a client's copy
        before = snapshot(self.m) if not self.m.releasing_refs else None
        result = self.m.append_slots(lease_id, [Append(s, len(t), tuple(t)) for s, t in zip(chosen, news)])
        if isinstance(result, OutOfBlocks):
            if before is not None:
                self._unchanged(before)
            self._preempt(data, lease_id)
            return
        seqs = [self.m.sequences[s] for s in chosen]
        # The deltas bring the client's copy of each table up to date.
        for u in result.updates:
            tables[u.seq_id][u.first_changed:] = u.block_ids
        assert [tables[s.seq_id] for s in seqs] == [s.block_ids for s in seqs]
        assert all(c.src_medium == c.dst_medium == DEVICE for c in result.copies)
        for seq, new in zip(seqs, news):
            toks = self.history[seq.seq_id][1]
            toks.extend(new)
            self._learn_prefixes(toks)
            self._grant(seq, result.copies)
        if data.draw(st.integers(0, 3)):
            self._step(data, lease_id, chosen)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def append_swapped(self, data):
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        before = snapshot(self.m)
        with pytest.raises(FailedPreconditionError):
            self.m.append_slots(self.history[sid][0], [Append(sid, 1, (0,))])
        self._unchanged(before)

    @rule(data=st.data(), lease=st.integers(0, 1))
    def worker_step(self, data, lease):
        lease_id = self._live_lease(lease)
        ids = self._ids(lease_id, lambda s: s.swap is None and s.num_proven < s.num_tokens)
        if ids:
            self._step(data, lease_id, data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True)))

    def _step(self, data, lease_id: str, chosen: list[int]) -> None:
        """A worker step over ``chosen`` (sequences of ``lease_id`` with positions to write), each
        job honest or not, and its receipts handed in."""
        jobs = []
        for sid in chosen:
            seq, grants = self.m.sequences[sid], self.grants[sid]
            # A worker refuses a grant whose copies' epochs moved since it was signed (a copy-on-write
            # source freed and handed out again meanwhile): the client recomputes that sequence.
            valid = [g for g in grants if all(self.m.tiers.copy_key(c) == k for c, k in g)]
            if not grants or grants[-1] not in valid:
                self._forget(sid)
                self.m.free(lease_id, [sid], preempted=True)
                continue
            # The step runs every grant not run yet (their copies, once each), or only the latest.
            runs = valid if data.draw(st.integers(0, 3)) else valid[-1:]
            copies = list(dict.fromkeys(c for g in runs for c, _ in g))
            honest = data.draw(st.integers(0, 5)) > 0
            jobs.append(Job(seq, self.history[sid][1], copies, do_tier=honest or data.draw(st.booleans()),
                            list_tier=honest))
        if not jobs:
            return
        chosen = [j.seq.seq_id for j in jobs]
        tiers, host = self.m.tiers, self.m.tiers.host
        # Each offload's target: False a cached block's, None a freed swapped sequence's, else (sequence, index).
        before = {j.seq.seq_id: ([r.copy for r in j.seq.reloads],
                                 [(c, tiers.swap_targets.get(c.dst, False)) for c in j.seq.offloads]) for j in jobs}
        receipts = run_step(self.m, self.kv, jobs)
        # A receipt writing into a block whose reload (a swap-in's) it does not list proves no
        # position: its tier copies settle, the reload stays, and the next step needs a new grant.
        stale = {r.seq_id for r, j in zip(receipts, jobs) if any(
            rl.copy.dst in r.block_ids and tiers.copy_key(rl.copy) not in r.copies for rl in j.seq.reloads)}
        proven_before = {j.seq.seq_id: j.seq.num_proven for j in jobs}
        result = self.m.commit_receipts(lease_id, receipts)
        assert [s.seq_id for s in result.accepted] == [s for s in chosen if s not in stale]
        assert result.skipped == len(stale)
        for job in jobs:
            seq = job.seq
            reloads, offloads = before[seq.seq_id]
            self.grants[seq.seq_id] = []
            if seq.seq_id in stale:
                assert not job.list_tier and seq.num_proven == proven_before[seq.seq_id]
                assert [r.copy for r in seq.reloads] == reloads and not seq.offloads
                self._grant(seq)  # the scheduler's next step asks for a new one
            else:
                assert seq.num_proven == seq.num_tokens and not seq.offloads and not seq.fresh_offloads
            for c, target in offloads:  # proven when the receipt lists them, dropped otherwise
                proven = job.list_tier and c in job.copies
                if target is False:
                    assert host.state[c.dst] == (CACHED if proven else FREE), f"offload to host block {c.dst}"
                elif target is None:
                    assert host.state[c.dst] == FREE
                else:
                    assert host.state[c.dst] == HELD and target[0].swap[target[1]].proven == proven
            if job.list_tier:
                assert not seq.reloads
            elif reloads and seq.seq_id not in stale:  # left out: they stay, and its blocks are not cached
                assert [r.copy for r in seq.reloads] == reloads and seq.token_ids is None

    @precondition(lambda self: self.history)
    @rule(data=st.data(), copies=st.integers(1, 3))
    def fork(self, data, copies):
        parent = data.draw(st.sampled_from(sorted(self.history)))
        lease_id, toks = self.history[parent]
        p = self.m.sequences[parent]
        if p.num_proven < p.num_tokens:
            return  # a client forks a sequence after its step
        if p.swap is not None or p.reloads:
            before = snapshot(self.m)
            with pytest.raises(FailedPreconditionError):
                self.m.fork(lease_id, [parent] * copies)
            self._unchanged(before)
            return
        for child in self.m.fork(lease_id, [parent] * copies):
            assert child.block_ids == p.block_ids and child.num_proven == p.num_proven
            assert self.m.tiers.grant_copies(child) == []
            self.history[child.seq_id] = (lease_id, list(toks))

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def failover_fork(self, data):
        """A worker's step was lost: the sequence goes on as a child holding only its proven tokens
        and the blocks that hold them (client.engine.failover), whatever its step left unproven."""
        parent = data.draw(st.sampled_from(sorted(self.history)))
        lease_id, toks = self.history[parent]
        p = self.m.sequences[parent]
        if p.swap is not None or p.reloads:
            before = snapshot(self.m)
            with pytest.raises(FailedPreconditionError):
                self.m.fork(lease_id, [parent], [True])
            self._unchanged(before)
            return
        (child,) = self.m.fork(lease_id, [parent], [True])
        # Short of a block whose copy-on-write is not proven yet: its proven tokens are not there.
        n = p.num_proven
        if p.copy_pending is not None:
            n = min(n, p.block_ids.index(p.copy_pending) * BLOCK_SIZE)
        assert child.block_ids == p.block_ids[:-(-n // BLOCK_SIZE)] and child.num_tokens == child.num_proven == n
        assert self.m.tiers.grant_copies(child) == []
        self.history[child.seq_id] = (lease_id, list(toks[:n]))

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.history)))
        lease_id = self.history[sid][0]
        self._forget(sid)
        self.m.free(lease_id, [sid])

    @rule(data=st.data(), lease=st.integers(0, 1))
    def swap_out(self, data, lease):
        lease_id = self._live_lease(lease)
        ids = self._swappable(lease_id)
        if ids:
            self._swap_out(lease_id, data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=2, unique=True)))

    def _swappable(self, lease_id: str) -> list[int]:
        # Not a sequence between an append with a copy-on-write and its step: that copy would be lost.
        return self._ids(lease_id, lambda s: s.swap is None and not any(
            c.src_medium == c.dst_medium == DEVICE for g in self.grants.get(s.seq_id, ()) for c, _ in g))

    def _preempt(self, data, lease_id: str) -> bool:
        """What a scheduler does when out of blocks: swap a sequence out, or free it to recompute later."""
        ids = self._swappable(lease_id)
        if not ids:
            return False
        sid = data.draw(st.sampled_from(ids))
        if not (data.draw(st.booleans()) and self._swap_out(lease_id, [sid])):
            self._forget(sid)
            self.m.free(lease_id, [sid], preempted=True)
        return True

    def _swap_out(self, lease_id: str, chosen: list[int]) -> bool:
        """Swap out ``chosen``; False (and nothing changed) when refused."""
        seqs = [self.m.sequences[s] for s in chosen]
        rc = self.m.pool.ref_counts
        own = sum(rc[b] == 1 for s in seqs for b in s.block_ids)
        before = snapshot(self.m)
        offloads = [c for q in seqs for c in (*q.fresh_offloads, *q.offloads)]  # dropped: its step will not run
        try:
            released, reserved = self.m.swap_out(lease_id, chosen)
        except OutOfHostBlocksError:
            assert own > self.m.tiers.host.num_available
            self._unchanged(before)
            return False
        except FailedPreconditionError:
            assert any(s.reloads for s in seqs)
            self._unchanged(before)
            return False
        assert reserved == own == released
        host = self.m.tiers.host
        held = [e.host for q in seqs for e in q.swap if e is not None]
        assert len(set(held)) == own and all(host.state[h] == HELD for h in held)
        assert all(host.state[c.dst] != PENDING for c in offloads), "a swapped sequence's offload stays pending"
        for s in chosen:
            self.swapped[s] = None
            self.grants[s] = []  # its step will not run
        return True

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), recompute=st.booleans())
    def swap_in(self, data, recompute):
        # Mostly the oldest first, as a scheduler readmits them.
        oldest = data.draw(st.integers(0, 3))
        first = next(iter(self.swapped)) if oldest else data.draw(st.sampled_from(sorted(self.swapped)))
        lease_id = self.history[first][0]
        ids = [s for s in self.swapped if self.history[s][0] == lease_id]
        chosen = [first] + ([data.draw(st.sampled_from(ids))] if len(ids) > 1 and data.draw(st.booleans()) else [])
        chosen = list(dict.fromkeys(chosen))
        before = snapshot(self.m) if not self.m.releasing_refs else None
        try:
            result = self.m.swap_in(lease_id, chosen)
        except FailedPreconditionError as e:
            assert e.reason == SWAP_LOST
            if before is not None:
                self._unchanged(before)
            if recompute:  # the client frees it and recomputes it
                for s in chosen:
                    self._forget(s)
                self.m.free(lease_id, chosen, preempted=True)
            return
        if isinstance(result, OutOfBlocks):
            if before is not None:
                self._unchanged(before)
            return
        seqs, appended = result
        assert appended is None
        for seq in seqs:
            assert seq.swap is None and all(r.block_hash is None for r in seq.reloads)
            del self.swapped[seq.seq_id]
            self._grant(seq)
        if data.draw(st.integers(0, 3)):  # the scheduler runs them at once: their next step
            pending = [s for s in chosen if self.m.sequences[s].num_proven < self.m.sequences[s].num_tokens]
            if pending:
                self._step(data, lease_id, pending)
            else:
                self._append(data, lease_id, chosen)

    @rule(op=st.integers(0, 19), lease=st.integers(0, 1))
    def lease_time(self, op, lease):
        """A lease is renewed and time passes (0.5 s; 2 s from 12; past the TTL at 18), or (19) it is released."""
        lease_id = self._live_lease(lease)
        if op == 19:
            for s in [s for s, (l, _) in self.history.items() if l == lease_id]:
                self._forget(s)
            self.m.leases.release(lease_id)
            self.leases[lease] = new = self.m.leases.create().lease_id
            self.renewed[new] = self.clock.now
            return
        self.m.leases.keep_alive(lease_id)
        self.renewed[lease_id] = self.clock.now
        self.clock.now += 0.5 if op < 12 else 2.0 if op < 18 else 6.0
        self._forget_expired()
        self.m.leases.expire()
        for i, lease in enumerate(self.leases):
            if lease not in self.m.leases:
                self.leases[i] = self.m.leases.create().lease_id
                self.renewed[self.leases[i]] = self.clock.now

    # -- invariants
    @invariant()
    def invariants_hold(self):
        self.m.check_invariants()
        s = self.m.stats()
        assert s.free_blocks + s.cached_blocks + s.used_blocks == s.total_blocks == NUM_BLOCKS
        assert s.available_blocks == s.free_blocks + s.cached_blocks
        host = self.m.tiers.host
        assert s.host_free_blocks + s.host_cached_blocks + s.host_used_blocks == s.host_total_blocks == HOST_BLOCKS
        pinned = sum(1 for h, p in enumerate(host.pins) if p)
        assert host.num_available == s.host_free_blocks + s.host_cached_blocks - pinned
        assert set(self.m.sequences) == set(self.history)
        assert {q.seq_id for q in self.m.sequences.values() if q.swap is not None} == set(self.swapped)
        assert s.swapped_sequences == len(self.swapped)

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        for sid, (_, toks) in self.history.items():
            seq = self.m.sequences[sid]
            assert seq.num_tokens == len(toks)
            # Copies not done yet (reloads no receipt proved, a grant not run) fill these blocks later.
            later = {r.copy.dst for r in seq.reloads}
            later.update(c.dst for g in self.grants.get(sid, ()) for c, _ in g if c.dst_medium == DEVICE)
            wrong = self.kv.wrong_in_sequence(seq, toks, later)
            assert not wrong, (
                f"sequence {sid} (swapped: {seq.swap is not None}) reads other KV at (block index, positions) {wrong}"
            )

    @invariant()
    def cached_blocks_hold_their_kv(self):
        host = self.m.tiers.host
        for medium, cached in ((DEVICE, self.m.prefix_cache.cached), (HOST, host.cached)):
            for k, b in cached.items():
                prefix = self.prefix_of[k]
                wrong = self.kv.wrong_slots(medium, b, prefix, len(prefix) // BLOCK_SIZE - 1)
                assert not wrong, f"cached block {b} of medium {medium} holds other KV at {wrong}"

    def teardown(self):
        for lease in list(self.m.leases):
            self.m.leases.release(lease)
        self.m.drain_released()
        self.m.check_invariants()
        s = self.m.stats()
        assert s.used_blocks == 0 and s.available_blocks == NUM_BLOCKS
        assert s.host_used_blocks == 0 and s.host_free_blocks + s.host_cached_blocks == s.host_total_blocks
        host = self.m.tiers.host
        assert not any(host.pins) and all(x in (FREE, CACHED) for x in host.state)
        assert not self.m.tiers.held and not self.m.tiers.swap_targets and s.swapped_sequences == 0


# `make test` runs a bounded search; `make test-full` (PAGEDKV_TEST_FULL=1) a long one.
FULL = os.environ.get("PAGEDKV_TEST_FULL") == "1"
TestBlockManagerMachine = pytest.mark.slow(BlockManagerMachine.TestCase)
TestBlockManagerMachine.settings = settings(
    max_examples=2000 if FULL else 150, stateful_step_count=60 if FULL else 40, deadline=None
)
