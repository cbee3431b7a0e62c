"""StreamKvEvents' body: the prefix cache's KV event log as a stream of ``pb.KvEvent``.

Every event in order, sent as soon as it is logged: the stream wakes on each event (the prefix
cache's ``listeners``), never polls. Where the stream starts is checked once, before anything is
sent (:meth:`memory_service.prefix_cache.PrefixCache.subscribe`): a number below 1 is
INVALID_ARGUMENT, one the log no longer keeps FAILED_PRECONDITION naming it, and one past the
next event to be logged OUT_OF_RANGE (such a cursor would wait for ever, or for a later event
than the one asked for).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from memory_service.prefix_cache import KvEvent, PrefixCache
from pagedkv.memory.v1 import memory_service_pb2 as pb

#: Events a stream sends between two looks at the log.
EVENTS_PER_WAKE = 1024


def event_message(e: KvEvent, with_token_ids: bool) -> pb.KvEvent:
    """The event as sent; a stored block's token ids only when ``with_token_ids`` (the admin)."""
    if e.kind == "stored":
        return pb.KvEvent(sequence_number=e.sequence_number, block_stored=pb.BlockStored(
            block_hash=e.block_hash, parent_block_hash=e.parent_hash, block_id=e.block_id,
            token_ids=e.token_ids if with_token_ids else (), medium=e.medium))
    if e.kind == "removed":
        return pb.KvEvent(sequence_number=e.sequence_number, block_removed=pb.BlockRemoved(
            block_hash=e.block_hash, block_id=e.block_id, medium=e.medium))
    return pb.KvEvent(sequence_number=e.sequence_number, all_cleared=pb.AllBlocksCleared())


async def stream_events(cache: PrefixCache, first: int | None, with_token_ids: bool) -> AsyncIterator[pb.KvEvent]:
    """``cache``'s events from number ``first`` on (None: from the next one logged), then follow.

    Raises (before the first event):
        InvalidArgumentError: ``first`` < 1.
        FailedPreconditionError: event ``first`` was dropped, or the stream fell more than the
            retained window behind (the message names the first event lost).
        OutOfRangeError: ``first`` is past the next event to be logged.
    """
    changes = _kv_changes(cache)
    cursor = cache.subscribe(first)
    while True:
        changed = changes.current()  # taken before the poll, so no event can slip between
        batch = cursor.poll(EVENTS_PER_WAKE)
        for e in batch:
            yield event_message(e, with_token_ids)
        if not batch:
            await changed.wait()


class _Changes:
    """Wakes every waiting event stream when the log grows: one ``asyncio.Event`` per round."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self, event: KvEvent) -> None:
        """``event`` was logged (called synchronously from the prefix cache)."""
        self._event.set()

    def current(self) -> asyncio.Event:
        """The event the next emission sets (a fresh one once the last was set)."""
        if self._event.is_set():
            self._event = asyncio.Event()
        return self._event


def _kv_changes(cache: PrefixCache) -> _Changes:
    """The notifier of ``cache``'s log, added to its ``listeners`` on first use (one for every stream,
    beside the other readers of the log)."""
    for listener in cache.listeners:
        changes = getattr(listener, "__self__", None)
        if isinstance(changes, _Changes):
            return changes
    changes = _Changes()
    cache.listeners.append(changes.notify)
    return changes


__all__ = ["EVENTS_PER_WAKE", "event_message", "stream_events"]
