"""Block references of dropped leases, returned to the pool a chunk at a time.

A released or expired lease's sequences leave the sequence table at once (no call can name them
from then on), but their blocks' references go back to the pool in chunks, so dropping a big lease
is bounded work per turn of the event loop. The order is the one a whole free would take
(sequences in the order pushed, each table last block first), so the free queue, and the block
ids handed out later, are the same as with one synchronous free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from memory_service.block_pool import BlockPool

#: Block references returned at a time (~1-2 us each, so < ~20 ms): the first chunk when a lease is
#: dropped, the rest from :meth:`ReleaseQueue.drain` over the next loop turns.
RELEASE_CHUNK_BLOCKS = 8192


class ReleaseQueue:
    """References of ``pool``'s blocks held by dropped sequences, not yet decref'd."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        #: Block tables not yet returned, oldest first.
        self._tables: deque[list[int]] = deque()
        #: Block references in them.
        self.refs = 0

    def push(self, table: list[int]) -> None:
        """Queue a dropped sequence's block table (taken over, emptied as it drains)."""
        if table:
            self._tables.append(table)
            self.refs += len(table)

    def drain(self, max_blocks: int | None = None) -> int:
        """Return up to ``max_blocks`` (None: all) references to the pool; returns those still pending."""
        budget = self.refs if max_blocks is None else max_blocks
        while self._tables and budget > 0:
            table = self._tables[0]
            take = min(len(table), budget)
            self.pool.decref(table[len(table) - take:])  # a table's tail first, as decref(table) would
            del table[len(table) - take:]
            if not table:
                self._tables.popleft()
            budget -= take
            self.refs -= take
        return self.refs

    def blocks(self) -> Iterator[int]:
        """Every block reference still pending (a block once per reference)."""
        return (b for table in self._tables for b in table)

    def check(self) -> None:
        """Assert the count matches the queued tables."""
        assert self.refs == sum(len(t) for t in self._tables), "releasing count drifted"


__all__ = ["RELEASE_CHUNK_BLOCKS", "ReleaseQueue"]
