"""Automatic prefix caching: which pool blocks hold which content, for reuse by later sequences.

Follows vLLM v1's automatic prefix caching (vllm/v1/core/kv_cache_manager.py,
block_pool.py): once the client reports a full block's KV computed, the block
is registered under its chain hash (:mod:`pagedkv.runtime.block_hash`); a later
sequence whose leading full blocks have the same hashes, and the same token ids
(re-checked), shares those blocks instead of allocating and computing them.
The pool keeps a freed cached block at the tail of its free queue and, when it
reuses the block, calls back here (``BlockPool.on_evict``): the block loses its
hash. Every change is logged as a :class:`KvEvent` ("stored", "removed",
"cleared"), numbered from 1 without gaps, for routers that follow the cache
(StreamKvEvents); the log keeps the last ``max_events``. A subscriber's
:class:`KvEventCursor` returns every event in order, or raises
FAILED_PRECONDITION naming the first number it lost (it fell more than
``max_events`` behind, or asked for one no longer kept): never a silent gap.
Each of ``listeners`` is called with each event as it is logged, so followers
wake at once instead of polling: the gRPC streams' notifier
(:mod:`memory_service.event_stream`) and the ZMQ publisher of vLLM's wire format
(:mod:`memory_service.kv_events.publisher`), two readers of the one log.

NOTE: invariants (checked by :meth:`PrefixCache.check`):
  * ``cached[h] == b``  <=>  ``block_hash[b] == h``;
  * ``block_hash[b] is not None``  <=>  ``block_tokens[b] is not None``  <=>  ``pool.has_content[b]``
    and b is not held for a swapped-out sequence;
  * retained events are numbered consecutively, the newest one less than the next to be emitted.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Container, Generator, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from memory_service.block_pool import BlockPool
from memory_service.manager.sequence import Sequence
from pagedkv.runtime.block_hash import CacheKey, chain_hashes, leading_hits
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError, OutOfRangeError
from pagedkv.runtime.logs import get_logger

log = get_logger("block_manager")


@dataclass(frozen=True, slots=True)
class KvEvent:
    """A prefix-cache change (for routers following the cache)."""

    #: Position in the stream, from 1, no gaps.
    sequence_number: int
    #: "stored", "removed" or "cleared".
    kind: str
    #: The block stored or removed (0 for "cleared").
    block_id: int = 0
    #: Its content hash (empty for "cleared").
    block_hash: bytes = b""
    #: Hash of the previous block of its chain ("stored"; empty for a first block).
    parent_hash: bytes = b""
    #: The block's token ids ("stored").
    token_ids: tuple[int, ...] = ()
    #: Where the block is: 0 the device pool, 1 the host tier, 3 the disk tier (``pagedkv.grant.v1.Medium``).
    medium: int = 0


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The leading cached blocks of a token list (:meth:`PrefixCache.lookup`)."""

    #: Cached block ids, in logical order.
    block_ids: list[int]
    #: Their chain hashes, one per block.
    block_hashes: list[bytes]


