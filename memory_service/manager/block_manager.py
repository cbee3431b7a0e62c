"""The block manager: sequences' block tables over one :class:`BlockPool`, changed in batches.

PagedAttention (Kwon et al., SOSP 2023), section 4.2-4.4: blocks are allocated
on demand as a sequence grows, shared by reference counting when it forks, and
copied on write when it appends into a shared, partly filled last block; the
copy is handed to the worker as data (vLLM v0 ``vllm/core/block/common.py``).
Every mutating call takes a batch of typed requests (:mod:`memory_service.manager.requests`)
and is all-or-nothing: a batch that needs more blocks than are available gets
:class:`OutOfBlocks` with nothing changed; misuse raises ``pagedkv.runtime.errors``
exceptions before anything changes.

Here: allocate, append (with copy-on-write), fork and free, and the release of dropped leases'
blocks. Mixed in from their own modules: cached prefixes, exports, commits and cache resets
(:mod:`memory_service.manager.prefix`), prefix pins (:mod:`memory_service.manager.pins`), swap-out
and swap-in (:mod:`memory_service.manager.swap`), and the read-only views (:mod:`memory_service.manager.views`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from memory_service.block_pool import BlockPool
from memory_service.leases import Lease, LeaseTable
from memory_service.manager.pins import ManagerPins
from memory_service.manager.prefix import ManagerPrefix
from memory_service.manager.quota import ManagerQuota
from memory_service.manager.requests import (
    MAX_FORK_BLOCK_IDS,
    Allocation,
    Append,
    AppendResult,
    BlockCopy,
    BlockTableUpdate,
    OutOfBlocks,
    check_batch,
    check_token_ids,
)
from memory_service.manager.sequence import Sequence, SequenceTable, blocks_for
from memory_service.manager.swap import ManagerSwap
from memory_service.manager.views import ManagerViews
from memory_service.prefix_cache import PrefixCache
from memory_service.release_queue import RELEASE_CHUNK_BLOCKS, ReleaseQueue
from memory_service.tiers.host_tier import HostTier
from memory_service.tiers.manager import Tiers
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError
from pagedkv.runtime.limits import MAX_FORK_CHILDREN
from pagedkv.runtime.logs import get_logger

log = get_logger("block_manager")


class BlockManager(ManagerPrefix, ManagerPins, ManagerQuota, ManagerSwap, ManagerViews):
    """Sequences and block tables over a pool of ``num_blocks`` x ``block_size`` tokens.

    Leases are opened, renewed and released through :attr:`leases`; KV events
    are read from :attr:`prefix_cache`.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        lease_ttl: default lease TTL, seconds.
        clock: monotonic time source in seconds (tests inject a fake one).
        prefix_caching: keep computed full blocks for reuse (vLLM's automatic prefix caching).
        max_events: KV events retained for replay.
        epochs: the pool's shared epoch table, int64 [num_blocks] (default: a private one).
        max_blocks_per_lease: quota of block-table entries a lease's sequences may hold
            together (a block shared by two of them counts twice); None = unlimited. A lease the
            admin opened (``Lease.exempt``) has none.
        max_sequences_per_lease: quota of live sequences per lease; None = unlimited.
        max_leases: most live leases; None = unlimited.
        max_leases_per_peer: most live leases one peer opened, the admin's not counted; None = unlimited.
        host_num_blocks: blocks in the host tier behind the pool (0: none; :mod:`memory_service.tiers.manager`).
        host_epochs: the host tier's epochs, int64 [host_num_blocks] (default: a private table).
        disk: the disk tier behind the host tier (:mod:`memory_service.tiers.disk_traffic`; needs a host tier).

    NOTE: quotas (:mod:`memory_service.manager.quota`). Allocate, append and fork check the lease's
    quotas after validating the batch and before the pool's availability, so a refusal (QuotaExceededError,
    RESOURCE_EXHAUSTED + QUOTA_EXCEEDED) changes nothing, not even a counter. Blocks
    count as table entries, not distinct blocks, because that is what a lease can make
    the service track: forking a long sequence adds entries without taking a block.

    Raises:
        ValueError: a non-positive size, TTL or quota.
    """

    def __init__(self, num_blocks: int, block_size: int, *, lease_ttl: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, prefix_caching: bool = True, max_events: int = 10_000,
                 epochs: np.ndarray | None = None, max_blocks_per_lease: int | None = None,
                 max_sequences_per_lease: int | None = None, max_leases: int | None = None,
                 max_leases_per_peer: int | None = None, host_num_blocks: int = 0,
                 host_epochs: np.ndarray | None = None, disk=None):
        for name, quota in (("max_blocks_per_lease", max_blocks_per_lease),
                            ("max_sequences_per_lease", max_sequences_per_lease)):
            if quota is not None and quota < 1:
                raise ValueError(f"{name} must be >= 1 (or unset for no quota), got {quota}")
        self.max_blocks_per_lease = max_blocks_per_lease
        self.max_sequences_per_lease = max_sequences_per_lease
        self.leases = LeaseTable(lease_ttl, self._free_lease_sequences, clock, max_leases,  # checks the TTL first
                                 max_leases_per_peer)
        self.pool = BlockPool(num_blocks, block_size, epochs)  # refcounts, fill levels, epochs, the free queue
        self.block_size = block_size
        self.sequences = SequenceTable()
        self.prefix_cache = PrefixCache(self.pool, enabled=prefix_caching, max_events=max_events)
        #: The host tier and the copies between it and the pool (offload, reload, swap).
        self.tiers = Tiers(self.pool, self.prefix_cache,
                           HostTier(host_num_blocks, host_epochs) if host_num_blocks else None)
        if disk is not None:
            if self.tiers.host is None:
                raise ValueError("a disk tier stages its copies through a host tier: give host_num_blocks")
            self.tiers.attach_disk(disk)
        self.allocation_failures, self.preemptions = 0, 0  # requests refused with OutOfBlocks; preempted sequences
        self.pins, self.pins_expired = {}, 0  # prefix pins (memory_service.manager.pins)
        #: Block references of dropped leases' sequences not yet returned (see _free_lease_sequences).
        self.releasing = ReleaseQueue(self.pool)
        #: Called (no arguments) when references are left to release; the server wakes its drain task.
        self.on_releasing: Callable[[], None] | None = None

    def _check_tokens(self, n: int, what: str) -> None:
        capacity = self.pool.num_blocks * self.block_size
        if not 1 <= n <= capacity:
            raise InvalidArgumentError(f"{what}: num_tokens must be in [1, {capacity}] (the pool's whole token "
                                       f"capacity), got {n}")

    def _refuse(self, required: int, pinned: int = 0) -> OutOfBlocks:
        """Count and return a refusal; ``pinned`` cached hits are not available to this request."""
        available = self.pool.num_available - pinned
        self.allocation_failures += 1
        log.info("out_of_blocks", required=required, available=available)
        return OutOfBlocks(required, available)

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
                more token ids than the pool's tokens, token ids outside int32.
            NotFoundError / FailedPreconditionError: unknown / expired lease.
            QuotaExceededError: the lease's sequences or block-table entries would pass its quota.
        """
        lease = self.leases.lookup(lease_id)
        check_batch(len(requests), "AllocateSequences")
        reqs = [r if isinstance(r, Allocation) else Allocation(r) for r in requests]
        check_token_ids(sum(len(r.token_ids) for r in reqs if r.token_ids is not None), "AllocateSequences")
        bs, pool = self.block_size, self.pool
        plans = [self._plan_prefix(r) for r in reqs]
        pinned = {b for p in plans for b in p.hit.block_ids if pool.ref_counts[b] == 0}
        required = sum(blocks_for(p.total, bs) - len(p.hit.block_ids) for p in plans)
        self._check_quota(lease, "AllocateSequences", sum(blocks_for(p.total, bs) for p in plans), len(plans))
        if required > pool.num_available - len(pinned):
            if self.releasing_refs:  # released blocks count as available: finish returning them, plan again
                self.drain_released()
                return self.allocate(lease_id, requests)
            return self._refuse(required, len(pinned))
        for p in plans:  # pin every hit of the batch before anything is evicted
            pool.touch(p.hit.block_ids)
            if p.host:
                self.tiers.host.pin(h for _, h in p.host)
        out = []
        for p in plans:
            hits = p.hit.block_ids
            seq = self.sequences.add(lease, p.total, hits + pool.allocate(blocks_for(p.total, bs) - len(hits)))
            self.tiers.attach(seq)  # offloads of the blocks it took
            self._start_prefix(seq, p)
            pool.fill_tokens(seq.block_ids, 0, p.total)
            if p.request.token_ids:
                self.prefix_cache.record_lookup(len(p.request.token_ids), len(hits) + len(p.host))
            out.append(seq)
        log.debug("allocated", lease_id=lease_id, num_sequences=len(out), num_blocks=required)
        return out

    def append_slots(
        self, lease_id: str, appends: Seq[Append], before_apply: Callable[[], object] | None = None
    ) -> AppendResult | OutOfBlocks:
        """Grow each sequence of the batch by its :class:`Append`'s ``num_tokens`` slots.

        The optional token ids are the tokens appended (kept for prefix caching;
        an append without them ends caching for that sequence).

        A new block is allocated only at a block boundary. If a sequence's last
        block is partly filled and shared (refcount > 1), it first gets a fresh
        block and a :class:`BlockCopy` the worker does before writing::

            parent  [ 7 | 3* ]          * refcount 2, 2 of 4 slots filled
            child   [ 7 | 3* ]
            append(child, 1)
            parent  [ 7 | 3  ]          copies: [BlockCopy(src=3, dst=9)]
            child   [ 7 | 9  ]          block 9 = copy of 3, then slot 2 written
                                        updates: [child: first_changed=1, block_ids=(9,)]

        Returns an :class:`AppendResult` (the tables that changed, as deltas, in
        request order; the copies in order) or :class:`OutOfBlocks` with nothing
        changed. ``before_apply`` runs once the batch is known to fit, right before
        it is applied (AppendSlots takes the last step's receipts there, so that a
        refused call takes none); what it raises refuses the call.

        Raises:
            InvalidArgumentError: empty batch, duplicate ids, a count < 1, growth past pool capacity.
            NotFoundError / FailedPreconditionError: unknown sequence or lease, expired lease.
            QuotaExceededError: the lease's block-table entries would pass its quota.
        """
        lease = self.leases.lookup(lease_id)
        seqs = self.sequences.owned(lease.lease_id, (a.seq_id for a in appends), "AppendSlots")
        check_token_ids(sum(len(a.token_ids) for a in appends if a.token_ids), "AppendSlots")
        for seq, a in zip(seqs, appends):
            if seq.swap is not None:
                raise FailedPreconditionError(
                    f"AppendSlots: sequence {seq.seq_id} is swapped out; swap it in first "
                    "(SwapInSequences; nothing was appended)"
                )
            self._check_append(seq, a, "AppendSlots")
        required, grown = self._append_need(seqs, appends)
        self._check_quota(lease, "AppendSlots", grown, 0)
        if required > self.pool.num_available:
            if self.releasing_refs:  # as in allocate
                self.drain_released()
                return self.append_slots(lease_id, appends, before_apply)
            return self._refuse(required)
        if before_apply is not None:
            before_apply()
        return self._apply_appends(lease, seqs, appends)

    def _check_append(self, seq: Sequence, a: Append, what: str) -> None:
        """Refuse ``a`` for ``seq`` before any change: a count < 1, growth past the pool's token
        capacity, or token ids that are not one per slot (InvalidArgumentError naming ``what``)."""
        k, n = a.num_tokens, seq.num_tokens
        if not (1 <= k and n + k <= self.pool.num_blocks * self.block_size):
            self._check_tokens(k, what)
            self._check_tokens(n + k, f"{what}(sequence {seq.seq_id})")
        if a.token_ids and len(a.token_ids) != k:
            raise InvalidArgumentError(f"{what}(sequence {a.seq_id}): {len(a.token_ids)} token ids for {k} tokens")

    def _append_need(self, seqs: list[Sequence], appends: Seq[Append]) -> tuple[int, int]:
        """(blocks, table entries) that appending ``appends`` to ``seqs`` (checked) takes: a new block
        per block boundary crossed, and one per copy-on-write (which replaces an entry), simulating
        the refcount drops of the batch's earlier copies of the same shared block."""
        bs, ref_counts = self.block_size, self.pool.ref_counts
        required = grown = 0
        dropped: Counter[int] = Counter()
        for seq, a in zip(seqs, appends):
            n = seq.num_tokens
            last = seq.block_ids[-1] if seq.block_ids else None  # none: a failover fork of nothing proven
            if n % bs and ref_counts[last] > 1 and ref_counts[last] - dropped[last] > 1:
                dropped[last] += 1
                required += 1
            grow = -(-(n + a.num_tokens) // bs) - len(seq.block_ids)
            required += grow
            grown += grow
        return required, grown

    def _apply_appends(self, lease: Lease, seqs: list[Sequence], appends: Seq[Append]) -> AppendResult:
        """Append ``appends`` to ``seqs`` (checked, known to fit), in order: the tables that changed
        and the copies-on-write (see :meth:`append_slots`)."""
        bs, pool = self.block_size, self.pool
        ref_counts = pool.ref_counts
        result = AppendResult([], [])
        for seq, a in zip(seqs, appends):
            k, n, table = a.num_tokens, seq.num_tokens, seq.block_ids
            seq.extend_tokens(a.token_ids)
            first = len(table)  # first table entry this append changes
            last = table[-1] if table else None
            if n % bs and ref_counts[last] > 1:
                (dst,) = pool.allocate(1)
                result.copies.append(BlockCopy(last, dst, seq.seq_id))
                pool.decref([last])
                table[-1] = seq.copy_pending = dst
                pool.set_fill(dst, n % bs)
                first -= 1
            grow = -(-(n + k) // bs) - len(table)
            if grow:
                table.extend(pool.allocate(grow))
                lease.num_block_entries += grow
            self.tiers.attach(seq)  # offloads of the blocks it took, done before its copy-on-write
            seq.num_tokens = n + k
            pool.fill_tokens(table, n, n + k)
            if first < len(table):  # only tables that changed are reported
                result.updates.append(BlockTableUpdate(seq.seq_id, n + k, first, tuple(table[first:])))
        return result

    def fork(self, lease_id: str, parent_ids: Seq[int], proven_only: Seq[bool] = ()) -> list[Sequence]:
        """Fork each parent (ids may repeat): a child sharing every block (refcount + 1).

        Forking allocates nothing, so it cannot run out of blocks; the copy
        happens on the first append into a shared, partly filled block.

        ``proven_only[i]`` (default False): child ``i`` holds only its parent's proven tokens and the
        blocks that hold them -- a failover fork. The parent keeps the blocks a step in flight may
        still write (the caller frees it once that step's worker is gone); the child continues in
        fresh blocks, its partly filled last block copied on its first append. A partly filled
        block whose copy-on-write no receipt proved yet holds none of those tokens (the lost step
        was to copy them there): the child ends before it and computes them again.

        Raises:
            InvalidArgumentError: empty or oversized batch, more than :data:`MAX_FORK_CHILDREN`
                children or :data:`MAX_FORK_BLOCK_IDS` block-table entries in the reply (nothing
                is forked).
            NotFoundError / FailedPreconditionError: unknown parent or lease, expired lease.
            QuotaExceededError: the lease's sequences or block-table entries would pass its quota.
        """
        lease = self.leases.lookup(lease_id)
        if len(parent_ids) > MAX_FORK_CHILDREN:  # before check_batch: the more precise limit (<= MAX_BATCH)
            raise InvalidArgumentError(
                f"ForkSequences: {len(parent_ids)} children is more than the {MAX_FORK_CHILDREN} "
                "one call may create (pagedkv.runtime.limits.MAX_FORK_CHILDREN); fork in several calls"
            )
        check_batch(len(parent_ids), "ForkSequences")
        unique = list(dict.fromkeys(parent_ids))
        by_id = dict(zip(unique, self.sequences.owned(lease_id, unique, "ForkSequences")))
        if len(proven_only) not in (0, len(parent_ids)):
            raise InvalidArgumentError(
                f"ForkSequences: proven_only names {len(proven_only)} forks of {len(parent_ids)}")
        bs = self.block_size
        held = [by_id[p].proven_held(bs) if proven_only and proven_only[i] else None
                for i, p in enumerate(parent_ids)]
        keep = [len(by_id[p].block_ids) if n is None else -(-n // bs) for p, n in zip(parent_ids, held)]
        entries = sum(keep)
        if entries > MAX_FORK_BLOCK_IDS:
            raise InvalidArgumentError(
                f"ForkSequences: the children's block tables would hold {entries} entries, more "
                f"than the {MAX_FORK_BLOCK_IDS} one reply may carry (pagedkv.runtime.limits.MAX_FORK_BLOCK_IDS); "
                "fork in several calls"
            )
        for p in by_id.values():
            if p.swap is not None or p.reloads:
                what = (
                    "is swapped out"
                    if p.swap is not None
                    else "has reloads no receipt has proven yet (run its step first)"
                )
                raise FailedPreconditionError(f"ForkSequences: sequence {p.seq_id} {what}; nothing was forked")
        self._check_quota(lease, "ForkSequences", entries, len(parent_ids))
        children = []
        for i, parent in enumerate(by_id[p] for p in parent_ids):
            self.pool.incref(parent.block_ids[:keep[i]])
            children.append(self.sequences.fork(lease, parent, held[i], bs))
        return children

    def free(self, lease_id: str, seq_ids: Seq[int], *, preempted: bool = False) -> int:
        """Free a batch of sequences; returns blocks whose refcount reached zero.

        Raises:
            InvalidArgumentError: empty batch or duplicate ids.
            NotFoundError: a sequence unknown, already freed, or of another lease (nothing freed).
            FailedPreconditionError: the lease expired.
        """
        lease = self.leases.lookup(lease_id)
        seqs = self.sequences.owned(lease_id, seq_ids, "FreeSequences")
        freed = sum(self._free_one(seq, lease) for seq in seqs)
        if preempted:
            self.preemptions += len(seqs)
        return freed

    def _free_one(self, seq: Sequence, lease: Lease) -> int:
        refs = self.tiers.referenced(seq)
        self.tiers.forget(seq)
        self.sequences.remove(seq, lease)
        return self.pool.decref(refs)

    def _free_lease_sequences(self, lease: Lease) -> int:
        """Free every sequence of a lease being dropped (released or expired); returns how many.

        The sequences leave the table at once; their blocks return to the pool in chunks
        (:mod:`memory_service.release_queue`): the first now, the rest from :meth:`drain_released`
        over the next loop turns (the server's drain task, woken through :attr:`on_releasing`).
        OUT_OF_BLOCKS stays exact: references not yet returned count as used (refcount == table
        entries + references releasing, :meth:`check_invariants`), and an allocation or append that
        would be refused first returns every pending reference and plans again.
        """
        seqs = [self.sequences[s] for s in sorted(lease.seq_ids)]
        for seq in seqs:
            refs = self.tiers.referenced(seq)
            self.tiers.forget(seq)
            self.sequences.remove(seq, lease)
            self.releasing.push(refs)
        if self.drain_released(RELEASE_CHUNK_BLOCKS) and self.on_releasing is not None:
            self.on_releasing()
        return len(seqs)

    @property
    def releasing_refs(self) -> int:
        """Block references of dropped leases not yet returned to the pool."""
        return self.releasing.refs

    def drain_released(self, max_blocks: int | None = None) -> int:
        """Return up to ``max_blocks`` (None: all) references of dropped leases' blocks to the pool;
        returns the references still pending (0 when done)."""
        return self.releasing.drain(max_blocks)
