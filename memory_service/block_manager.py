"""The block manager: leases, sequences and their block tables over one :class:`BlockPool`.

PagedAttention (Kwon et al., SOSP 2023), section 4.2-4.4: each sequence's
logical KV blocks map to physical blocks through a block table; blocks are
allocated on demand as a sequence grows, shared by reference counting when a
sequence forks (parallel sampling, beam search), and copied on write when a
sequence appends into a shared, partly filled last block. Copy-on-write is
handed to the worker as data (vLLM v0 ``vllm/core/block/common.py``): the
manager records ``(src, dst)`` block pairs and never touches KV bytes.

Every mutating call takes a batch and is all-or-nothing: it first computes how
many blocks the whole batch needs and, if that exceeds what is available,
returns :class:`OutOfBlocks` having changed nothing. Misuse raises
``pagedkv.errors`` exceptions before anything changes.

Sequences belong to a lease (a client session with a TTL renewed by
keep-alive); an expired or released lease frees all its sequences, so no client
crash leaks blocks. Time comes from an injectable ``clock`` (seconds).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from memory_service.block_hash import CacheKey
from memory_service.block_pool import BlockPool
from memory_service.leases import Lease, LeaseTable
from memory_service.prefix_cache import PrefixCache
from memory_service.sequence import Sequence, blocks_for
from pagedkv.errors import InvalidArgumentError, NotFoundError
from pagedkv.logs import get_logger

log = get_logger("block_manager")

#: Most sequences one batched call may name (a bigger batch is malformed).
MAX_BATCH = 65_536


@dataclass(frozen=True, slots=True)
class OutOfBlocks:
    """Typed result of a request the pool cannot satisfy now (-> RESOURCE_EXHAUSTED)."""

    #: Blocks the whole batch needs.
    required: int
    #: Blocks available (free + cached) when it was refused.
    available: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """One sequence to allocate."""

    #: Tokens to reserve slots for; with ``token_ids``, beyond the cached prefix.
    num_tokens: int
    #: The sequence's known tokens: enables prefix-cache lookup and registration.
    token_ids: tuple[int, ...] | None = None
    #: Extra cache keys.
    cache_key: CacheKey = CacheKey()


@dataclass(frozen=True, slots=True)
class Stats:
    """Counters of :meth:`BlockManager.stats` (GetStats)."""

    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    available_blocks: int
    block_size: int
    tokens_stored: int
    utilization: float
    num_sequences: int
    num_leases: int
    allocation_failures: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    shared_block_refs: int
    prefix_cache_evictions: int
    prefix_caching: bool


class BlockManager:
    """Leases, sequences and block tables over a pool of ``num_blocks`` x ``block_size`` tokens.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        lease_ttl: default lease TTL, seconds.
        clock: monotonic time source in seconds (tests inject a fake one).
        prefix_caching: keep computed full blocks for reuse (vLLM's automatic prefix caching).
        max_events: KV events retained for replay.

    Raises:
        ValueError: a non-positive size or TTL.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        lease_ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        prefix_caching: bool = True,
        max_events: int = 10_000,
    ):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.sequences: dict[int, Sequence] = {}
        self.leases = LeaseTable(lease_ttl, self._free_lease_sequences, clock)
        self._next_seq_id = itertools.count()
        self._seq_high_water = 0
        self.allocation_failures = 0
        self.preemptions = 0
        self.prefix_cache = PrefixCache(self.pool, enabled=prefix_caching, max_events=max_events)

    # ------------------------------------------------------------------ leases
    def create_lease(self, ttl: float | None = None, owner: str = "") -> Lease:
        """Open a lease (:meth:`LeaseTable.create`)."""
        return self.leases.create(ttl, owner)

    def keep_alive(self, lease_id: str) -> float:
        """Renew a lease (:meth:`LeaseTable.keep_alive`); returns seconds until it expires."""
        return self.leases.keep_alive(lease_id)

    def release_lease(self, lease_id: str) -> int:
        """Release a lease (:meth:`LeaseTable.release`); returns sequences freed."""
        return self.leases.release(lease_id)

    def expire_leases(self) -> list[str]:
        """Free the sequences of every lease past its TTL (:meth:`LeaseTable.expire`); returns their ids."""
        return self.leases.expire()

    def _free_lease_sequences(self, lease: Lease) -> int:
        seqs = [self.sequences[s] for s in sorted(lease.seq_ids)]
        for seq in seqs:
            self._free_one(seq)
        return len(seqs)

    # ------------------------------------------------------------- sequences
    def get_sequence(self, seq_id: int) -> Sequence:
        """The live sequence ``seq_id``.

        Raises:
            NotFoundError: never allocated, or already freed.
        """
        self.expire_leases()
        return self._sequence(seq_id)

    def _sequence(self, seq_id: int) -> Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            if 0 <= seq_id < self._seq_high_water:
                raise NotFoundError(f"sequence {seq_id} was already freed (or its lease expired)")
            raise NotFoundError(f"unknown sequence {seq_id}; it was never allocated")
        return seq

    def list_sequences(self, lease_id: str | None = None) -> list[Sequence]:
        """Live sequences by id, optionally only those of one lease."""
        if lease_id is not None:
            return [self.sequences[s] for s in sorted(self.leases.lookup(lease_id).seq_ids)]
        self.expire_leases()
        return [self.sequences[s] for s in sorted(self.sequences)]

    def _owned(self, lease: Lease, seq_ids: Iterable[int], what: str) -> list[Sequence]:
        """Resolve a batch of sequence ids owned by ``lease`` (no duplicates, non-empty)."""
        ids = list(seq_ids)
        _check_batch(len(ids), what)
        if len(set(ids)) != len(ids):
            dup = next(s for s, c in Counter(ids).items() if c > 1)
            raise InvalidArgumentError(f"{what}: sequence {dup} appears more than once in the batch")
        seqs = [self.sequences.get(s) for s in ids]
        for s, seq in zip(ids, seqs):
            if seq is None:
                self._sequence(s)  # raises the precise NotFoundError
            if seq.lease_id != lease.lease_id:
                raise NotFoundError(f"{what}: sequence {s} is not owned by lease {lease.lease_id}")
        return seqs

    def _new_sequence(self, lease: Lease, num_tokens: int, block_ids: list[int], parent: int | None) -> Sequence:
        seq = Sequence(next(self._next_seq_id), lease.lease_id, num_tokens, block_ids, parent)
        self._seq_high_water = seq.seq_id + 1
        self.sequences[seq.seq_id] = seq
        lease.seq_ids.add(seq.seq_id)
        return seq

    def _check_tokens(self, n: int, what: str) -> None:
        capacity = self.pool.num_blocks * self.block_size
        if not 1 <= n <= capacity:
            raise InvalidArgumentError(
                f"{what}: num_tokens must be in [1, {capacity}] (the pool's whole token capacity), got {n}"
            )

    def _refuse(self, required: int, pinned: int = 0) -> OutOfBlocks:
        """Count and return a refusal; ``pinned`` cached hits are not available to this request."""
        available = self.pool.num_available - pinned
        self.allocation_failures += 1
        log.info("out_of_blocks", required=required, available=available)
        return OutOfBlocks(required, available)

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        """Record that token positions [start, end) of ``seq`` get KV slots."""
        bs = self.block_size
        for idx in range(start // bs, blocks_for(end, bs)):
            self.pool.set_fill(seq.block_ids[idx], min(bs, end - idx * bs))

    def allocate(self, lease_id: str, requests: Seq[int | Allocation]) -> list[Sequence] | OutOfBlocks:
        """Allocate one new sequence per request (a token count, or an :class:`Allocation`).

        With token ids and prefix caching on, the longest run of leading full
        blocks already cached (same tokens, same extra keys) is shared instead of
        allocated, leaving at least the last token to compute (so the worker has a
        query; a block-aligned prompt that hits in full recomputes its last block
        into a fresh one). Hits are pinned before any block is evicted for the
        same call. Returns the sequences (``num_cached_tokens`` set), or
        :class:`OutOfBlocks` with nothing changed (no eviction, no counter but
        the failure count).

        Raises:
            InvalidArgumentError: empty/oversized batch, a count outside [1, pool tokens],
                token ids outside int32.
            NotFoundError / FailedPreconditionError: unknown / expired lease.
        """
        lease = self.leases.lookup(lease_id)
        _check_batch(len(requests), "AllocateSequences")
        reqs = [r if isinstance(r, Allocation) else Allocation(r) for r in requests]
        bs = self.block_size
        plans = []  # (request, hit blocks, hashes, tokens to reserve)
        pinned: set[int] = set()
        required = 0
        for r in reqs:
            self._check_tokens(r.num_tokens, "AllocateSequences")
            prefix = self.prefix_cache.lookup(r.token_ids, r.cache_key)
            hits, hashes = prefix.block_ids, prefix.block_hashes
            cached = len(hits) * bs
            total = cached + (min(r.num_tokens, len(r.token_ids) - cached) if r.token_ids else r.num_tokens)
            self._check_tokens(total, "AllocateSequences")
            pinned.update(b for b in hits if self.pool.ref_counts[b] == 0)
            required += blocks_for(total, bs) - len(hits)
            plans.append((r, hits, hashes, total))
        if required > self.pool.num_available - len(pinned):
            return self._refuse(required, len(pinned))
        for _, hits, _, _ in plans:  # pin every hit of the batch before anything is evicted
            self.pool.touch(hits)
        out = []
        for r, hits, hashes, total in plans:
            blocks = hits + self.pool.allocate(blocks_for(total, bs) - len(hits))
            seq = self._new_sequence(lease, total, blocks, None)
            seq.token_ids = list(r.token_ids) if r.token_ids is not None else None
            seq.block_hashes, seq.cache_key, seq.num_cached_tokens = hashes, r.cache_key, len(hits) * bs
            self._write(seq, 0, total)
            if r.token_ids:
                self.prefix_cache.record_lookup(len(r.token_ids), len(hits))
            out.append(seq)
        log.debug("allocated", lease_id=lease_id, num_sequences=len(out), num_blocks=required)
        return out

    def append_slots(
        self, lease_id: str, appends: Seq[tuple[int, int] | tuple[int, int, Seq[int]]]
    ) -> tuple[list[Sequence], list[tuple[int, int]]] | OutOfBlocks:
        """Grow each ``(seq_id, num_tokens[, token_ids])`` of the batch by ``num_tokens`` slots.

        The optional token ids are the tokens appended (kept for prefix caching;
        an append without them ends caching for that sequence).

        A new block is allocated only at a block boundary. If a sequence's last
        block is partly filled and shared (refcount > 1), it first gets a fresh
        block and a ``(src, dst)`` copy the worker does before writing::

            parent  [ 7 | 3* ]          * refcount 2, 2 of 4 slots filled
            child   [ 7 | 3* ]
            append(child, 1)
            parent  [ 7 | 3  ]          copies: [(3, 9)]
            child   [ 7 | 9  ]          block 9 = copy of 3, then slot 2 written

        Returns (updated sequences in request order, copies) or
        :class:`OutOfBlocks` with nothing changed.

        Raises:
            InvalidArgumentError: empty batch, duplicate ids, a count < 1, growth past pool capacity.
            NotFoundError / FailedPreconditionError: unknown sequence or lease, expired lease.
        """
        lease = self.leases.lookup(lease_id)
        seqs = self._owned(lease, (a[0] for a in appends), "AppendSlots")
        bs = self.block_size
        pool = self.pool
        ref_counts, fill = pool.ref_counts, pool.fill
        # Pass 1: validate and count blocks, simulating the refcount drops of earlier copies.
        required = 0
        dropped: Counter[int] = Counter()
        capacity = pool.num_blocks * bs
        for seq, a in zip(seqs, appends):
            k, n = a[1], seq.num_tokens
            if not (1 <= k and n + k <= capacity):
                self._check_tokens(k, "AppendSlots")
                self._check_tokens(n + k, f"AppendSlots(sequence {seq.seq_id})")
            if len(a) > 2 and a[2] and len(a[2]) != k:
                raise InvalidArgumentError(f"AppendSlots(sequence {a[0]}): {len(a[2])} token ids for {k} tokens")
            last = seq.block_ids[-1]
            if n % bs and ref_counts[last] > 1 and ref_counts[last] - dropped[last] > 1:
                dropped[last] += 1
                required += 1
            required += -(-(n + k) // bs) - len(seq.block_ids)
        if required > pool.num_available:
            return self._refuse(required)
        # Pass 2: apply, in the same order.
        copies: list[tuple[int, int]] = []
        for seq, a in zip(seqs, appends):
            k, n, table = a[1], seq.num_tokens, seq.block_ids
            if seq.token_ids is not None:
                if len(a) > 2 and a[2]:
                    seq.token_ids.extend(a[2])
                else:
                    seq.token_ids = None
            last = table[-1]
            if n % bs and ref_counts[last] > 1:
                (dst,) = pool.allocate(1)
                copies.append((last, dst))
                pool.decref([last])
                table[-1] = dst
                pool.set_fill(dst, n % bs)
            grow = -(-(n + k) // bs) - len(table)
            if grow:
                table.extend(pool.allocate(grow))
            seq.num_tokens = n + k
            if k == 1:  # the decode fast path: one slot, one block
                b = table[n // bs]
                if fill[b] <= n % bs:
                    pool.tokens_stored += n % bs + 1 - fill[b]
                    fill[b] = n % bs + 1
            else:
                self._write(seq, n, n + k)
        return seqs, copies

    def fork(self, lease_id: str, parent_ids: Seq[int]) -> list[Sequence]:
        """Fork each parent (ids may repeat): a child sharing every block (refcount + 1).

        Forking allocates nothing, so it cannot run out of blocks; the copy
        happens on the first append into a shared, partly filled block.

        Raises:
            InvalidArgumentError: empty or oversized batch.
            NotFoundError / FailedPreconditionError: unknown parent or lease, expired lease.
        """
        lease = self.leases.lookup(lease_id)
        _check_batch(len(parent_ids), "ForkSequences")
        unique = list(dict.fromkeys(parent_ids))
        by_id = dict(zip(unique, self._owned(lease, unique, "ForkSequences")))
        parents = [by_id[p] for p in parent_ids]
        children = []
        for parent in parents:
            self.pool.incref(parent.block_ids)
            child = self._new_sequence(lease, parent.num_tokens, list(parent.block_ids), parent.seq_id)
            child.token_ids = list(parent.token_ids) if parent.token_ids is not None else None
            child.block_hashes, child.cache_key = list(parent.block_hashes), parent.cache_key
            children.append(child)
        return children

    def commit_computed(self, lease_id: str, entries: Seq[tuple[int, int]]) -> tuple[int, int]:
        """Register the full blocks of each ``(seq_id, num_computed_tokens)`` in the prefix cache.

        A block is cacheable only once its KV is written, which only the client
        knows; it reports here after each step. Entries naming a sequence that
        was freed or preempted meanwhile are skipped. Returns (blocks registered,
        entries skipped).

        Raises:
            InvalidArgumentError: empty batch, duplicates, a count outside [0, num_tokens].
            NotFoundError: a sequence never allocated, or of another lease.
            FailedPreconditionError: the lease expired.
        """
        lease = self.leases.lookup(lease_id)
        _check_batch(len(entries), "CommitComputedTokens")
        if len({s for s, _ in entries}) != len(entries):
            raise InvalidArgumentError("CommitComputedTokens: a sequence appears more than once in the batch")
        live = []
        for seq_id, n in entries:
            seq = self.sequences.get(seq_id)
            if seq is None and 0 <= seq_id < self._seq_high_water:
                continue  # freed or preempted meanwhile: nothing to register
            if seq is None or seq.lease_id != lease.lease_id:
                raise NotFoundError(f"CommitComputedTokens: sequence {seq_id} is not a live sequence of lease {lease_id}")
            if not 0 <= n <= seq.num_tokens:
                raise InvalidArgumentError(
                    f"CommitComputedTokens(sequence {seq_id}): num_computed_tokens must be in [0, {seq.num_tokens}], got {n}")
            live.append((seq, n))
        registered = sum(self.prefix_cache.commit(seq, n) for seq, n in live)
        return registered, len(entries) - len(live)

    def reset_prefix_cache(self) -> int:
        """Drop the whole prefix cache; returns refcount-0 blocks cleared."""
        cleared = self.prefix_cache.reset()
        for seq in self.sequences.values():
            seq.block_hashes = []  # the next commit re-registers its full blocks
        return cleared

    def free(self, lease_id: str, seq_ids: Seq[int], *, preempted: bool = False) -> int:
        """Free a batch of sequences; returns blocks whose refcount reached zero.

        Raises:
            InvalidArgumentError: empty batch or duplicate ids.
            NotFoundError: a sequence unknown, already freed, or of another lease (nothing freed).
            FailedPreconditionError: the lease expired.
        """
        lease = self.leases.lookup(lease_id)
        seqs = self._owned(lease, seq_ids, "FreeSequences")
        freed = sum(self._free_one(seq) for seq in seqs)
        if preempted:
            self.preemptions += len(seqs)
        return freed

    def _free_one(self, seq: Sequence) -> int:
        freed = self.pool.decref(seq.block_ids)
        del self.sequences[seq.seq_id]
        self.leases[seq.lease_id].seq_ids.discard(seq.seq_id)
        return freed

    # ---------------------------------------------------------------- observe
    def stats(self) -> Stats:
        """Counters for GetStats (DESIGN.md, Observability)."""
        self.expire_leases()
        p = self.pool
        used = p.num_used
        return Stats(
            total_blocks=p.num_blocks,
            free_blocks=p.num_free,
            cached_blocks=p.num_cached,
            used_blocks=used,
            available_blocks=p.num_available,
            block_size=self.block_size,
            tokens_stored=p.tokens_stored,
            utilization=p.tokens_stored / (used * self.block_size) if used else 0.0,
            num_sequences=len(self.sequences),
            num_leases=len(self.leases),
            allocation_failures=self.allocation_failures,
            preemptions=self.preemptions,
            prefix_cache_queries=self.prefix_cache.queries,
            prefix_cache_hits=self.prefix_cache.hits,
            shared_block_refs=p.shared_refs,
            prefix_cache_evictions=self.prefix_cache.evictions,
            prefix_caching=self.prefix_cache.enabled,
        )

    def check_invariants(self) -> None:
        """Assert DESIGN.md's invariants (O(blocks + table entries))."""
        self.pool.check()
        self.prefix_cache.check()
        refs: Counter[int] = Counter()
        for seq in self.sequences.values():
            assert len(seq.block_ids) == blocks_for(seq.num_tokens, self.block_size), (
                f"sequence {seq.seq_id}: {len(seq.block_ids)} blocks for {seq.num_tokens} tokens"
            )
            assert seq.seq_id in self.leases[seq.lease_id].seq_ids, f"sequence {seq.seq_id} not in its lease"
            refs.update(seq.block_ids)
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_counts[b] == refs[b], (
                f"block {b}: refcount {self.pool.ref_counts[b]} but {refs[b]} block-table entries"
            )
        for lease in self.leases.values():
            assert all(s in self.sequences for s in lease.seq_ids), f"lease {lease.lease_id} names a freed sequence"


def _check_batch(n: int, what: str) -> None:
    if n == 0:
        raise InvalidArgumentError(f"{what}: the batch is empty; send at least one entry")
    if n > MAX_BATCH:
        raise InvalidArgumentError(f"{what}: {n} entries is more than the {MAX_BATCH} one call may carry")
