"""What the block manager does with cached and computed KV: a new sequence's cached prefix over the
tiers, exports to another node, commits and receipts, and resets of the prefix cache.

The prefix-cache half of :class:`memory_service.manager.block_manager.BlockManager`, kept apart from its
block-table changes (allocate, append, fork, free). A mixin: it reads the manager's ``leases``,
``sequences``, ``pool``, ``prefix_cache``, ``tiers`` and ``block_size``, and calls its
``_check_quota``, ``_check_tokens`` and ``cached_prefix``.

- Allocation (:class:`PrefixPlan`): the leading full blocks of a request's token ids cached on
  the device are shared; those continuing them in the host tier are reloaded into fresh blocks,
  and those continuing them on another node (a ticket, :class:`RemotePrefix`) are read by node
  transfer (DESIGN.md, "Tiers and transfers"). Those tokens count as cached; the rest are computed.
- Export: this node's cached prefix is pinned as a sequence for another node to read.
- Commits and receipts count a step's tokens as computed; full blocks enter the prefix cache
  (:mod:`memory_service.receipts`).

NOTE: invariants of a plan (relied on by ``BlockManager.allocate``):
  * ``hit``, ``host`` and ``remote`` continue one chain of block hashes, in that order, and never
    reach the block holding the request's last token (it always has a query to compute);
  * ``total`` (tokens) is in [1, the pool's token capacity] and covers every cached block.
"""

from __future__ import annotations

from collections.abc import Generator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from memory_service.manager.requests import Allocation, Commit, CommitResult, Receipt, check_token_ids
from memory_service.manager.sequence import Sequence
from memory_service.prefix_cache import CachedPrefix
from memory_service.receipts import commit_unproven, take_receipts
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import InvalidArgumentError


