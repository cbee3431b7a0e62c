"""The block pool: per-block refcounts and an O(1) free-block queue.

Follows vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue``
(vllm/v1/core/block_pool.py, kv_cache_utils.py): every block with refcount 0
sits in one intrusive doubly linked queue. Allocation pops from the head. A
freed block that keeps content for the prefix cache ("cached") goes to the
tail, a sequence's blocks in reverse order, so the head is the least recently
used leaf and eviction is LRU, leaves before parents; a freed block without
content goes to the head, to be reused before any cached block is evicted.

Retention priority (PinPrefix, :mod:`memory_service.manager.pins`; TensorRT-LLM's retention
priorities, SGLang's priority eviction): a cached block whose content an operator asked to keep
carries a priority > 0 and waits in the LRU queue of its priority instead
(:attr:`BlockPool.retained`), so eviction takes the free queue first, then the lowest priority
first, LRU within one. The priority belongs to the content: it goes when the block is evicted
or its content dropped.

The pool knows nothing of hashes: the prefix cache marks a block as keeping
content (:meth:`BlockPool.keep_content`), drops the mark on reset
(:meth:`BlockPool.drop_content`), and hears through ``on_evict`` when a cached
block is popped for reuse.

NOTE: invariants (checked by :meth:`BlockPool.check`):
  * a block is in the free queue  <=>  its refcount is 0;
  * ``num_free + num_cached + num_used == num_blocks``;
  * a refcount-0 block is cached  <=>  ``has_content[b]``;
  * ``fill[b] == 0`` for every refcount-0 block without content;
  * ``tokens_stored == sum(fill[b] for used b)``;
  * ``shared_refs == sum(ref_counts[b] for b with refcount > 1)``;
  * a refcount-0 block is in ``retained[p]``  <=>  it is cached with ``retention[b] == p > 0``;
    every other refcount-0 block is in the free queue; ``retention[b] == 0`` without content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np


class FreeBlockQueue:
    """Intrusive doubly linked list of block ids with O(1) popleft/append/remove.

    ``prev``/``next`` are plain int lists indexed by block id; ``num_blocks`` is
    the sentinel (head and tail live there), so no ``None`` or ``-1`` leaks out.
    Initially holds every block in id order, so a fresh pool allocates 0, 1, 2, ...
    """

    def __init__(self, num_blocks: int):
        n = num_blocks
        self._sentinel = n
        #: next[b]: block after b; next[n] is the head.
        self._next = [*range(1, n + 1), 0 if n else n]
        #: prev[b]: block before b; prev[n] is the tail.
        self._prev = [n, *range(0, n - 1), n - 1 if n else n][: n + 1]
        self._in_queue = [True] * n
        self.size = n

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block_id: int) -> bool:
        return self._in_queue[block_id]

    def popleft(self) -> int:
        """Remove and return the head block id. Caller checks ``len`` first."""
        assert self.size > 0, "popleft from an empty free-block queue"
        block_id = self._next[self._sentinel]
        self.remove(block_id)
        return block_id

    def append(self, block_id: int) -> None:
        """Put ``block_id`` at the tail (the last to be reused)."""
        self._insert_after(self._prev[self._sentinel], block_id)

    def appendleft(self, block_id: int) -> None:
        """Put ``block_id`` at the head (the next to be reused)."""
        self._insert_after(self._sentinel, block_id)

    def _insert_after(self, prev: int, block_id: int) -> None:
        assert not self._in_queue[block_id], f"block {block_id} is already in the free queue"
        nxt = self._next[prev]
        self._next[prev] = block_id
        self._prev[block_id] = prev
        self._next[block_id] = nxt
        self._prev[nxt] = block_id
        self._in_queue[block_id] = True
        self.size += 1

    def remove(self, block_id: int) -> None:
        """Unlink ``block_id`` from anywhere in the queue (a prefix-cache hit)."""
        assert self._in_queue[block_id], f"block {block_id} is not in the free queue"
        p, n = self._prev[block_id], self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._in_queue[block_id] = False
        self.size -= 1

    def __iter__(self):
        b = self._next[self._sentinel]
        while b != self._sentinel:
            yield b
            b = self._next[b]


class BlockPool:
    """Refcounts, fill levels and the free queue of ``num_blocks`` blocks of ``block_size`` tokens.

    The pool never decides *whether* an allocation fits: callers (the block
    manager) check :attr:`num_available` first so that a request is all or nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, epochs: np.ndarray | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if epochs is not None and (epochs.dtype != np.int64 or epochs.shape != (num_blocks,)):
            raise ValueError(f"epochs must be int64 [{num_blocks}], got {epochs.dtype} {epochs.shape}")
        #: epochs[b]: bumped each time block b is handed out anew (allocated from the free
        #: queue, its old content evicted) and each time a receipt proves positions in it (the
        #: block manager). Grants and receipts name blocks with their epoch, so a grant for a block
        #: that was freed and handed to someone else, or that a later receipt proved, no longer
        #: matches. With a shared array (the pool's epoch table) workers see the same values.
        self.epochs = epochs if epochs is not None else np.zeros(num_blocks, dtype=np.int64)
        #: Blocks in the pool.
        self.num_blocks = num_blocks
        #: Tokens per block.
        self.block_size = block_size
        #: ref_counts[b]: block-table entries (plus pins) referencing block b.
        self.ref_counts = [0] * num_blocks
        #: fill[b]: token slots of block b holding written KV (0..block_size).
        self.fill = [0] * num_blocks
        #: Blocks with refcount 0 (free and cached), LRU order, head first.
        self.free_queue = FreeBlockQueue(num_blocks)
        #: Refcount-0 blocks that keep prefix-cache content (evictable).
        self.num_cached = 0
        #: Sum of ``fill`` over used blocks.
        self.tokens_stored = 0
        #: Sum of refcounts over blocks with refcount > 1 (table entries pointing at a shared block).
        self.shared_refs = 0
        #: has_content[b]: block b keeps its KV for the prefix cache (cached once its refcount is 0).
        self.has_content = [False] * num_blocks
        #: Called as ``on_evict(block_id)`` when a cached block is popped for reuse.
        self.on_evict: Callable[[int], None] | None = None
        #: retention[b]: the retention priority of block b's content (0: none, evicted in LRU order).
        self.retention = [0] * num_blocks
        #: Refcount-0 cached blocks with a retention priority: priority -> block ids, LRU first.
        self.retained: dict[int, OrderedDict[int, None]] = {}
        #: Blocks in :attr:`retained`.
        self.num_retained = 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take now: free + cached (evictable)."""
        return len(self.free_queue) + self.num_retained

    @property
    def num_used(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - self.num_available

    def set_retention(self, block_ids: Iterable[int], priority: int) -> None:
        """Raise the retention priority of used blocks' content to ``priority`` (a block keeps the
        highest it was given). Callers validate ``priority`` (>= 0)."""
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"retention of block {b} with refcount 0"
            self.retention[b] = max(self.retention[b], priority)

    def _pop_evictable(self) -> int:
        """The next block to hand out: the free queue's head, else the LRU block of the lowest priority."""
        if len(self.free_queue):
            return self.free_queue.popleft()
        level = min(self.retained)
        queue = self.retained[level]
        b, _ = queue.popitem(last=False)
        if not queue:
            del self.retained[level]
        self.num_retained -= 1
        return b

    def _unqueue(self, block_id: int) -> None:
        """Take a refcount-0 block out of the free queue or its retention queue."""
        level = self.retention[block_id]
        if level and self.has_content[block_id]:
            queue = self.retained[level]
            del queue[block_id]
            if not queue:
                del self.retained[level]
            self.num_retained -= 1
        else:
            self.free_queue.remove(block_id)

    @property
    def num_free(self) -> int:
        """Blocks with no content."""
        return self.num_available - self.num_cached

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, refcount 1 each."""
        assert n <= self.num_available, f"allocate({n}) with {self.num_available} available"
        out = []
        for _ in range(n):
            b = self._pop_evictable()
            assert self.ref_counts[b] == 0, f"block {b} popped while in use"
            if self.has_content[b]:  # evict: its content goes
                self.has_content[b] = False
                self.retention[b] = 0
                self.fill[b] = 0
                self.num_cached -= 1
                if self.on_evict is not None:
                    self.on_evict(b)
            assert self.fill[b] == 0, f"block {b} popped with {self.fill[b]} stale slots"
            self.ref_counts[b] = 1
            self.epochs[b] += 1
            out.append(b)
        return out

    def keep_content(self, block_id: int, *, partial: bool = False) -> None:
        """Mark a used block as keeping its KV once freed: a full block for the prefix cache, or
        (``partial``) any block of a swapped-out sequence; cached (evictable) once its refcount is 0."""
        assert self.ref_counts[block_id] > 0 and (partial or self.fill[block_id] == self.block_size), (
            f"only a used, full block can be cached (block {block_id})")
        self.has_content[block_id] = True

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to prefix-cache hits: a refcount-0 cached block leaves the free queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                assert self.has_content[b], f"hit on block {b} without content"
                self._unqueue(b)
                self.num_cached -= 1
                self.ref_counts[b] = 1
                self.tokens_stored += self.fill[b]
            else:
                self.incref([b])

    def drop_content(self, block_id: int) -> bool:
        """Unmark a block's content; a cached (refcount-0) one becomes free. True if it was cached."""
        assert self.has_content[block_id], f"block {block_id} keeps no content"
        if self.ref_counts[block_id]:
            self.has_content[block_id] = False
            self.retention[block_id] = 0
            return False
        self._unqueue(block_id)
        self.has_content[block_id] = False
        self.retention[block_id] = 0
        self.fill[block_id] = 0
        self.free_queue.appendleft(block_id)
        self.num_cached -= 1
        return True

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a fork shares them)."""
        rcs = self.ref_counts
        for b in block_ids:
            rc = rcs[b]
            assert rc > 0, f"incref of free block {b}"
            rcs[b] = rc + 1
            self.shared_refs += 2 if rc == 1 else 1

    def decref(self, block_ids: Sequence[int]) -> int:
        """Drop one reference from each block; blocks reaching 0 go to the queue tail.

        Blocks are released in reverse order (a sequence's last block first), so
        the earlier blocks of a sequence are reused last. Returns the number of
        blocks whose refcount reached 0.
        """
        freed = 0
        for b in reversed(block_ids):
            rc = self.ref_counts[b]
            assert rc > 0, f"decref of block {b} with refcount 0 (double free)"
            self.ref_counts[b] = rc - 1
            if rc > 1:
                self.shared_refs -= 2 if rc == 2 else 1
            elif rc == 1:
                self.tokens_stored -= self.fill[b]
                if not self.has_content[b]:
                    self.fill[b] = 0
                    self.free_queue.appendleft(b)
                elif level := self.retention[b]:  # cached with a retention priority: its own LRU queue
                    self.retained.setdefault(level, OrderedDict())[b] = None
                    self.num_retained += 1
                    self.num_cached += 1
                else:  # keeps its content: cached, evictable, most recently used
                    self.free_queue.append(b)
                    self.num_cached += 1
                freed += 1
        return freed

    def set_fill(self, block_id: int, tokens: int) -> None:
        """Record that block ``block_id`` holds ``tokens`` written slots (never shrinks)."""
        old = self.fill[block_id]
        if tokens > old:
            assert tokens <= self.block_size, f"fill {tokens} > block_size {self.block_size}"
            self.fill[block_id] = tokens
            self.tokens_stored += tokens - old

    def fill_tokens(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Record that token positions [start, end) of a block table (block ids in logical order) are written."""
        bs = self.block_size
        if end - start == 1:  # the decode fast path: one slot of one block
            b, slot = block_ids[start // bs], start % bs
            if self.fill[b] <= slot:
                self.tokens_stored += slot + 1 - self.fill[b]
                self.fill[b] = slot + 1
            return
        for idx in range(start // bs, -(-end // bs)):
            self.set_fill(block_ids[idx], min(bs, end - idx * bs))

    def check(self) -> None:
        """Assert the module's invariants (O(num_blocks); tests call it after every step)."""
        queued = set(self.free_queue)
        assert len(queued) == len(self.free_queue), "free queue has a cycle or duplicate"
        assert self.num_retained == sum(len(q) for q in self.retained.values()), "retained count is off"
        for level, queue in self.retained.items():
            assert level > 0 and queue, f"retention queue {level} is empty or not a priority"
            for b in queue:
                assert b not in queued and self.has_content[b] and self.retention[b] == level, (
                    f"block {b} in retention queue {level}: retention {self.retention[b]}, "
                    f"content {self.has_content[b]}, in free queue {b in queued}")
            queued |= set(queue)
        assert all(self.retention[b] == 0 or self.has_content[b] for b in range(self.num_blocks)), (
            "a block without content has a retention priority")
        for b in range(self.num_blocks):
            assert (b in queued) == (self.ref_counts[b] == 0), (
                f"block {b}: refcount {self.ref_counts[b]} but in_free_queue={b in queued}"
            )
        assert len(queued) == self.num_available, "a block is in two queues"
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks
        assert self.num_cached == sum(1 for b in queued if self.has_content[b])
        assert all(self.fill[b] == 0 for b in queued if not self.has_content[b])
        assert self.tokens_stored == sum(f for b, f in enumerate(self.fill) if self.ref_counts[b] > 0)
        assert self.shared_refs == sum(rc for rc in self.ref_counts if rc > 1)
