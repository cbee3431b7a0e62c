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
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence as Seq
from dataclasses import dataclass, field

from memory_service.block_pool import BlockPool
from pagedkv.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from pagedkv.logs import get_logger

log = get_logger("block_manager")

#: Most sequences one batched call may name (a bigger batch is malformed).
MAX_BATCH = 65_536
#: Expired lease ids remembered, so a late call says "expired" rather than "unknown".
EXPIRED_LEASES_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class OutOfBlocks:
    """Typed result of a request the pool cannot satisfy now (-> RESOURCE_EXHAUSTED)."""

    #: Blocks the whole batch needs.
    required: int
    #: Blocks available (free + cached) when it was refused.
    available: int


@dataclass(slots=True)
class Sequence:
    """One sequence's block table."""

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


@dataclass(slots=True)
class Lease:
    """A client session owning sequences."""

    #: Opaque id (uuid4 hex).
    lease_id: str
    #: Lifetime without keep-alive, seconds.
    ttl: float
    #: Clock time at which it expires.
    expires_at: float
    #: Free-form owner label.
    owner: str = ""
    #: Ids of its live sequences.
    seq_ids: set[int] = field(default_factory=set)


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


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Leases, sequences and block tables over a pool of ``num_blocks`` x ``block_size`` tokens.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        lease_ttl: default lease TTL, seconds.
        clock: monotonic time source in seconds (tests inject a fake one).

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
    ):
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be > 0 seconds, got {lease_ttl}")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.sequences: dict[int, Sequence] = {}
        self.leases: dict[str, Lease] = {}
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._next_seq_id = itertools.count()
        self._seq_high_water = 0
        self.allocation_failures = 0
        self.preemptions = 0

    # ------------------------------------------------------------------ leases
    def create_lease(self, ttl: float | None = None, owner: str = "") -> Lease:
        """Open a lease with ``ttl`` seconds (default: the manager's).

        Raises:
            InvalidArgumentError: ttl not in (0, 86400].
        """
        ttl = self.lease_ttl if ttl is None else ttl
        if not 0 < ttl <= 86_400:
            raise InvalidArgumentError(f"ttl_seconds must be in (0, 86400], got {ttl}")
        self.expire_leases()
        lease = Lease(uuid.uuid4().hex, ttl, self.clock() + ttl, owner)
        self.leases[lease.lease_id] = lease
        log.info("lease_created", lease_id=lease.lease_id, ttl=ttl, owner=owner)
        return lease

    def keep_alive(self, lease_id: str) -> float:
        """Renew a lease for another TTL; returns seconds until it expires."""
        lease = self._lease(lease_id)
        lease.expires_at = self.clock() + lease.ttl
        return lease.ttl

    def release_lease(self, lease_id: str) -> int:
        """Free every sequence of the lease and forget it; returns sequences freed."""
        lease = self._lease(lease_id)
        n = self._drop_lease(lease)
        log.info("lease_released", lease_id=lease_id, freed_sequences=n)
        return n

    def expire_leases(self) -> list[str]:
        """Free the sequences of every lease past its TTL; returns their ids."""
        now = self.clock()
        expired = [lease for lease in self.leases.values() if lease.expires_at <= now]
        for lease in expired:
            n = self._drop_lease(lease)
            self._expired[lease.lease_id] = now
            if len(self._expired) > EXPIRED_LEASES_REMEMBERED:
                self._expired.popitem(last=False)
            log.info("lease_expired", lease_id=lease.lease_id, freed_sequences=n, owner=lease.owner)
        return [lease.lease_id for lease in expired]

    def _drop_lease(self, lease: Lease) -> int:
        seqs = [self.sequences[s] for s in sorted(lease.seq_ids)]
        for seq in seqs:
            self._free_one(seq)
        del self.leases[lease.lease_id]
        return len(seqs)

    def _lease(self, lease_id: str) -> Lease:
        """The live lease ``lease_id`` (after expiring overdue ones)."""
        if not lease_id:
            raise InvalidArgumentError("lease_id is empty; call CreateLease first and pass its lease_id")
        self.expire_leases()
        lease = self.leases.get(lease_id)
        if lease is not None:
            return lease
        if lease_id in self._expired:
            raise FailedPreconditionError(
                f"lease {lease_id} expired (no keep-alive within its TTL) and its sequences were "
                "freed; create a new lease and allocate again"
            )
        raise NotFoundError(f"unknown lease {lease_id!r}; call CreateLease first")

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
            return [self.sequences[s] for s in sorted(self._lease(lease_id).seq_ids)]
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

    def _refuse(self, required: int) -> OutOfBlocks:
        self.allocation_failures += 1
        log.info("out_of_blocks", required=required, available=self.pool.num_available)
        return OutOfBlocks(required, self.pool.num_available)

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        """Record that token positions [start, end) of ``seq`` get KV slots."""
        bs = self.block_size
        for idx in range(start // bs, blocks_for(end, bs)):
            self.pool.set_fill(seq.block_ids[idx], min(bs, end - idx * bs))

    def allocate(self, lease_id: str, token_counts: Seq[int]) -> list[Sequence] | OutOfBlocks:
        """Allocate one new sequence per entry of ``token_counts`` (prompt tokens, >= 1 each).

        Returns the sequences (block tables of ceil(n / block_size) blocks), or
        :class:`OutOfBlocks` with nothing changed.

        Raises:
            InvalidArgumentError: empty/oversized batch, a count outside [1, pool tokens].
            NotFoundError / FailedPreconditionError: unknown / expired lease.
        """
        lease = self._lease(lease_id)
        _check_batch(len(token_counts), "AllocateSequences")
        for n in token_counts:
            self._check_tokens(n, "AllocateSequences")
        required = sum(blocks_for(n, self.block_size) for n in token_counts)
        if required > self.pool.num_available:
            return self._refuse(required)
        out = []
        for n in token_counts:
            seq = self._new_sequence(lease, n, self.pool.allocate(blocks_for(n, self.block_size)), None)
            self._write(seq, 0, n)
            out.append(seq)
        log.debug("allocated", lease_id=lease_id, num_sequences=len(out), num_blocks=required)
        return out

    def append_slots(
        self, lease_id: str, appends: Seq[tuple[int, int]]
    ) -> tuple[list[Sequence], list[tuple[int, int]]] | OutOfBlocks:
        """Grow each ``(seq_id, num_tokens)`` of the batch by ``num_tokens`` slots.

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
        lease = self._lease(lease_id)
        seqs = self._owned(lease, (s for s, _ in appends), "AppendSlots")
        bs = self.block_size
        # Pass 1: count blocks, simulating the refcount drops of earlier copies in the batch.
        required = 0
        dropped: Counter[int] = Counter()
        capacity = self.pool.num_blocks * bs
        ref_counts = self.pool.ref_counts
        for seq, (_, k) in zip(seqs, appends):
            if not (1 <= k and seq.num_tokens + k <= capacity):
                self._check_tokens(k, "AppendSlots")
                self._check_tokens(seq.num_tokens + k, f"AppendSlots(sequence {seq.seq_id})")
            last = seq.block_ids[-1]
            if seq.num_tokens % bs and ref_counts[last] - dropped[last] > 1:
                dropped[last] += 1
                required += 1
            required += blocks_for(seq.num_tokens + k, bs) - len(seq.block_ids)
        if required > self.pool.num_available:
            return self._refuse(required)
        # Pass 2: apply, in the same order.
        copies: list[tuple[int, int]] = []
        for seq, (_, k) in zip(seqs, appends):
            n = seq.num_tokens
            last = seq.block_ids[-1]
            if n % bs and self.pool.ref_counts[last] > 1:
                (dst,) = self.pool.allocate(1)
                copies.append((last, dst))
                self.pool.decref([last])
                seq.block_ids[-1] = dst
                self.pool.set_fill(dst, n % bs)
            grow = blocks_for(n + k, bs) - len(seq.block_ids)
            if grow:
                seq.block_ids.extend(self.pool.allocate(grow))
            seq.num_tokens = n + k
            if k == 1:  # the decode fast path
                self.pool.set_fill(seq.block_ids[n // bs], n % bs + 1)
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
        lease = self._lease(lease_id)
        _check_batch(len(parent_ids), "ForkSequences")
        unique = list(dict.fromkeys(parent_ids))
        by_id = dict(zip(unique, self._owned(lease, unique, "ForkSequences")))
        parents = [by_id[p] for p in parent_ids]
        children = []
        for parent in parents:
            self.pool.incref(parent.block_ids)
            children.append(self._new_sequence(lease, parent.num_tokens, list(parent.block_ids), parent.seq_id))
        return children

    def free(self, lease_id: str, seq_ids: Seq[int], *, preempted: bool = False) -> int:
        """Free a batch of sequences; returns blocks whose refcount reached zero.

        Raises:
            InvalidArgumentError: empty batch or duplicate ids.
            NotFoundError: a sequence unknown, already freed, or of another lease (nothing freed).
            FailedPreconditionError: the lease expired.
        """
        lease = self._lease(lease_id)
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
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            shared_block_refs=p.shared_refs,
        )

    def check_invariants(self) -> None:
        """Assert DESIGN.md's invariants (O(blocks + table entries))."""
        self.pool.check()
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
