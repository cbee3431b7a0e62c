"""Sequences: a sequence's block table, the table of live sequences, and the view the API reports.

PagedAttention (Kwon et al., SOSP 2023), section 4.2: a sequence's logical KV
blocks map to physical blocks through its block table; logical block ``i``
holds token positions ``[i * block_size, (i + 1) * block_size)``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from memory_service.leases import Lease
from memory_service.manager.live_table import LiveTable
from memory_service.manager.requests import BlockCopy, check_batch
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Reload:
    """An unproven copy into one of a sequence's device blocks: a reload from the host tier, or a node
    transfer from another node's pool (:mod:`memory_service.tiers.manager`)."""

    #: The copy (src in the host tier or another node's pool, dst the sequence's device block).
    copy: BlockCopy
    #: Prefix-cache content it brings back (hash, tokens, parent), or None for a swapped block.
    block_hash: bytes | None = None
    tokens: tuple[int, ...] = ()
    parent: bytes = b""


@dataclass(slots=True)
class SwapEntry:
    """One own block of a swapped-out sequence (:mod:`memory_service.tiers.swap`)."""

    #: The host block held for it.
    host: int
    #: The device block still holding its KV (refcount 0, evictable); None once handed out.
    device: int | None
    #: The host block holds its KV (the offload's receipt came).
    proven: bool = False


@dataclass(slots=True)
class Sequence:
    """One sequence's block table (owned and mutated by the block manager)."""

    #: Unique id for the manager's life, assigned in increasing order from 0.
    seq_id: int
    #: Lease that owns it.
    lease_id: str
    #: Tokens whose slots are reserved (prompt + generated).
    num_tokens: int
    #: Physical block ids in logical order; len == ceil(num_tokens / block_size).
    block_ids: list[int]
    #: The sequence it was forked from, if any.
    parent_seq_id: int | None = None
    #: Its token ids when the client sent them (prefix caching); None = unknown.
    token_ids: list[int] | None = None
    #: Hashes of its leading full blocks that were looked up or committed (a chain).
    block_hashes: list[bytes] = field(default_factory=list)
    #: Extra keys of its cache entries.
    cache_key: CacheKey = CacheKey()
    #: Leading tokens found in the prefix cache at allocation.
    num_cached_tokens: int = 0
    #: Leading tokens whose KV is proven computed (prefix-cache hits at allocation, the parent's
    #: at a fork, then workers' receipts): what a step may read, and where its writes start.
    num_proven: int = 0
    #: Of ``num_cached_tokens``, those reloaded from the host tier.
    num_reloaded_tokens: int = 0
    #: Of ``num_cached_tokens``, those read from another node's pool (node transfers).
    num_transferred_tokens: int = 0
    #: The block its last copy-on-write writes (the copy's dst) until a receipt proves a step of
    #: it: that block does not hold its proven tokens yet (they are in the copy's source).
    copy_pending: int | None = None
    #: Tier copies (:mod:`memory_service.tiers.manager`): offloads this call caused, for the next grant
    #: only; offloads granted and not yet proven; reloads not yet proven (in every grant until then).
    fresh_offloads: list[BlockCopy] = field(default_factory=list)
    offloads: list[BlockCopy] = field(default_factory=list)
    reloads: list[Reload] = field(default_factory=list)
    #: Swapped out: one entry per block-table index, None for a block it shares (still on the
    #: device, referenced), a :class:`SwapEntry` for an own block. None when not swapped.
    swap: list[SwapEntry | None] | None = None
    #: The sequence holds a prefix pin (memory_service.manager.pins): only FreeSequences or
    #: UnpinPrefix end it, nothing grows, forks or swaps it.
    pinned: bool = False

    def proven_held(self, block_size: int) -> int:
        """Leading tokens whose KV its own blocks hold now: the proven ones, short of a block whose
        copy-on-write no receipt proved yet (those tokens are still in the copy's source)."""
        pending = self.copy_pending
        if pending is not None and pending in self.block_ids:
            return min(self.num_proven, self.block_ids.index(pending) * block_size)
        return self.num_proven

    def extend_tokens(self, token_ids: Seq[int] | None) -> None:
        """Record the ids of appended tokens; an append without them makes the sequence's tokens unknown."""
        if self.token_ids is not None:
            if token_ids:
                self.token_ids.extend(token_ids)
            else:
                self.token_ids = None


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """A snapshot of one sequence's block table with its blocks' refcounts (GetBlockTable, ListSequences)."""

    #: The sequence.
    seq_id: int
    #: Lease that owns it.
    lease_id: str
    #: The sequence it was forked from, if any.
    parent_seq_id: int | None
    #: Tokens whose slots are reserved.
    num_tokens: int
    #: Physical block ids in logical order.
    block_ids: tuple[int, ...]
    #: ref_counts[i]: refcount of block_ids[i] (> 1 = shared with a fork or a prefix-cache hit).
    ref_counts: tuple[int, ...]
    #: media[i]: where block_ids[i] is, 0 the device pool, 1 the host tier (a swapped-out block).
    media: tuple[int, ...] = ()
    #: Swapped out.
    swapped: bool = False

    def __post_init__(self) -> None:
        assert len(self.ref_counts) == len(self.block_ids) and all(rc > 0 for rc in self.ref_counts), self

    @classmethod
    def of(cls, seq: Sequence, ref_counts: Seq[int]) -> SequenceInfo:
        """The view of ``seq``; ``ref_counts[b]`` is block ``b``'s refcount in the pool. A swapped-out
        sequence's own blocks show as the host blocks held for them (refcount 1)."""
        if seq.swap is None:
            return cls(seq.seq_id, seq.lease_id, seq.parent_seq_id, seq.num_tokens, tuple(seq.block_ids),
                       tuple(ref_counts[b] for b in seq.block_ids), (0,) * len(seq.block_ids))
        ids, rcs, media = [], [], []
        for b, e in zip(seq.block_ids, seq.swap):
            ids.append(b if e is None else e.host)
            rcs.append(ref_counts[b] if e is None else 1)
            media.append(0 if e is None else 1)
        return cls(seq.seq_id, seq.lease_id, seq.parent_seq_id, seq.num_tokens, tuple(ids), tuple(rcs),
                   tuple(media), True)


