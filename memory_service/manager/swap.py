"""Swapping a block manager's sequences out to the host tier and back (PagedAttention, Kwon et al.,
SOSP 2023, section 4.5).

The swap half of :class:`memory_service.manager.block_manager.BlockManager`: the batch checks and the
all-or-nothing accounting of a swap-in with its appends; which blocks move and what the workers
copy is :class:`memory_service.tiers.manager.Tiers`' (:mod:`memory_service.tiers.swap`). A mixin: it reads
the manager's ``leases``, ``sequences``, ``pool``, ``tiers`` and ``block_size``, and calls its
``_check_quota``, ``_check_append``, ``_refuse``, ``drain_released`` and ``append_slots``.

NOTE: a swapped-out sequence (``seq.swap`` not None) takes no append and no fork until it is
swapped in; a swap-in with appends counts the blocks of the appends' copy-on-write of a shared
last block still on the device, so that its appends cannot run out of blocks once it is in.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from memory_service.manager.requests import Append, AppendResult, OutOfBlocks, check_token_ids
from memory_service.manager.sequence import Sequence, blocks_for
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError


class ManagerSwap:
    """Swap-out and swap-in of a block manager's sequences (mixed into ``BlockManager``)."""

    def swap_out(self, lease_id: str, seq_ids: Seq[int]) -> tuple[int, int]:
        """Swap out a batch of sequences (PagedAttention section 4.5; :meth:`Tiers.swap_out`): returns
        (device blocks released, host blocks reserved).

        Raises:
            InvalidArgumentError: empty batch or duplicate ids.
            NotFoundError / FailedPreconditionError: unknown sequence or lease, expired lease.
            FailedPreconditionError: a sequence swapped out already, unproven reloads, or no host
                tier (reason HOST_TIER_OFF).
            OutOfHostBlocksError: the host tier cannot hold the sequences' own blocks (nothing changed).
        """
        self.leases.lookup(lease_id)
        seqs = self.sequences.owned(lease_id, seq_ids, "SwapOutSequences")
        for seq in seqs:
            if seq.swap is not None:
                raise FailedPreconditionError(f"SwapOutSequences: sequence {seq.seq_id} is swapped out already "
                                              "(nothing was swapped)")
        return self.tiers.swap_out(seqs)

    def swap_in(self, lease_id: str, seq_ids: Seq[int], appends: Seq[Append] = ()
                ) -> tuple[list[Sequence], AppendResult | None] | OutOfBlocks:
        """Bring swapped-out sequences back to the device, then add ``appends``' slots to them, all
        or nothing (:meth:`Tiers.swap_in`, :meth:`append_slots`): the sequences, with reload copies
        for what left the device, and the appends' result (None without appends); or
        :class:`OutOfBlocks` with nothing changed. Blocks a shared last block may need for its
        copy-on-write count as needed.

        Raises:
            InvalidArgumentError: empty batch, duplicate ids, an append for a sequence not in the
                batch or twice, a bad append (as :meth:`append_slots`).
            NotFoundError / FailedPreconditionError: unknown sequence or lease, expired lease.
            FailedPreconditionError: a sequence not swapped out; reason SWAP_LOST, a block that left
                the device with no proven host copy (free the sequence and recompute it).
            QuotaExceededError: the appends would take the lease past its block quota.
        """
        lease = self.leases.lookup(lease_id)
        seqs = self.sequences.owned(lease_id, seq_ids, "SwapInSequences")
        for seq in seqs:
            if seq.swap is None:
                raise FailedPreconditionError(f"SwapInSequences: sequence {seq.seq_id} is not swapped out "
                                              "(nothing was swapped in)")
        by_id = {s.seq_id: s for s in seqs}
        if len({a.seq_id for a in appends}) != len(appends) or any(a.seq_id not in by_id for a in appends):
            raise InvalidArgumentError("SwapInSequences: each append must name a sequence of the batch, at most once")
        check_token_ids(sum(len(a.token_ids) for a in appends if a.token_ids), "SwapInSequences")
        bs, rc = self.block_size, self.pool.ref_counts
        grow = cow = 0
        for a in appends:
            seq = by_id[a.seq_id]
            self._check_append(seq, a, "SwapInSequences")
            grow += blocks_for(seq.num_tokens + a.num_tokens, bs) - len(seq.block_ids)
            cow += bool(seq.num_tokens % bs and seq.swap[-1] is None and rc[seq.block_ids[-1]] > 1)
        self._check_quota(lease, "SwapInSequences", grow, 0)
        new, kept = self.tiers.swap_in_need(seqs)
        if new + grow + cow > self.pool.num_available - kept:
            if self.releasing_refs:
                self.drain_released()
                return self.swap_in(lease_id, seq_ids, appends)
            return self._refuse(new + grow + cow, kept)
        self.tiers.swap_in(seqs)
        if not appends:
            return seqs, None
        result = self.append_slots(lease_id, appends)
        assert not isinstance(result, OutOfBlocks), f"swap-in counted its appends' blocks wrong: {result}"
        return seqs, result


__all__ = ["ManagerSwap"]