class PrefixCache:
    """Content hashes of the blocks of one :class:`BlockPool`, the lookup over them, and the KV event log.

    Args:
        pool: the pool whose blocks are cached; this cache registers itself as its ``on_evict``
            (:mod:`memory_service.tiers.manager` puts itself in between when swapped blocks may be evicted).
        enabled: False turns caching off (lookups miss, commits register nothing).
        max_events: KV events retained for replay.
    """

    def __init__(self, pool: BlockPool, *, enabled: bool = True, max_events: int = 10_000):
        #: The pool whose blocks are cached.
        self.pool = pool
        #: Automatic prefix caching is on.
        self.enabled = enabled
        #: hash_of[b]: content hash of block b when it is in the prefix cache.
        self.hash_of: list[bytes | None] = [None] * pool.num_blocks
        #: block_tokens[b]: token ids of a cached block (a hit re-checks them).
        self.block_tokens: list[tuple[int, ...] | None] = [None] * pool.num_blocks
        #: parent_of[b]: the chain hash before block b's (b"" for a first block) when cached.
        self.parent_of: list[bytes] = [b""] * pool.num_blocks
        #: Content hash -> the block holding it.
        self.cached: dict[bytes, int] = {}
        #: Prompt tokens looked up.
        self.queries = 0
        #: Prompt tokens found cached.
        self.hits = 0
        #: Cached blocks evicted to make room.
        self.evictions = 0
        #: Retained KV events, oldest first.
        self.events: deque[KvEvent] = deque(maxlen=max_events)
        self._next_event = 1
        #: Called with each event, in order, right after it is logged (on the event loop: each must
        #: return at once); the gRPC streams' notifier and the ZMQ publisher add themselves here.
        self.listeners: list[Callable[[KvEvent], None]] = []
        #: Called as ``on_evicted(block_id, hash, tokens, parent)`` after a cached block is evicted
        #: (the host tier offloads it).
        self.on_evicted: Callable[[int, bytes, tuple[int, ...], bytes], None] | None = None
        pool.on_evict = self.evicted

    def lookup(self, token_ids: Seq[int] | None, key: CacheKey) -> CachedPrefix:
        """The leading full blocks of ``token_ids`` that are cached (read-only).

        Never the block holding the last token, so the worker always has a
        query to compute. A hit needs the same chain hash and the same token ids.

        Raises:
            InvalidArgumentError: a token id outside int32 (only checked when caching is on).
        """
        if not (self.enabled and token_ids):
            return CachedPrefix([], [])
        if any(not -(2**31) <= t < 2**31 for t in token_ids):
            raise InvalidArgumentError("AllocateSequences: token ids must fit in int32")
        hits = leading_hits(token_ids, self.pool.block_size, key, self._find)
        return CachedPrefix([b for _, b in hits], [h for h, _ in hits])

    def _find(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding ``block_hash`` with exactly these ``tokens`` (re-checked), or None."""
        b = self.cached.get(block_hash)
        return b if b is not None and self.block_tokens[b] == tokens else None

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count a granted lookup of ``num_tokens`` prompt tokens that hit ``num_hit_blocks`` blocks."""
        if self.enabled:
            self.queries += num_tokens
            self.hits += num_hit_blocks * self.pool.block_size

    def commit(self, seq: Sequence, num_computed: int) -> int:
        """Register the full blocks among the first ``num_computed`` tokens of ``seq`` (KV written).

        Extends ``seq.block_hashes`` along the chain; a block whose content is
        cached already (in another block) is skipped. Returns blocks newly
        cached, each logged as a "stored" event.
        """
        if not self.enabled or seq.token_ids is None:
            return 0
        bs = self.pool.block_size
        full = min(num_computed, len(seq.token_ids)) // bs
        start = len(seq.block_hashes)
        if full <= start:
            return 0
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        new = chain_hashes(seq.token_ids[start * bs:full * bs], bs, seq.cache_key, full - start, parent)
        registered = 0
        for i, h in enumerate(new, start):
            b = seq.block_ids[i]
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            assert self.pool.ref_counts[b] > 0 and self.pool.fill[b] == bs, (
                f"only a used, full block can be cached (block {b})")
            if h not in self.cached and self.hash_of[b] is None:
                self.register(b, h, tokens, parent or b"")
                registered += 1
            parent = h
        seq.block_hashes.extend(new)
        return registered

    def register(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...], parent: bytes) -> None:
        """Enter used, full block ``block_id`` under ``block_hash`` (its KV proven; a "stored" event)."""
        self.pool.keep_content(block_id)
        self.cached[block_hash] = block_id
        self.hash_of[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        self.parent_of[block_id] = parent
        self._emit("stored", block_id=block_id, block_hash=block_hash, parent_hash=parent, token_ids=tokens)

    def forget(self, block_id: int) -> None:
        """Take block ``block_id`` out of the cache now (a "removed" event); it keeps its content mark."""
        h = self._forget(block_id)
        self._emit("removed", block_id=block_id, block_hash=h)

    def reset(self, live: Iterable[Sequence]) -> int:
        """Forget every content hash (one "cleared" event); returns refcount-0 blocks made free.

        The ``live`` sequences forget their hash chains too: their next commit re-registers their full blocks.
        """
        steps = self.reset_steps(live, chunk=None)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def reset_steps(self, live: Iterable[Sequence], chunk: int | None) -> Generator[int, None, int]:
        """:meth:`reset` in steps of at most ``chunk`` blocks (None: one step). Between two steps it
        yields the blocks cleared so far, so a caller on an event loop can let other calls run
        there (bounded work per turn); it returns (StopIteration.value) the blocks cleared in all.
        What is cached when the reset starts is dropped; a block evicted or registered anew between
        steps is left to what happened to it meanwhile. The "cleared" event comes after the last step.
        """
        for seq in live:
            seq.block_hashes = []
        blocks = list(self.cached.values())
        step = chunk or max(1, len(blocks))
        cleared = 0
        for at in range(0, len(blocks), step):
            if at:
                yield cleared
            for b in blocks[at:at + step]:
                if self.hash_of[b] is not None:  # not evicted since the reset began
                    self._forget(b)
                    cleared += self.pool.drop_content(b)
        self._emit("cleared")
        log.info("prefix_cache_reset", blocks_cleared=cleared)
        return cleared

    def evicted(self, block_id: int) -> None:
        """The pool reused cached block ``block_id``: it leaves the cache (then ``on_evicted``)."""
        tokens, parent = self.block_tokens[block_id], self.parent_of[block_id]
        h = self._forget(block_id)
        self.evictions += 1
        self._emit("removed", block_id=block_id, block_hash=h)
        if self.on_evicted is not None:
            self.on_evicted(block_id, h, tokens, parent)

    def _forget(self, block_id: int) -> bytes:
        h = self.hash_of[block_id]
        del self.cached[h]
        self.hash_of[block_id] = None
        self.block_tokens[block_id] = None
        self.parent_of[block_id] = b""
        return h

    # ------------------------------------------------------------------ events
    def emit(self, kind: str, **fields) -> None:
        """Log an event of another tier (the host tier's "stored" / "removed", ``medium=1``)."""
        self._emit(kind, **fields)

    def _emit(self, kind: str, **fields) -> None:
        event = KvEvent(self._next_event, kind, **fields)
        self.events.append(event)
        self._next_event += 1
        for listener in self.listeners:
            listener(event)

    def subscribe(self, first: int | None = None) -> KvEventCursor:
        """A cursor on the event log at event ``first`` (None: only events from now on), for StreamKvEvents.

        Raises:
            InvalidArgumentError: ``first`` < 1 (events are numbered from 1).
            FailedPreconditionError: the log already dropped event ``first`` (it keeps ``max_events``);
                the message names ``first`` and the oldest event kept.
            OutOfRangeError: ``first`` is past the next event to be logged (metadata ``next``: that
                event's number); such a cursor would wait for ever, or for a later event than asked.
        """
        events = self.events
        if first is None:
            return KvEventCursor(events, self._next_event)
        if first < 1:
            raise InvalidArgumentError(f"from_sequence_number must be >= 1 (events are numbered from 1), got {first}")
        if first > self._next_event:
            raise OutOfRangeError(
                f"from_sequence_number {first} is past the next KV event to be logged, {self._next_event} (a memory "
                "service numbers its events from 1 again when it restarts): subscribe from at most "
                f"{self._next_event}, or without from_sequence_number for new events only",
                metadata={"next": str(self._next_event)})
        cursor = KvEventCursor(events, first)
        cursor.check_retained()
        return cursor

    def check(self, held: Container[int] = ()) -> None:
        """Assert the module's invariants (O(num_blocks + events)); ``held``: blocks that keep content
        for a swapped-out sequence instead (:mod:`memory_service.tiers.manager`)."""
        assert all(self.hash_of[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.hash_of) == len(self.cached)
        for b, h in enumerate(self.hash_of):
            assert (
                (h is not None) == (self.block_tokens[b] is not None) == (self.pool.has_content[b] and b not in held)
            ), (
                f"block {b}: hash {h is not None}, tokens {self.block_tokens[b] is not None}, "
                f"content {self.pool.has_content[b]}, held for a swapped sequence {b in held}"
            )
        numbers = [e.sequence_number for e in self.events]
        assert numbers == list(range(self._next_event - len(numbers), self._next_event)), "event numbers have a gap"


class KvEventCursor:
    """A subscriber's place in the KV event log (:meth:`PrefixCache.subscribe`)."""

    __slots__ = ("_events", "next_number")

    def __init__(self, events: deque[KvEvent], next_number: int):
        self._events = events
        #: Sequence number of the next event :meth:`poll` returns.
        self.next_number = next_number

    def check_retained(self) -> None:
        """Raise unless the log still holds every event from :attr:`next_number` on.

        Raises:
            FailedPreconditionError: event :attr:`next_number` was dropped (the log keeps the last
                ``max_events``); the message names it and the oldest event kept.
        """
        events = self._events
        if events and self.next_number < events[0].sequence_number:
            oldest = events[0].sequence_number
            raise FailedPreconditionError(
                f"KV event {self.next_number} is lost: the service keeps only the last {events.maxlen} events and "
                f"the oldest kept is {oldest}; resync the cache and resubscribe from {oldest} (or from now on)",
                metadata={"first_lost": str(self.next_number), "oldest_retained": str(oldest)},
            )

    def poll(self, limit: int | None = None) -> list[KvEvent]:
        """Up to ``limit`` (None: all) events numbered :attr:`next_number` and on, oldest first; moves past them.

        Raises:
            FailedPreconditionError: the cursor fell more than ``max_events`` behind, so the log
                dropped its next event (:meth:`check_retained`); nothing is skipped silently.
        """
        self.check_retained()
        events = self._events
        if not events or events[-1].sequence_number < self.next_number:
            return []
        start = self.next_number - events[0].sequence_number
        out = list(itertools.islice(events, start, None if limit is None else start + limit))
        self.next_number = out[-1].sequence_number + 1
        return out
