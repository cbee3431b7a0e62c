"""The host tier: blocks of host memory behind the pool, holding KV the device let go.

What every system this project is measured against keeps beyond device memory (vLLM's KV
offloading to CPU, SGLang's HiCache, TensorRT-LLM's host cache, NVIDIA Dynamo's KVBM): a
cached block evicted from the device is written back here, keeping its hash, and a later
prefix lookup that continues past the device's hits reloads it instead of recomputing it;
a preempted sequence's own blocks are swapped here (PagedAttention, Kwon et al., SOSP 2023,
section 4.5). This module is bookkeeping only: the memory service never touches KV bytes;
workers do every copy (:mod:`memory_service.tiers.manager` hands them out).

Every host block is in one state:

- ``free``: no content;
- ``pending``: the destination of an offload whose copy no receipt has proven yet (never a hit);
- ``cached``: holds a proven prefix-cache block (hash, tokens, parent hash): a hit; when no
  reload is in flight from it (``pins == 0``) it is evictable, least recently used first;
- ``held``: reserved for one swapped-out sequence's own block (its copy proven or not).

NOTE: invariants (checked by :meth:`HostTier.check`):
  * ``num_free + num_cached + num_used == num_blocks`` (used = pending + held);
  * a block is in ``free_queue``  <=>  its state is free; in ``lru``  <=>  cached and unpinned;
  * ``cached[h] == b``  <=>  ``hash_of[b] == h`` and state cached; ``pending[h] == b``  <=>
    ``hash_of[b] == h`` and state pending;
  * ``pins[b] > 0`` only for cached blocks; a cached block may lose its hash (a reset) only while
    pinned, and is freed when its last pin goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import numpy as np

FREE, PENDING, CACHED, HELD = "free", "pending", "cached", "held"


class HostTier:
    """``num_blocks`` host blocks: a free queue, an LRU of cached content, reservations.

    Args:
        num_blocks: blocks in the tier (>= 1).
        epochs: the host part of the pool's epoch table, int64 [num_blocks] (bumped each time a
            host block is handed out anew, so a grant naming its old use no longer matches).

    Raises:
        ValueError: ``num_blocks`` < 1 or ``epochs`` of another shape or dtype.
    """

    def __init__(self, num_blocks: int, epochs: np.ndarray | None = None):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs >= 1 block, got {num_blocks}")
        if epochs is not None and (epochs.dtype != np.int64 or epochs.shape != (num_blocks,)):
            raise ValueError(f"host epochs must be int64 [{num_blocks}], got {epochs.dtype} {epochs.shape}")
        #: Blocks in the tier.
        self.num_blocks = num_blocks
        #: epochs[h]: bumped each time host block h is handed out anew.
        self.epochs = epochs if epochs is not None else np.zeros(num_blocks, dtype=np.int64)
        #: state[h]: FREE, PENDING, CACHED or HELD.
        self.state = [FREE] * num_blocks
        #: Free blocks, next to hand out first.
        self.free_queue: deque[int] = deque(range(num_blocks))
        #: Cached, unpinned blocks, least recently used first (what an allocation evicts).
        self.lru: OrderedDict[int, None] = OrderedDict()
        #: pins[h]: reloads in flight reading cached block h.
        self.pins = [0] * num_blocks
        #: Content hash, token ids and parent hash of a pending or cached block.
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.parent: list[bytes] = [b""] * num_blocks
        #: Proven content hash -> cached block; offloads awaiting proof: content hash -> pending block.
        self.cached: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        #: Blocks offloaded (copies proven), reloaded (copies proven), offloads that did not happen.
        self.offloads = 0
        self.reloads = 0
        self.offloads_dropped = 0
        #: Prompt tokens found here; cached blocks evicted.
        self.hits = 0
        self.evictions = 0
        #: Called as ``on_stored(h, hash, parent, tokens)`` / ``on_removed(h, hash)`` (KV events).
        self.on_stored: Callable[[int, bytes, bytes, tuple[int, ...]], None] | None = None
        self.on_removed: Callable[[int, bytes], None] | None = None
        #: Called as ``on_cached(h)`` once a block's content is proven here (the disk tier writes it through).
        self.on_cached: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks holding proven prefix-cache content (pinned ones included)."""
        return sum(1 for s in self.state if s == CACHED)

    @property
    def num_used(self) -> int:
        """Pending and held blocks."""
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks a reservation may take now: free + cached unpinned (evictable)."""
        return len(self.free_queue) + len(self.lru)

    # --------------------------------------------------------------- allocation
    def _take(self, n: int) -> list[int] | None:
        """``n`` blocks, free ones first, then evicting LRU cached ones; None (nothing changed) if fewer."""
        if n > self.num_available:
            return None
        out = []
        for _ in range(n):
            if self.free_queue:
                h = self.free_queue.popleft()
            else:
                h, _ = self.lru.popitem(last=False)
                self._forget(h, evicted=True)
            self.epochs[h] += 1
            out.append(h)
        return out

    def _forget(self, h: int, evicted: bool) -> None:
        """Cached block ``h`` leaves the cache (a "removed" event when evicted)."""
        block_hash = self.hash_of[h]
        del self.cached[block_hash]
        self.hash_of[h], self.tokens[h], self.parent[h] = None, None, b""
        if evicted:
            self.evictions += 1
            if self.on_removed is not None:
                self.on_removed(h, block_hash)

    def _release(self, h: int) -> None:
        self.state[h] = FREE
        self.hash_of[h], self.tokens[h], self.parent[h] = None, None, b""
        self.free_queue.append(h)

    # ------------------------------------------------------------------ offload
    def reserve_offload(self, block_hash: bytes, tokens: tuple[int, ...], parent: bytes) -> int | None:
        """A pending block for the content of an evicted device block; None when nothing is to copy:
        the content is here already (cached: made most recent; or pending) or there is no room
        (counted as dropped)."""
        h = self.cached.get(block_hash)
        if h is not None:
            if h in self.lru:
                self.lru.move_to_end(h)
            return None
        if block_hash in self.pending:
            return None
        got = self._take(1)
        if got is None:
            self.offloads_dropped += 1
            return None
        (h,) = got
        self.state[h] = PENDING
        self.hash_of[h], self.tokens[h], self.parent[h] = block_hash, tokens, parent
        self.pending[block_hash] = h
        return h

    def offload_proven(self, h: int, *, from_disk: bool = False) -> None:
        """A receipt proves the copy into pending block ``h`` (an offload from the device, or with
        ``from_disk`` a read from the disk tier): it becomes a cached hit (a "stored" event)."""
        assert self.state[h] == PENDING, f"host block {h} is {self.state[h]}, not pending"
        block_hash = self.hash_of[h]
        del self.pending[block_hash]
        self.state[h] = CACHED
        self.cached[block_hash] = h
        self.lru[h] = None
        self.offloads += not from_disk
        if self.on_stored is not None:
            self.on_stored(h, block_hash, self.parent[h], self.tokens[h])
        if self.on_cached is not None:
            self.on_cached(h)

    def offload_dropped(self, h: int, *, from_disk: bool = False) -> None:
        """The copy into pending block ``h`` will never be proven (its owner's step did not do it, or
        the owner was freed first; with ``from_disk``, a disk read that failed or did not run): the
        block is free again."""
        assert self.state[h] == PENDING, f"host block {h} is {self.state[h]}, not pending"
        del self.pending[self.hash_of[h]]
        self._release(h)
        self.offloads_dropped += not from_disk

    # ------------------------------------------------------------------- reload
    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding ``block_hash`` with exactly these ``tokens`` (re-checked), or None."""
        h = self.cached.get(block_hash)
        return h if h is not None and self.tokens[h] == tokens else None

    def pin(self, blocks: Iterable[int]) -> None:
        """A reload from each cached block starts: it cannot be evicted until :meth:`unpin`."""
        for h in blocks:
            assert self.state[h] == CACHED, f"pin of host block {h} in state {self.state[h]}"
            self.pins[h] += 1
            self.lru.pop(h, None)

    def unpin(self, h: int, *, reloaded: bool) -> None:
        """A reload from ``h`` ended (``reloaded``: its copy was proven). The block becomes the most
        recently used; one whose hash a reset dropped meanwhile is freed."""
        assert self.pins[h] > 0, f"unpin of host block {h} with no pin"
        self.pins[h] -= 1
        self.reloads += reloaded
        if self.pins[h] == 0:
            if self.hash_of[h] is None:
                self._release(h)
            else:
                self.lru[h] = None

    # --------------------------------------------------------------------- swap
    def reserve_held(self, n: int) -> list[int] | None:
        """``n`` blocks held for a swapped-out sequence; None (nothing changed) when fewer can be taken."""
        got = self._take(n)
        for h in got or ():
            self.state[h] = HELD
        return got

    def release_held(self, h: int) -> None:
        """A held block is no longer needed (its sequence was swapped in or freed)."""
        assert self.state[h] == HELD, f"host block {h} is {self.state[h]}, not held"
        self._release(h)

    # -------------------------------------------------------------------- reset
    def clear_cached(self) -> int:
        """Forget every cached content hash (a prefix-cache reset); returns the blocks freed now
        (pinned ones are freed when their reload ends)."""
        cleared = 0
        for h in list(self.cached.values()):
            self._forget(h, evicted=False)
            if self.pins[h] == 0:
                del self.lru[h]
                self._release(h)
                cleared += 1
        return cleared

    def check(self) -> None:
        """Assert the module's invariants (O(num_blocks))."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "host free queue holds a block twice"
        for h, s in enumerate(self.state):
            assert (h in free) == (s == FREE), f"host block {h}: state {s}, in free queue {h in free}"
            assert (h in self.lru) == (s == CACHED and self.pins[h] == 0), f"host block {h}: lru vs state {s}"
            assert self.pins[h] == 0 or s == CACHED, f"host block {h}: pinned in state {s}"
            if s == CACHED and self.hash_of[h] is None:
                assert self.pins[h] > 0, f"host block {h}: cached without a hash and unpinned"
            if s in (FREE, HELD):
                assert self.hash_of[h] is None, f"host block {h}: {s} with a hash"
        assert all(self.state[h] == CACHED and self.hash_of[h] == k for k, h in self.cached.items())
        assert all(self.state[h] == PENDING and self.hash_of[h] == k for k, h in self.pending.items())
        assert sum(s == PENDING for s in self.state) == len(self.pending)
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks


__all__ = ["CACHED", "FREE", "HELD", "PENDING", "HostTier"]