class SequenceTable(LiveTable[int, Sequence]):
    """Live sequences by id (a read-only mapping); ids are assigned in increasing order from 0.

    Because ids are never reused, a lookup tells a freed sequence apart from
    one never allocated, so errors can say which.

    NOTE: paging. ``_order`` holds ids in increasing order (appended as they are
    handed out), including freed ones until the next compaction, which runs once
    freed ids outnumber live ones (plus :data:`_COMPACT_SLACK`), so a page costs
    O(log n + page + freed ids in its range), amortized O(page).
    """

    #: Freed ids tolerated in ``_order`` beyond the live count before it is compacted.
    _COMPACT_SLACK = 1024

    def __init__(self) -> None:
        super().__init__()
        self._next_id = 0  # ids below it were allocated
        self._order: list[int] = []  # ids handed out, increasing; freed ones dropped at compaction

    def add(self, lease: Lease, num_tokens: int, block_ids: list[int], parent: int | None = None) -> Sequence:
        """A new sequence of ``lease`` with the next id (entered in ``lease.seq_ids``)."""
        seq = Sequence(self._next_id, lease.lease_id, num_tokens, block_ids, parent)
        self._next_id += 1
        self._live[seq.seq_id] = seq
        self._order.append(seq.seq_id)
        lease.seq_ids.add(seq.seq_id)
        lease.num_block_entries += len(block_ids)
        return seq

    def fork(self, lease: Lease, parent: Sequence, num_tokens: int | None = None, block_size: int = 1) -> Sequence:
        """A child of ``parent`` with a copy of its block table and prefix-cache state (the caller increfs).

        ``num_tokens``: the child holds only the parent's leading ``num_tokens`` (at most its proven
        ones) and the ``block_size``-token blocks that hold them; None: all of them."""
        n = parent.num_tokens if num_tokens is None else num_tokens
        child = self.add(lease, n, list(parent.block_ids[:-(-n // block_size)] if num_tokens is not None
                                        else parent.block_ids), parent.seq_id)
        child.token_ids = list(parent.token_ids[:n]) if parent.token_ids is not None else None
        child.block_hashes, child.cache_key = list(parent.block_hashes[:n // block_size]), parent.cache_key
        child.num_proven = min(parent.num_proven, n)
        return child

    def remove(self, seq: Sequence, lease: Lease) -> None:
        """Forget a live sequence of ``lease`` (its id is never reused)."""
        del self._live[seq.seq_id]
        lease.seq_ids.discard(seq.seq_id)
        lease.num_block_entries -= len(seq.block_ids)
        if len(self._order) > 2 * len(self._live) + self._COMPACT_SLACK:
            self._order = [s for s in self._order if s in self._live]

    def page(self, start: int, limit: int, ids: Iterable[int] | None = None) -> tuple[list[Sequence], int | None]:
        """Up to ``limit`` live sequences with id >= ``start``, by id, and the id to start the next page at.

        ``ids``: only these ids (a lease's, O(len(ids)) to filter); None = every live sequence
        (amortized O(page), see the class NOTE). The next start is None on the last page.
        """
        if ids is not None:
            chosen = heapq.nsmallest(limit + 1, (s for s in ids if s >= start))
            more = len(chosen) > limit
            return [self._live[s] for s in chosen[:limit]], (chosen[limit] if more else None)
        out: list[Sequence] = []
        order, live = self._order, self._live
        for i in range(bisect.bisect_left(order, start), len(order)):
            seq = live.get(order[i])
            if seq is None:
                continue
            if len(out) == limit:
                return out, seq.seq_id
            out.append(seq)
        return out, None

    def was_allocated(self, seq_id: int) -> bool:
        """True if ``seq_id`` was ever handed out (live or freed)."""
        return 0 <= seq_id < self._next_id

    def lookup(self, seq_id: int) -> Sequence:
        """The live sequence ``seq_id``.

        Raises:
            NotFoundError: never allocated, or already freed.
        """
        seq = self._live.get(seq_id)
        if seq is None:
            if self.was_allocated(seq_id):
                raise NotFoundError(f"sequence {seq_id} was already freed (or its lease expired)")
            raise NotFoundError(f"unknown sequence {seq_id}; it was never allocated")
        return seq

    def owned(self, lease_id: str, seq_ids: Iterable[int], what: str) -> list[Sequence]:
        """Resolve a batch of sequence ids, each live and owned by ``lease_id``, for call ``what``.

        Raises:
            InvalidArgumentError: an empty or oversized batch, or an id named twice.
            NotFoundError: an id unknown, freed, or of another lease.
            FailedPreconditionError: a prefix pin's sequence, for any call but FreeSequences.
        """
        ids = list(seq_ids)
        check_batch(len(ids), what)
        if len(set(ids)) != len(ids):
            dup = next(s for s, c in Counter(ids).items() if c > 1)
            raise InvalidArgumentError(f"{what}: sequence {dup} appears more than once in the batch")
        seqs = [self._live.get(s) for s in ids]
        for s, seq in zip(ids, seqs):
            if seq is None:
                self.lookup(s)  # raises the precise NotFoundError
            if seq.lease_id != lease_id:
                raise NotFoundError(f"{what}: sequence {s} is not owned by lease {lease_id}")
            if seq.pinned and what != "FreeSequences":
                raise FailedPreconditionError(f"{what}: sequence {s} holds a prefix pin; only UnpinPrefix or "
                                              "FreeSequences end it, nothing else may change it")
        return seqs

    def check(self, leases: Mapping[str, Lease], block_size: int) -> None:
        """Assert each table's length fits its tokens and the tables agree with ``leases``' ``seq_ids``."""
        for seq in self._live.values():
            assert len(seq.block_ids) == blocks_for(seq.num_tokens, block_size), (
                f"sequence {seq.seq_id}: {len(seq.block_ids)} blocks for {seq.num_tokens} tokens")
            assert seq.seq_id in leases[seq.lease_id].seq_ids, f"sequence {seq.seq_id} not in its lease"
        for lease in leases.values():
            assert all(s in self._live for s in lease.seq_ids), f"lease {lease.lease_id} names a freed sequence"
            entries = sum(len(self._live[s].block_ids) for s in lease.seq_ids)
            assert lease.num_block_entries == entries, (
                f"lease {lease.lease_id}: counts {lease.num_block_entries} block-table entries, holds {entries}")
        assert all(a < b for a, b in zip(self._order, self._order[1:])), "paging order is not increasing"
        assert set(self._live) <= set(self._order), "a live sequence is missing from the paging order"
