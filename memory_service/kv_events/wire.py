"""The memory service's KV events in vLLM's wire format (``vllm/distributed/kv_events.py``, v0.32.0).

What routers built for vLLM read (NVIDIA Dynamo's KV router, llm-d's KV-cache indexer): one
msgpack ``KVEventBatch`` per ZMQ message, encoded with msgspec as vLLM encodes it, field by field:

- the batch is an array ``[ts, events, data_parallel_rank]``: ``ts`` the publisher's wall clock
  when it made the batch (seconds, float), ``data_parallel_rank`` always 0 (a memory service owns
  one pool, vLLM's single data-parallel rank; a router tells nodes apart by their endpoints);
- each event is a map tagged ``"type"`` (msgspec ``tag=True``, ``omit_defaults=True``: fields left at
  a default are not sent; 0.32's events are maps, older releases' tagged arrays):

  ======================  =====================================================================
  ``BlockStored``         ``block_hashes`` [one int], ``parent_block_hash`` (int, or nil for a
                          sequence's first block), ``token_ids`` (the block's tokens, or [] where
                          the endpoint may not carry them), ``block_size``, ``lora_id`` nil,
                          ``medium``, ``lora_name`` nil, ``group_idx`` 0 (vLLM's single KV cache
                          group); ``extra_keys`` and the rest are never sent: vLLM puts the cache
                          salt in ``extra_keys``, and a salt is a tenant's secret here
  ``BlockRemoved``        ``block_hashes`` [one int], ``medium``, ``group_idx`` 0
  ``AllBlocksCleared``    no field
  ======================  =====================================================================

One event of the memory service's log is one event here, in the log's order: a ``stored`` or
``removed`` event names one block, so ``block_hashes`` holds one hash.

Media: the device pool is ``"GPU"``, as vLLM names its main pool on every backend (its CPU build
too), the host tier ``"CPU"``, the disk tier ``"DISK"`` (what every Dynamo release reads as its disk
tier; vLLM's own disk offloading says ``"STORAGE"``).

Block hashes as integers: :func:`external_hash` is vLLM's ``maybe_convert_block_hash`` (its
default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) applied to our 32-byte chained hash
(:func:`pagedkv.runtime.block_hash.block_hash`): the hash read as a big-endian integer, modulo
2^64, i.e. its last 8 bytes as an unsigned 64-bit integer (Dynamo's routers keep u64 hashes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from memory_service.prefix_cache import KvEvent

#: pagedkv.grant.v1.Medium -> vLLM's medium string.
MEDIUM_NAMES = {0: "GPU", 1: "CPU", 3: "DISK"}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch``: sent as the array ``[ts, events, data_parallel_rank]``."""

    #: Wall-clock seconds (time.time()) when the batch was made.
    ts: float
    #: The events, oldest first.
    events: list[Any]
    #: The data-parallel rank of the publisher (always 0 here).
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base: a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """vLLM's ``BlockStored``, every field of 0.32 in its order (those at their default are not sent)."""

    #: Chained block hashes as unsigned 64-bit integers (:func:`external_hash`).
    block_hashes: list[int]
    #: The hash before the first of them; None for a sequence's first block.
    parent_block_hash: int | None
    #: The blocks' token ids, concatenated ([] where the endpoint may not carry them).
    token_ids: list[int]
    #: Tokens per block.
    block_size: int
    #: Deprecated in vLLM (LoRA adapter id); always None.
    lora_id: int | None
    #: "GPU", "CPU" or "DISK" (:data:`MEDIUM_NAMES`).
    medium: str | None
    #: LoRA adapter name; always None (the model identity is part of the hash instead).
    lora_name: str | None
    #: vLLM's per-block extra hash keys (LoRA name, multimodal ids, cache salt); never sent.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    #: KV cache group; 0.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """vLLM's ``BlockRemoved``."""

    #: Hashes of the blocks that left the cache (:func:`external_hash`).
    block_hashes: list[int]
    #: Where they were.
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM's ``AllBlocksCleared``: every cached block was dropped."""


class KVEventBatch(EventBatch):
    """vLLM's ``KVEventBatch``: an :class:`EventBatch` of KV cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """The integer a router sees for a 32-byte chained block hash: ``int.from_bytes(h, "big") % 2**64``
    (vLLM's ``maybe_convert_block_hash``), its last 8 bytes as an unsigned 64-bit integer."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def wire_event(e: KvEvent, block_size: int, with_token_ids: bool) -> KVCacheEvent:
    """``e`` as vLLM's event; a stored block's token ids only when ``with_token_ids``."""
    if e.kind == "stored":
        return BlockStored(
            block_hashes=[external_hash(e.block_hash)],
            parent_block_hash=external_hash(e.parent_hash) if e.parent_hash else None,
            token_ids=list(e.token_ids) if with_token_ids else [],
            block_size=block_size, lora_id=None, medium=MEDIUM_NAMES[e.medium], lora_name=None, group_idx=0)
    if e.kind == "removed":
        return BlockRemoved(block_hashes=[external_hash(e.block_hash)], medium=MEDIUM_NAMES[e.medium], group_idx=0)
    assert e.kind == "cleared", f"unknown KV event kind {e.kind!r}"
    return AllBlocksCleared()


class BatchEncoder:
    """Encodes the log's events as one msgpack ``KVEventBatch`` (a reusable msgspec encoder)."""

    def __init__(self, block_size: int, with_token_ids: bool):
        self.block_size, self.with_token_ids = block_size, with_token_ids
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: Iterable[KvEvent]) -> bytes:
        """The payload of one ZMQ message: ``[time.time(), [event, ...], 0]``."""
        batch = KVEventBatch(ts=time.time(), data_parallel_rank=0,
                             events=[wire_event(e, self.block_size, self.with_token_ids) for e in events])
        return self._encoder.encode(batch)


__all__ = ["MEDIUM_NAMES", "AllBlocksCleared", "BatchEncoder", "BlockRemoved", "BlockStored", "KVEventBatch",
           "external_hash", "wire_event"]
