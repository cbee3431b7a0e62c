"""Prefix pins: an operator keeps a prompt's cached blocks resident for a while (PinPrefix).

The retention half of the ecosystem's cache control: TensorRT-LLM's ``KvCacheRetentionConfig``
(a priority and a duration per token range), LMCache's and Mooncake's pin/unpin, SGLang's
priority eviction. A pin holds the leading full blocks of a prompt that are cached on the
device: it is a sequence of the caller's lease holding just them (refcount + 1), so nothing
evicts them while it lives, they count against the lease's quota as any sequence's blocks, and
the lease's end frees them like its other sequences. A pin of a lease the admin opened (the
operator's: ``pagedkv serve``'s) may also raise the blocks' retention priority
(:meth:`memory_service.block_pool.BlockPool.set_retention`): once it ends (its TTL, UnpinPrefix,
or the lease), the blocks stay cached and eviction takes them after every block of a lower
priority. A tenant's lease pins at priority 0 only: a priority outlives the pin (and its quota
charge) and orders eviction among every lease's blocks.

Prefix pins are not the transfer pins of ExportPrefix (a sequence pinned for another node to
read, freed once the reader proved its copy): those are not listed here and keep no priority.

A mixin of :class:`memory_service.manager.block_manager.BlockManager`: it reads the manager's
``leases``, ``sequences``, ``pool``, ``prefix_cache`` and ``block_size``, and calls its
``_check_quota`` and ``_free_one``.

NOTE: invariants (:meth:`ManagerPins.check_pins`):
  * every pin names a live sequence of its lease holding exactly the pin's blocks;
  * a pinned block's retention priority is at least the pin's while it keeps its content (a reset
    of the prefix cache drops content and priority; the pin still holds the blocks until it ends).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from memory_service.manager.requests import check_token_ids
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from pagedkv.runtime.logs import get_logger

log = get_logger("block_manager")

#: Longest pin, seconds (a day): a pin is renewed by pinning again, never kept for ever.
MAX_PIN_TTL = 86_400.0
#: Retention priorities run from 0 (plain LRU) to this (TensorRT-LLM's range).
MAX_RETENTION_PRIORITY = 100
#: Longest label, characters.
MAX_PIN_LABEL = 128


@dataclass(slots=True)
class PrefixPin:
    """A live prefix pin."""

    #: ``pin-`` and 16 hex digits.
    pin_id: str
    #: The lease it is charged to.
    lease_id: str
    #: The sequence holding its blocks.
    seq_id: int
    #: Tokens pinned (whole blocks).
    num_tokens: int
    #: Retention priority of its blocks, 0-100.
    priority: int
    #: Clock time it ends at, seconds.
    expires_at: float
    #: Free-form label (the front names the tenant).
    label: str = ""


class ManagerPins:
    """Prefix pins of a block manager (mixed into ``BlockManager``)."""

    #: Live pins by id, oldest first (set by the manager's ``__init__``).
    pins: dict[str, PrefixPin]
    #: Pins ended by their TTL.
    pins_expired: int

    def pin_prefix(self, lease_id: str, token_ids: Seq[int], key: CacheKey, ttl: float, priority: int,
                   label: str = "") -> PrefixPin | None:
        """Pin the leading full blocks of ``token_ids`` cached on the device for ``ttl`` seconds,
        charged to ``lease_id``. None when none is cached (nothing changes). Never the block
        holding the last token (as a lookup).

        Raises:
            InvalidArgumentError: ``ttl`` outside (0, MAX_PIN_TTL], ``priority`` outside [0, 100], a
                label too long, too many token ids or ids outside int32.
            NotFoundError / FailedPreconditionError: unknown / expired lease.
            QuotaExceededError: the lease's sequences or block-table entries would pass its quota.
            PermissionDeniedError: a priority above 0 from a lease the admin did not open: it orders
                eviction among every tenant's blocks, and outlives the pin (and its quota charge).
        """
        if not 0 < ttl <= MAX_PIN_TTL:  # also refuses NaN
            raise InvalidArgumentError(f"PinPrefix: ttl_seconds must be in (0, {MAX_PIN_TTL:.0f}], got {ttl}")
        if not 0 <= priority <= MAX_RETENTION_PRIORITY:
            raise InvalidArgumentError(f"PinPrefix: priority must be in [0, {MAX_RETENTION_PRIORITY}], got {priority}")
        if len(label) > MAX_PIN_LABEL:
            raise InvalidArgumentError(f"PinPrefix: the label has {len(label)} characters; at most {MAX_PIN_LABEL}")
        lease = self.leases.lookup(lease_id)
        if priority and not lease.exempt:
            raise PermissionDeniedError(f"PinPrefix: a retention priority ({priority}) is the admin's: it orders "
                                        "eviction among every lease's blocks; open the lease with the admin token, "
                                        "or pin with priority 0")
        check_token_ids(len(token_ids), "PinPrefix")
        hit = self.prefix_cache.lookup(token_ids, key)
        if not hit.block_ids:
            return None
        n = len(hit.block_ids) * self.block_size
        self._check_quota(lease, "PinPrefix", len(hit.block_ids), 1)
        self.pool.touch(hit.block_ids)
        self.pool.set_retention(hit.block_ids, priority)
        seq = self.sequences.add(lease, n, list(hit.block_ids))
        seq.token_ids, seq.block_hashes, seq.cache_key = list(token_ids[:n]), list(hit.block_hashes), key
        seq.num_cached_tokens = seq.num_proven = n
        seq.pinned = True
        pin = PrefixPin(f"pin-{secrets.token_hex(8)}", lease_id, seq.seq_id, n, priority,
                        self.leases.clock() + ttl, label)
        self.pins[pin.pin_id] = pin
        log.info("prefix_pinned", pin_id=pin.pin_id, lease_id=lease_id, num_blocks=len(hit.block_ids),
                 priority=priority, ttl=ttl)
        return pin

    def unpin_prefix(self, lease_id: str, pin_id: str) -> int:
        """End pin ``pin_id`` of ``lease_id`` now; returns the blocks it held (they stay cached).

        Raises:
            NotFoundError: no live pin of that id charged to that lease.
            FailedPreconditionError: the lease expired.
        """
        self.leases.lookup(lease_id)
        pin = self._live_pin(pin_id)
        if pin is None or pin.lease_id != lease_id:
            raise NotFoundError(f"UnpinPrefix: no pin {pin_id!r} of lease {lease_id}; ListPins (admin) lists them")
        return self._end_pin(pin, "unpinned")

    def expire_pins(self) -> int:
        """End every pin past its TTL (the server's sweep); returns how many ended."""
        now = self.leases.clock()
        ended = [p for p in self.live_pins() if p.expires_at <= now]
        for pin in ended:
            self._end_pin(pin, "expired")
        self.pins_expired += len(ended)
        return len(ended)

    def live_pins(self) -> list[PrefixPin]:
        """The live pins, oldest first (a pin whose sequence was freed, by FreeSequences or its
        lease's end, is forgotten here)."""
        for pin_id in [i for i, p in self.pins.items() if p.seq_id not in self.sequences]:
            del self.pins[pin_id]
        return list(self.pins.values())

    def pin_stats(self) -> dict:
        """GetStats.pins (``PinStats``)."""
        pins = self.live_pins()
        blocks = {b for p in pins for b in self.sequences[p.seq_id].block_ids}
        return dict(num_pins=len(pins), pinned_blocks=len(blocks), pinned_tokens=sum(p.num_tokens for p in pins),
                    retained_blocks=self.pool.num_retained, expired=self.pins_expired)

    def check_pins(self) -> None:
        """Assert the module's invariants."""
        for pin in self.live_pins():
            seq = self.sequences[pin.seq_id]
            assert seq.lease_id == pin.lease_id, f"pin {pin.pin_id}: sequence {seq.seq_id} of another lease"
            assert seq.num_tokens == pin.num_tokens == len(seq.block_ids) * self.block_size, f"pin {pin.pin_id}"
            assert all(self.pool.retention[b] >= pin.priority for b in seq.block_ids if self.pool.has_content[b]), (
                f"pin {pin.pin_id}: a cached block below its retention priority {pin.priority}")

    def _live_pin(self, pin_id: str) -> PrefixPin | None:
        pin = self.pins.get(pin_id)
        if pin is not None and pin.seq_id not in self.sequences:
            del self.pins[pin_id]
            return None
        return pin

    def _end_pin(self, pin: PrefixPin, why: str) -> int:
        del self.pins[pin.pin_id]
        seq = self.sequences[pin.seq_id]
        n = len(seq.block_ids)
        self._free_one(seq, self.leases[pin.lease_id])  # a live sequence: its lease is in the table
        log.info("prefix_unpinned", pin_id=pin.pin_id, lease_id=pin.lease_id, num_blocks=n, reason=why)
        return n


__all__ = ["MAX_PIN_TTL", "MAX_RETENTION_PRIORITY", "ManagerPins", "PrefixPin"]
