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
- Swap (PagedAttention section 4.5; :mod:`memory_service.tiers.swap`, mixed in): a swapped-out
  sequence's own blocks get host blocks reserved at once and stay on the device until handed
  out; swap-in takes back what is still there and reloads the rest.

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

from memory_service.block_pool import BlockPool
from memory_service.manager.requests import DEVICE, HOST, REMOTE, BlockCopy, RemotePrefix
from memory_service.manager.sequence import Reload, Sequence, SwapEntry
from memory_service.prefix_cache import PrefixCache
from memory_service.tiers.disk_traffic import TierDisk
from memory_service.tiers.host_tier import HELD, PENDING, HostTier
from memory_service.tiers.swap import TierSwap
from pagedkv.runtime.block_hash import CacheKey, block_hash, leading_hits


class Tiers(TierSwap, TierDisk):
    """The host tier's traffic with one device pool (``host`` None: no host tier; swaps refused), and
    the disk tier's behind it (:meth:`attach_disk`, :mod:`memory_service.tiers.disk_traffic`).

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
        """``c`` as signed now (pagedkv.runtime.grants.copy_tuple order), with each side's current epoch (a
        remote src: its epoch on its node, as the ticket named it)."""
        src_epochs = self.host.epochs if c.src_medium == HOST else self.pool.epochs
        src_ep = c.src_epoch if c.src_medium == REMOTE else src_epochs[c.src]
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
        if (
            proven
            and self.cache.enabled
            and r.block_hash not in self.cache.cached
            and self.cache.hash_of[d] is None
            and self.pool.ref_counts[d] > 0
        ):
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
                f"swapped block {b}: refcount {self.pool.ref_counts[b]}, content {self.pool.has_content[b]}"
            )
        if self.host is None:
            return
        self.host.check()
        if self.disk is not None:
            self.disk.check()
            pins.update(self.disk_pins())
            offload_dst.update(self.disk_read_targets())
            work = {w.work_id for w in [*self.disk_queue, *self.disk_taken.values()]}
            assert {w.work_id for w in self.disk_reading.values()} <= work, "a read in disk_reading is not queued"
        for h, s in enumerate(self.host.state):
            if s == PENDING:
                assert offload_dst[h] == 1, f"pending host block {h} is the destination of {offload_dst[h]} offloads"
            assert self.host.pins[h] == pins[h], f"host block {h}: {self.host.pins[h]} pins, {pins[h]} reloads/writes"
        assert all(self.host.state[h] == HELD for h in self.swap_targets)


__all__ = ["DEVICE", "HOST", "REMOTE", "Reload", "SwapEntry", "Tiers"]