@dataclass(slots=True)
class PrefixPlan:
    """One allocation request's cached prefix over the tiers, and the tokens it reserves."""

    #: The request.
    request: Allocation
    #: Leading full blocks cached on the device: shared, not allocated.
    hit: CachedPrefix
    #: ``(hash, host block)`` continuing them in the host tier: reloaded into fresh device blocks.
    host: list[tuple[bytes, int]]
    #: ``(hash, block, epoch)`` continuing them on another node: read by node transfer.
    remote: list[tuple[bytes, int, int]]
    #: Tokens the new sequence holds slots for (cached and to compute).
    total: int

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV the sequence does not compute (shared, reloaded or transferred)."""
        return len(self.hit.block_ids) + len(self.host) + len(self.remote)


class ManagerPrefix:
    """Cached prefixes, exports, commits and resets of a block manager (mixed into ``BlockManager``)."""

    def _plan_prefix(self, r: Allocation) -> PrefixPlan:
        """Where ``r``'s cached prefix is (device, host tier, another node) and the tokens it takes;
        read-only.

        Raises:
            InvalidArgumentError: a count outside [1, pool tokens], more token ids than the pool's
                tokens, token ids outside int32.
        """
        bs = self.block_size
        capacity = self.pool.num_blocks * bs
        self._check_tokens(r.num_tokens, "AllocateSequences")
        if r.token_ids is not None and len(r.token_ids) > capacity:
            raise InvalidArgumentError(f"AllocateSequences: {len(r.token_ids)} token ids is more than a sequence "
                                       f"can hold (the pool's whole token capacity, {capacity})")
        hit, host = self.cached_prefix(r.token_ids, r.cache_key)  # host: the chain continued there (reloads)
        remote = self._remote_hits(r, hit.block_hashes, host)  # then on another node (node transfers)
        cached = (len(hit.block_ids) + len(host) + len(remote)) * bs
        total = cached + (min(r.num_tokens, len(r.token_ids) - cached) if r.token_ids else r.num_tokens)
        self._check_tokens(total, "AllocateSequences")
        return PrefixPlan(r, hit, host, remote, total)

    def _remote_hits(self, r: Allocation, device_hashes: list[bytes], host: list) -> list[tuple[bytes, int, int]]:
        """The blocks of ``r.remote`` (another node's) continuing this node's own cached prefix."""
        if r.remote is None or not r.token_ids:
            return []
        before = device_hashes + [k for k, _ in host]
        return self.tiers.remote_hits(r.token_ids, r.cache_key, before[-1] if before else None, len(before), r.remote)

    def _start_prefix(self, seq: Sequence, plan: PrefixPlan) -> None:
        """Give ``seq`` (just allocated with ``plan``'s blocks) its tokens, hashes and cached count,
        and start the reloads and node transfers of its cached blocks past the device's hits."""
        r, hit, host, remote, bs = plan.request, plan.hit, plan.host, plan.remote, self.block_size
        # Only the tokens it holds slots for: later appends extend from there.
        seq.token_ids = list(r.token_ids[:plan.total]) if r.token_ids is not None else None
        seq.block_hashes = hit.block_hashes + [k for k, _ in host] + [k for k, *_ in remote]
        seq.cache_key, seq.num_cached_tokens = r.cache_key, plan.num_cached_blocks * bs
        seq.num_proven = seq.num_cached_tokens
        if host:
            self.tiers.start_reloads(seq, len(hit.block_ids), host, hit.block_hashes[-1] if hit.block_hashes else b"")
        if remote:
            before = len(hit.block_ids) + len(host)
            self.tiers.start_transfers(seq, before, remote, seq.block_hashes[before - 1] if before else b"",
                                       r.remote.source)

    def export_prefix(self, lease_id: str, token_ids: Seq[int], key: CacheKey) -> Sequence | None:
        """Pin the leading full blocks of ``token_ids`` cached on the device, for another node to read,
        as a new sequence of ``lease_id`` holding just them (proven, refcount + 1: nothing evicts or
        rewrites them until it is freed; the lease's end frees it too). None when none is cached
        (nothing changes). Never the block holding the last token (as a lookup).

        Raises:
            InvalidArgumentError: more token ids than one call may carry, ids outside int32.
            NotFoundError / FailedPreconditionError: unknown / expired lease.
            QuotaExceededError: the lease's sequences or block-table entries would pass its quota.
        """
        lease = self.leases.lookup(lease_id)
        check_token_ids(len(token_ids), "ExportPrefix")
        hit = self.prefix_cache.lookup(token_ids, key)
        if not hit.block_ids:
            return None
        n = len(hit.block_ids) * self.block_size
        self._check_quota(lease, "ExportPrefix", len(hit.block_ids), 1)
        self.pool.touch(hit.block_ids)
        seq = self.sequences.add(lease, n, list(hit.block_ids))
        seq.token_ids, seq.block_hashes, seq.cache_key = list(token_ids[:n]), list(hit.block_hashes), key
        seq.num_cached_tokens = seq.num_proven = n
        return seq

    def commit_computed(self, lease_id: str, entries: Seq[Commit]) -> CommitResult:
        """Count each :class:`Commit`'s tokens as computed without a receipt (in-process callers
        only: the gRPC API takes receipts, :meth:`commit_receipts`); errors as :func:`commit_unproven`."""
        self.leases.lookup(lease_id)
        return commit_unproven(self.sequences, self.prefix_cache, lease_id, entries)

    def commit_receipts(self, lease_id: str, receipts: Seq[Receipt]) -> CommitResult:
        """Take workers' receipts (signatures checked by the caller): :func:`take_receipts`.

        Raises:
            FailedPreconditionError / NotFoundError: the lease expired or is unknown; and as
                :func:`take_receipts`.
        """
        self.leases.lookup(lease_id)
        return take_receipts(self.sequences, self.pool, self.prefix_cache, lease_id, receipts, self.tiers)

    def reset_prefix_cache(self) -> int:
        """Drop the whole prefix cache, both tiers; returns refcount-0 device blocks cleared."""
        if self.tiers.host is not None:
            self.tiers.host.clear_cached()
        return self.prefix_cache.reset(self.sequences.values())

    def reset_prefix_cache_steps(self, chunk: int) -> Generator[int, None, int]:
        """:meth:`reset_prefix_cache` in steps of at most ``chunk`` blocks (PrefixCache.reset_steps),
        for a caller that lets other calls run where it yields; it returns the blocks cleared."""
        if self.tiers.host is not None:
            self.tiers.host.clear_cached()
        return self.prefix_cache.reset_steps(list(self.sequences.values()), chunk)


__all__ = ["ManagerPrefix", "PrefixPlan"]
