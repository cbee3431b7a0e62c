"""What the block manager shows: sequence snapshots and pages, counters, and the invariant check.

The read-only half of :class:`memory_service.manager.block_manager.BlockManager` (GetBlockTable,
ListSequences, GetStats, Prometheus, CheckInvariants), kept apart from its batched changes. A
mixin: it reads the manager's ``leases``, ``sequences``, ``pool``, ``prefix_cache``, ``tiers``,
``releasing`` and counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

from memory_service.manager.requests import Stats, check_token_ids
from memory_service.manager.sequence import Sequence, SequenceInfo
from memory_service.prefix_cache import CachedPrefix
from pagedkv.runtime.block_hash import CacheKey


class ManagerViews:
    """Snapshots, pages, counters and invariants of a block manager (mixed into ``BlockManager``)."""

    def get_sequence(self, seq_id: int) -> Sequence:
        """The live sequence ``seq_id``; raises NotFoundError if it was never allocated, or was freed."""
        self.leases.expire()
        return self.sequences.lookup(seq_id)

    def sequence_info(self, seq_id: int) -> SequenceInfo:
        """A snapshot of sequence ``seq_id`` with its blocks' refcounts (errors as :meth:`get_sequence`)."""
        return SequenceInfo.of(self.get_sequence(seq_id), self.pool.ref_counts)

    def sequence_page(self, lease_id: str | None, start: int, limit: int) -> tuple[list[SequenceInfo], int | None]:
        """Up to ``limit`` snapshots of live sequences with id >= ``start``, by id, and the next page's start.

        ``lease_id``: only that lease's (O(its sequences)); None = all (amortized O(page)).
        The next start is None on the last page.

        Raises:
            NotFoundError / FailedPreconditionError: unknown / expired lease.
        """
        ids = None if lease_id is None else self.leases.lookup(lease_id).seq_ids
        if lease_id is None:
            self.leases.expire()
        seqs, nxt = self.sequences.page(start, limit, ids)
        return [SequenceInfo.of(s, self.pool.ref_counts) for s in seqs], nxt

    def sequence_infos(self, lease_id: str | None = None) -> list[SequenceInfo]:
        """Snapshots of the live sequences by id, optionally only those of one lease."""
        if lease_id is None:
            self.leases.expire()
        ids = sorted(self.sequences if lease_id is None else self.leases.lookup(lease_id).seq_ids)
        return [SequenceInfo.of(self.sequences[s], self.pool.ref_counts) for s in ids]

    def lookup_prefix(self, token_ids: Seq[int], key: CacheKey) -> tuple[int, int]:
        """Leading tokens of ``token_ids`` cached now, on the device and then in the host tier:
        ``(device_tokens, host_tokens)``, counted as :meth:`allocate` would find them (full blocks,
        never the block holding the last token). Read-only: no pin, no LRU move, no counter.

        Raises:
            InvalidArgumentError: more token ids than one call may carry, or ids outside int32.
        """
        check_token_ids(len(token_ids), "LookupPrefix")
        hit, host = self.cached_prefix(token_ids, key)
        return len(hit.block_ids) * self.block_size, len(host) * self.block_size

    def prefetch_prefix(self, token_ids: Seq[int], key: CacheKey) -> tuple[int, int, int, int]:
        """``(device_tokens, host_tokens, disk_tokens, disk_reads_pending)`` of ``token_ids``: as
        :meth:`lookup_prefix`, then the disk tier's blocks continuing them, queued to be read into
        the host tier (:meth:`Tiers.prefetch_disk`); the allocation finds them there once no read
        is pending. Without a disk tier, disk_tokens and disk_reads_pending are 0.

        Raises:
            InvalidArgumentError: more token ids than one call may carry, or ids outside int32.
        """
        check_token_ids(len(token_ids), "PrefetchPrefix")
        hit, host = self.cached_prefix(token_ids, key)
        found, pending = 0, 0
        if self.prefix_cache.enabled and self.tiers.disk is not None:
            parent = host[-1][0] if host else hit.block_hashes[-1] if hit.block_hashes else None
            found, pending = self.tiers.prefetch_disk(token_ids, key, parent, len(hit.block_ids) + len(host))
        bs = self.block_size
        return len(hit.block_ids) * bs, len(host) * bs, found * bs, pending

    def cached_prefix(self, token_ids: Seq[int] | None, key: CacheKey) -> tuple[CachedPrefix, list[tuple[bytes, int]]]:
        """The leading full blocks of ``token_ids`` cached on the device (:meth:`PrefixCache.lookup`),
        and the host tier's ``(hash, host block)`` continuing them (:meth:`Tiers.host_hits`); read-only.

        Raises:
            InvalidArgumentError: token ids outside int32.
        """
        hit = self.prefix_cache.lookup(token_ids, key)
        if not self.prefix_cache.enabled:
            return hit, []
        parent = hit.block_hashes[-1] if hit.block_hashes else None
        return hit, self.tiers.host_hits(token_ids, key, parent, len(hit.block_ids))

    def stats(self) -> Stats:
        """Counters for GetStats (DESIGN.md, Observability)."""
        self.leases.expire()
        p, cache = self.pool, self.prefix_cache
        return Stats(
            total_blocks=p.num_blocks, free_blocks=p.num_free, cached_blocks=p.num_cached, used_blocks=p.num_used,
            available_blocks=p.num_available, block_size=self.block_size, tokens_stored=p.tokens_stored,
            utilization=p.tokens_stored / (p.num_used * self.block_size) if p.num_used else 0.0,
            num_sequences=len(self.sequences), num_leases=len(self.leases),
            allocation_failures=self.allocation_failures, preemptions=self.preemptions,
            prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits, shared_block_refs=p.shared_refs,
            prefix_cache_evictions=cache.evictions, prefix_caching=cache.enabled,
            **self._tier_stats(), pins=self.pin_stats(),
        )

    def _tier_stats(self) -> dict:
        t, h = self.tiers, self.tiers.host
        out = dict(swap_outs=t.swap_outs, swap_ins=t.swap_ins, swapped_sequences=t.swapped)
        if h is not None:
            out.update(host_total_blocks=h.num_blocks, host_free_blocks=h.num_free, host_cached_blocks=h.num_cached,
                       host_used_blocks=h.num_used, offloads=h.offloads, reloads=h.reloads,
                       offloads_dropped=h.offloads_dropped, host_cache_hits=h.hits, host_cache_evictions=h.evictions)
        if t.disk is not None:
            out["disk"] = t.disk.stats()
        return out

    def check_invariants(self) -> None:
        """Assert DESIGN.md's invariants: the pool's, the prefix cache's, the tables' (O(blocks + table entries))."""
        self.pool.check()
        self.prefix_cache.check(self.tiers.held)
        self.sequences.check(self.leases, self.block_size)
        refs = Counter(b for seq in self.sequences.values() for b in self.tiers.referenced(seq))
        refs.update(self.releasing.blocks())
        self.tiers.check(self.sequences.values())
        self.releasing.check()
        self.check_pins()
        for b, rc in enumerate(self.pool.ref_counts):
            assert rc == refs[b], f"block {b}: refcount {rc} but {refs[b]} block-table entries"
