"""Moving KV between the device pool and the host tier: offload on eviction, reload on a host hit,
swap out and in, and the copies these hand to workers.

DESIGN.md, "Tiers" and "Tiers and transfers". The memory service decides placement; workers do
every copy, as data in a sequence's grant, before the step's writes (offloads, then reloads,
then copy-on-write). Nothing here touches KV bytes.

- Offload (write-back on eviction, as SGLang's HiCache and vLLM's CPU offloading): when an
  allocation hands out a device block that still holds content -- a prefix-cache block, or a
  swapped-out sequence's block -- the content is copied to a host block in the step of the
  sequence that now owns the device block, before that sequence writes it. The copy goes in that
  sequence's next grant only; the sequence's next receipt proves it (listed) or drops it (not
  listed: the step ran on an older grant), and a sequence freed first drops it.
- Reload: a prefix lookup that continues past the device's hits into the host tier's cached
  blocks gets fresh device blocks and host->device copies; those tokens count as cached. The copies
  go in every grant of the sequence until a receipt proves them (a reload into a block the
  sequence never writes can be repeated); only then does the device block enter the prefix cache,
  and its host block can be evicted again.
- Swap (PagedAttention section 4.5): a swapped-out sequence's own blocks (refcount 1) get host
  blocks reserved at once, all or nothing; its device blocks go back to the pool keeping their KV,
  last in line to be handed out, and are offloaded only when handed out. Swap-in takes back the
  blocks still on the device with no copy and reloads the rest, so a swap costs copies only for
  the memory that was actually needed meanwhile. Shared blocks stay on the device, referenced.

NOTE: invariants (checked by :meth:`Tiers.check`, with :meth:`HostTier.check`):
  * ``held[b] == (seq, i)``  <=>  ``seq.swap[i].device == b``; such a block has refcount 0 and a
    content mark, and no prefix-cache hash;
  * a pending host block is the destination of exactly one sequence's unproven offload; a pin on
    a cached host block is one unproven reload.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from memory_service.block_pool import BlockPool
from memory_service.host_tier import HELD, PENDING, HostTier
from memory_service.prefix_cache import PrefixCache
from memory_service.requests import BlockCopy, RemotePrefix
from memory_service.sequence import Sequence
from pagedkv.block_hash import CacheKey, block_hash, leading_hits
from pagedkv.errors import HOST_TIER_OFF, SWAP_LOST, FailedPreconditionError, OutOfHostBlocksError

#: Media (``pagedkv.grant.v1.Medium``): the pool, the host tier, another node's pool.
DEVICE, HOST, REMOTE = 0, 1, 2


@dataclass(slots=True)
class Reload:
    """An unproven host->device copy of one sequence."""

    #: The copy (src on the host, dst the sequence's device block).
    copy: BlockCopy
    #: Prefix-cache content it brings back (hash, tokens, parent), or None for a swapped block.
    block_hash: bytes | None = None
    tokens: tuple[int, ...] = ()
    parent: bytes = b""


@dataclass(slots=True)
class SwapEntry:
    """One own block of a swapped-out sequence."""

    #: The host block held for it.
    host: int
    #: The device block still holding its KV (refcount 0, evictable); None once handed out.
    device: int | None
    #: The host block holds its KV (the offload's receipt came).
    proven: bool = False


class Tiers:
    """The host tier's traffic with one device pool (``host`` None: no host tier; swaps refused).

    Args:
        pool: the device pool.
        cache: its prefix cache.
        host: the host tier, or None.
    """

    def __init__(self, pool: BlockPool, cache: PrefixCache, host: HostTier | None):
        self.pool, self.cache, self.host = pool, cache, host
        #: Offloads caused by the allocation in progress, for the sequence it is for (:meth:`attach`).
        self.fresh: list[BlockCopy] = []
        #: Device block -> (swapped-out sequence, table index) of swapped blocks still on the device.
        self.held: dict[int, tuple[Sequence, int]] = {}
        #: Host block -> (swapped sequence, table index) awaiting an offload's proof; None once that
        #: sequence is gone (the block is released when the offload settles).
        self.swap_targets: dict[int, tuple[Sequence, int] | None] = {}
        #: Node transfers in (blocks read from another node's pool): granted, proven by a receipt,
        #: dropped unproven (the sequence freed first).
        self.transfers_started = self.transfers_proven = self.transfers_dropped = 0
        #: Sequences swapped out, swapped in; swapped out now.
        self.swap_outs = 0
        self.swap_ins = 0
        self.swapped = 0
        pool.on_evict = self._evicted
        if host is not None:
            cache.on_evicted = self._offload_cached
            host.on_stored = lambda h, k, parent, toks: cache.emit(
                "stored", block_id=h, block_hash=k, parent_hash=parent, token_ids=toks, medium=HOST)
            host.on_removed = lambda h, k: cache.emit("removed", block_id=h, block_hash=k, medium=HOST)

    # ----------------------------------------------------------------- offload
    def _evicted(self, b: int) -> None:
        """The pool hands out block ``b`` that held content: offload it (a swapped block always; a
        cached one when the host tier has room and lacks it)."""
        owner = self.held.pop(b, None)
        if owner is None:
            self.cache.evicted(b)  # -> _offload_cached when there is a host tier
            return
        seq, i = owner
        entry = seq.swap[i]
        entry.device = None
        self.swap_targets[entry.host] = owner
        self.fresh.append(BlockCopy(b, entry.host, src_medium=DEVICE, dst_medium=HOST))

    def _offload_cached(self, b: int, k: bytes, tokens: tuple[int, ...], parent: bytes) -> None:
        h = self.host.reserve_offload(k, tokens, parent)
        if h is not None:
            self.fresh.append(BlockCopy(b, h, src_medium=DEVICE, dst_medium=HOST))

    def attach(self, seq: Sequence) -> None:
        """The offloads of the allocation just made go to ``seq``, the new owner of the blocks."""
        if self.fresh:
            seq.fresh_offloads += [dataclasses.replace(c, seq_id=seq.seq_id) for c in self.fresh]
            self.fresh = []

    # ------------------------------------------------------------------ reload
    def host_hits(self, token_ids, key: CacheKey, parent: bytes | None, start: int) -> list[tuple[bytes, int]]:
        """The host tier's cached blocks continuing a prefix lookup: ``(hash, host block)`` for the
        full blocks of ``token_ids`` from block index ``start`` (``parent``: the hash before it),
        never the block holding the last token (read-only)."""
        if self.host is None or not token_ids:
            return []
        return leading_hits(token_ids, self.pool.block_size, key, self.host.lookup, parent, start)

    def remote_hits(self, token_ids, key: CacheKey, parent: bytes | None, start: int,
                    remote: RemotePrefix) -> list[tuple[bytes, int, int]]:
        """Another node's pinned blocks continuing a prefix lookup: ``(hash, remote block, its epoch)``
        for the full blocks of ``token_ids`` from block index ``start`` (``parent``: the hash before
        it) whose own hash the ticket names at the same index; stops at the first that differs, never
        the block holding the last token (read-only)."""
        out = []
        bs = self.pool.block_size
        for i in range(start, min(len(remote.block_ids), (len(token_ids) - 1) // bs)):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs], key)
            if parent != remote.block_hashes[i]:
                break
            out.append((parent, remote.block_ids[i], remote.block_epochs[i]))
        return out

    def start_transfers(self, seq: Sequence, first: int, hits: list[tuple[bytes, int, int]], parent: bytes,
                        source: bytes) -> None:
        """Read ``hits`` (another node's pinned blocks, :meth:`remote_hits`) into ``seq``'s blocks from
        table index ``first``: node transfers in its grants until a receipt proves them, then the
        blocks enter the prefix cache as a reload's do."""
        bs = self.pool.block_size
        for j, (k, b, ep) in enumerate(hits):
            i = first + j
            copy = BlockCopy(b, seq.block_ids[i], seq.seq_id, src_medium=REMOTE, dst_medium=DEVICE, src_epoch=ep,
                             source=source)
            seq.reloads.append(Reload(copy, k, tuple(seq.token_ids[i * bs:(i + 1) * bs]), parent))
            parent = k
        self.transfers_started += len(hits)
        seq.num_transferred_tokens = len(hits) * bs

    def start_reloads(self, seq: Sequence, first: int, hits: list[tuple[bytes, int]], parent: bytes) -> None:
        """Reload ``hits`` (pinned by the caller) into ``seq``'s blocks from table index ``first``."""
        bs = self.pool.block_size
        for j, (k, h) in enumerate(hits):
            i = first + j
            copy = BlockCopy(h, seq.block_ids[i], seq.seq_id, src_medium=HOST, dst_medium=DEVICE)
            seq.reloads.append(Reload(copy, k, tuple(seq.token_ids[i * bs:(i + 1) * bs]), parent))
            parent = k
        self.host.hits += len(hits) * bs
        seq.num_reloaded_tokens = len(hits) * bs

    # ------------------------------------------------------------------ grants
    def grant_copies(self, seq: Sequence) -> list[BlockCopy]:
        """The tier copies for ``seq``'s grant now: the offloads of this call (granted once) and
        every unproven reload."""
        fresh = seq.fresh_offloads
        if fresh:
            seq.offloads += fresh
            seq.fresh_offloads = []
        return [*fresh, *(r.copy for r in seq.reloads)] if seq.reloads else fresh

    def copy_key(self, c: BlockCopy) -> tuple[int, int, int, int, int, int, bytes]:
        """``c`` as signed now (pagedkv.grants.copy_tuple order), with each side's current epoch (a
        remote src: its epoch on its node, as the ticket named it)."""
        src_ep = c.src_epoch if c.src_medium == REMOTE else (self.host.epochs if c.src_medium == HOST else self.pool.epochs)[c.src]
        dst_ep = (self.host.epochs if c.dst_medium == HOST else self.pool.epochs)[c.dst]
        return c.src, int(src_ep), c.dst, int(dst_ep), c.src_medium, c.dst_medium, c.source

    def settle(self, seq: Sequence, done: Iterable[tuple]) -> bool:
        """Take a receipt of ``seq`` listing the tier copies ``done``: offloads it lists are proven,
        the others dropped; reloads it lists are proven, the others stay. Returns False when a
        reload stays unproven (the step computed over blocks it did not reload: the caller ends
        prefix caching for the sequence)."""
        if not (seq.offloads or seq.reloads):
            return True
        done = set(done)
        for c in seq.offloads:
            self._offload_settled(c, self.copy_key(c) in done)
        seq.offloads = []
        left = []
        for r in seq.reloads:
            if self.copy_key(r.copy) in done:
                self._reload_settled(r, proven=True)
            else:
                left.append(r)
        seq.reloads = left
        return not left

    def _offload_settled(self, c: BlockCopy, proven: bool) -> None:
        h = c.dst
        if h in self.swap_targets:
            owner = self.swap_targets.pop(h)
            if owner is None:  # its swapped sequence is gone
                self.host.release_held(h)
            elif proven:
                seq, i = owner
                seq.swap[i].proven = True
                self.host.offloads += 1
            else:
                self.host.offloads_dropped += 1  # the swapped block is lost: its swap-in fails
        elif proven:
            self.host.offload_proven(h)
        else:
            self.host.offload_dropped(h)

    def _reload_settled(self, r: Reload, proven: bool) -> None:
        h, d = r.copy.src, r.copy.dst
        if r.copy.src_medium == REMOTE:  # nothing held here for it: the exporting node pins its block
            self.transfers_proven += proven
            self.transfers_dropped += not proven
        elif r.block_hash is None:  # a swapped block back on the device: its host block is done
            self.host.release_held(h)
            self.host.reloads += proven
            return
        else:
            self.host.unpin(h, reloaded=proven)
        if proven and self.cache.enabled and r.block_hash not in self.cache.cached and self.cache.hash_of[d] is None \
                and self.pool.ref_counts[d] > 0:
            self.cache.register(d, r.block_hash, r.tokens, r.parent)

    def forget(self, seq: Sequence) -> None:
        """``seq`` is being freed: its unproven copies are dropped, its held blocks let go."""
        for c in [*seq.fresh_offloads, *seq.offloads]:
            self._offload_settled(c, proven=False)
        seq.fresh_offloads, seq.offloads = [], []
        for r in seq.reloads:
            self._reload_settled(r, proven=False)
        seq.reloads = []
        if seq.swap is not None:
            for e in seq.swap:
                if e is None:
                    continue
                if e.device is not None:
                    del self.held[e.device]
                    self.pool.drop_content(e.device)
                if e.host in self.swap_targets:
                    self.swap_targets[e.host] = None  # released when its offload settles
                else:
                    self.host.release_held(e.host)
            seq.swap = None
            self.swapped -= 1

    # -------------------------------------------------------------------- swap
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
                    why = "its offload is not proven yet" if e.host in self.swap_targets else "its offload never happened"
                    raise FailedPreconditionError(
                        f"SwapInSequences: block {i} of sequence {seq.seq_id} left the device and {why}; free the "
                        "sequence and recompute it (nothing was swapped in)", reason=SWAP_LOST)
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

    def referenced(self, seq: Sequence) -> list[int]:
        """The device blocks ``seq`` holds a reference to (a swapped sequence: only its shared ones)."""
        if seq.swap is None:
            return seq.block_ids
        return [b for b, e in zip(seq.block_ids, seq.swap) if e is None]

    # ------------------------------------------------------------------- check
    def check(self, seqs: Iterable[Sequence]) -> None:
        """Assert the module's invariants over the live sequences ``seqs`` (O(blocks + entries))."""
        assert not self.fresh, f"offloads {self.fresh} attached to no sequence"
        held = {}
        pins: Counter[int] = Counter()
        offload_dst: Counter[int] = Counter()
        for seq in seqs:
            for c in [*seq.fresh_offloads, *seq.offloads]:
                offload_dst[c.dst] += 1
            for r in seq.reloads:
                if r.block_hash is not None and r.copy.src_medium == HOST:
                    pins[r.copy.src] += 1
            for i, e in enumerate(seq.swap or ()):
                if e is not None and e.device is not None:
                    held[e.device] = (seq.seq_id, i)
        assert {b: (s.seq_id, i) for b, (s, i) in self.held.items()} == held, "held blocks disagree with swap entries"
        for b in self.held:
            assert self.pool.ref_counts[b] == 0 and self.pool.has_content[b] and self.cache.hash_of[b] is None, (
                f"swapped block {b}: refcount {self.pool.ref_counts[b]}, content {self.pool.has_content[b]}")
        if self.host is None:
            return
        self.host.check()
        for h, s in enumerate(self.host.state):
            if s == PENDING:
                assert offload_dst[h] == 1, f"pending host block {h} is the destination of {offload_dst[h]} offloads"
            assert self.host.pins[h] == pins[h], f"host block {h}: {self.host.pins[h]} pins, {pins[h]} reloads"
        assert all(self.host.state[h] == HELD for h in self.swap_targets)


__all__ = ["DEVICE", "HOST", "REMOTE", "Reload", "SwapEntry", "Tiers"]
