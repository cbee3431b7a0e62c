"""A block manager's per-lease quotas (:mod:`memory_service.quotas` has the defaults).

A mixin of :class:`memory_service.manager.block_manager.BlockManager`: it reads the manager's
``max_blocks_per_lease`` and ``max_sequences_per_lease``. Allocate, append, fork, swap-in and
export check a lease's quotas after validating the batch and before the pool's availability,
so a refusal changes nothing, not even a counter.
"""

from __future__ import annotations

from memory_service.leases import Lease
from pagedkv.runtime.errors import QuotaExceededError


class ManagerQuota:
    """Per-lease quotas of block-table entries and live sequences (mixed into ``BlockManager``)."""

    #: Block-table entries one lease may hold (None: no quota); a lease the admin opened is exempt.
    max_blocks_per_lease: int | None
    #: Live sequences one lease may hold (None: no quota); every lease, the admin's too.
    max_sequences_per_lease: int | None

    def block_quota(self, lease: Lease) -> int | None:
        """Block-table entries ``lease`` may hold; None: no quota (none set, or the admin opened it)."""
        return None if lease.exempt else self.max_blocks_per_lease

    def _check_quota(self, lease: Lease, what: str, blocks: int, sequences: int) -> None:
        """Refuse (before any change) a call that adds ``blocks`` table entries and ``sequences`` to ``lease``.

        Raises:
            QuotaExceededError: the lease would hold more than its quota of sequences or of blocks.
        """
        limit = self.max_sequences_per_lease
        if limit is not None and sequences and len(lease.seq_ids) + sequences > limit:
            raise QuotaExceededError("sequences", limit, sequences, len(lease.seq_ids), what)
        limit = self.block_quota(lease)
        if limit is not None and blocks and lease.num_block_entries + blocks > limit:
            raise QuotaExceededError("blocks", limit, blocks, lease.num_block_entries, what)


__all__ = ["ManagerQuota"]
