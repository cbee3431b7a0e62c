"""Swap (PagedAttention, Kwon et al., SOSP 2023, section 4.5) between the device pool and the host
tier: which blocks a swapped-out sequence keeps, where their KV goes, and how it comes back.

A swapped-out sequence's own blocks (refcount 1) get host blocks reserved at once, all or
nothing; its device blocks go back to the pool keeping their KV, last in line to be handed out,
and are offloaded only when handed out (:meth:`Tiers._evicted`). Swap-in takes back the blocks
still on the device with no copy and reloads the rest, so a swap costs copies only for the memory
that was actually needed meanwhile. Shared blocks stay on the device, referenced.

A mixin of :class:`memory_service.tiers.manager.Tiers`: it reads and writes its ``pool``, ``cache``,
``host``, ``held``, ``swap_targets`` and swap counters, and calls its ``attach`` and
``_offload_settled``.

NOTE: invariants (checked by :meth:`Tiers.check`):
  * ``held[b] == (seq, i)``  <=>  ``seq.swap[i].device == b``; such a block has refcount 0 and a
    content mark, and no prefix-cache hash;
  * a host block in ``swap_targets`` is held (``HostTier.state == HELD``) for one swapped
    sequence's block whose offload is not proven yet (None: that sequence is gone).
"""

from __future__ import annotations

from memory_service.manager.requests import DEVICE, HOST, BlockCopy
from memory_service.manager.sequence import Reload, Sequence, SwapEntry
from pagedkv.runtime.errors import HOST_TIER_OFF, SWAP_LOST, FailedPreconditionError, OutOfHostBlocksError


class TierSwap:
    """Swap-out, the blocks a swap-in needs, and swap-in (mixed into ``Tiers``)."""

    def swap_out(self, seqs: list[Sequence]) -> tuple[int, int]:
        """Swap out ``seqs`` (validated, not swapped): returns (device blocks released, host blocks held).

        Raises:
            FailedPreconditionError: no host tier (reason HOST_TIER_OFF), or a sequence with
                unproven reloads (its device blocks do not hold its KV yet).
            OutOfHostBlocksError: the host tier cannot hold every own block (nothing changed).
        """
        if self.host is None:
            raise FailedPreconditionError(
                "SwapOutSequences: this memory service has no host tier (start it with --host-cache-memory "
                "SIZE); preempt by recompute instead (FreeSequences with reason PREEMPTED)", reason=HOST_TIER_OFF)
        rc = self.pool.ref_counts
        for seq in seqs:
            if seq.reloads:
                raise FailedPreconditionError(
                    f"SwapOutSequences: sequence {seq.seq_id} has reloads no receipt has proven yet; run its "
                    "step first, or preempt it by recompute (nothing was swapped)")
        own = [[i for i, b in enumerate(seq.block_ids) if rc[b] == 1] for seq in seqs]
        need = sum(map(len, own))
        hosts = self.host.reserve_held(need)
        if hosts is None:
            raise OutOfHostBlocksError(need, self.host.num_available)
        it = iter(hosts)
        released = 0
        for seq, idx in zip(seqs, own):
            for c in [*seq.fresh_offloads, *seq.offloads]:  # its step will not run: they never happen
                self._offload_settled(c, proven=False)
            seq.fresh_offloads, seq.offloads = [], []
            seq.swap = [None] * len(seq.block_ids)
            for i in idx:
                b = seq.block_ids[i]
                if self.cache.hash_of[b] is not None:
                    self.cache.forget(b)  # content marks stay disjoint: cached or swapped
                    self.pool.drop_content(b)
                self.pool.keep_content(b, partial=True)
                self.pool.epochs[b] += 1  # grants issued before no longer match the block
                seq.swap[i] = SwapEntry(next(it), b)
                self.held[b] = (seq, i)
            released += self.pool.decref([seq.block_ids[i] for i in idx])
            # Commits after the swap-in re-register from the first block it gave up.
            seq.block_hashes = seq.block_hashes[:idx[0]] if idx else seq.block_hashes
        self.swap_outs += len(seqs)
        self.swapped += len(seqs)
        return released, need

    def swap_in_need(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(new device blocks, swapped blocks still on the device) that swapping in ``seqs`` takes.

        Raises:
            FailedPreconditionError: reason SWAP_LOST, a block that left the device with no proven
                host copy (free the sequence and recompute it).
        """
        new = kept = 0
        for seq in seqs:
            for i, e in enumerate(seq.swap):
                if e is None:
                    continue
                if e.device is not None:
                    kept += 1
                elif e.proven:
                    new += 1
                else:
                    why = (
                        "its offload is not proven yet" if e.host in self.swap_targets else "its offload never happened"
                    )
                    raise FailedPreconditionError(
                        f"SwapInSequences: block {i} of sequence {seq.seq_id} left the device and {why}; free the "
                        "sequence and recompute it (nothing was swapped in)",
                        reason=SWAP_LOST,
                    )
        return new, kept

    def swap_in(self, seqs: list[Sequence]) -> None:
        """Swap ``seqs`` back in (the caller checked :meth:`swap_in_need` against the pool): take back
        the blocks still on the device first, then allocate and reload the rest."""
        pool = self.pool
        for seq in seqs:  # first every kept block: the allocations below must not evict them
            for e in seq.swap:
                if e is not None and e.device is not None:
                    del self.held[e.device]
                    pool.touch([e.device])
                    pool.drop_content(e.device)  # refcount 1 again: no longer cached
                    self.host.release_held(e.host)
        for seq in seqs:
            for i, e in enumerate(seq.swap):
                if e is None or e.device is not None:
                    continue
                (d,) = pool.allocate(1)
                self.attach(seq)
                seq.block_ids[i] = d
                pool.set_fill(d, min(pool.block_size, seq.num_tokens - i * pool.block_size))
                seq.reloads.append(Reload(BlockCopy(e.host, d, seq.seq_id, src_medium=HOST, dst_medium=DEVICE)))
            # fill and tokens_stored: kept blocks came back through touch(); reloaded ones above
            seq.swap = None
        self.swap_ins += len(seqs)
        self.swapped -= len(seqs)


__all__ = ["SwapEntry", "TierSwap"]
