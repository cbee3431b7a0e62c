"""Leases: client sessions that own sequences, each renewed by keep-alive within its TTL.

A lease that is released, or that sees no keep-alive within its TTL, is
dropped: the table calls ``on_drop(lease)``, which frees every sequence the
lease owns (the block manager passes its own), so no client crash leaks
blocks. Expiry is lazy (checked at each lookup) plus periodic
(:meth:`LeaseTable.expire` from a background task). Recently expired ids are
remembered so a late call says "expired" rather than "unknown". Time comes
from an injectable ``clock`` (seconds, monotonic), so tests can advance it by
hand.

Keep-alives are never starved by the service's own stalls. Once the periodic
sweep runs (:meth:`LeaseTable.watch_stalls`), the table knows it looks at the
clock at least every ``period`` seconds; a gap longer than that between two
looks means the service itself did not run (a long call on the event loop, the
process paused, the host suspended), not that clients fell silent. Then:

* the gap beyond ``period`` is credited to every live lease (added to its
  deadline) before anything expires, since no client could reach the service
  meanwhile; a lease nobody keeps alive still expires, one credit later;
* no lease expires during the next ``period`` seconds, so the keep-alives that
  queued during the stall are served first (a lookup in that window finds an
  overdue lease still live; its keep-alive renews it).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_service.live_table import LiveTable
from pagedkv.errors import LEASE_EXPIRED, LEASE_NOT_FOUND, FailedPreconditionError, InvalidArgumentError, NotFoundError
from pagedkv.logs import get_logger

log = get_logger("block_manager")

#: Expired lease ids remembered, so a late call says "expired" rather than "unknown".
EXPIRED_LEASES_REMEMBERED = 4096
#: Longest TTL a lease may ask for, seconds.
MAX_TTL = 86_400


@dataclass(slots=True)
class Lease:
    """A client session owning sequences."""

    #: Opaque id (uuid4 hex).
    lease_id: str
    #: Lifetime without keep-alive, seconds.
    ttl: float
    #: Clock time at which it expires.
    expires_at: float
    #: Free-form owner label.
    owner: str = ""
    #: Ids of its live sequences.
    seq_ids: set[int] = field(default_factory=set)


class LeaseTable(LiveTable[str, Lease]):
    """Live leases by id (a read-only mapping), with create / keep-alive / expiry / release.

    Args:
        default_ttl: TTL of a lease created without one, seconds (> 0).
        on_drop: called with a lease about to be forgotten (released or expired); frees its
            sequences and returns how many it freed (logged).
        clock: monotonic time source in seconds.

    Raises:
        ValueError: ``default_ttl`` <= 0.
    """

    def __init__(self, default_ttl: float, on_drop: Callable[[Lease], int],
                 clock: Callable[[], float] = time.monotonic):
        if default_ttl <= 0:
            raise ValueError(f"lease_ttl must be > 0 seconds, got {default_ttl}")
        super().__init__()
        #: TTL of a lease created without one, seconds.
        self.default_ttl = default_ttl
        #: Time source, seconds.
        self.clock = clock
        self._on_drop = on_drop
        #: Recently expired lease id -> clock time of expiry, oldest first.
        self._expired: OrderedDict[str, float] = OrderedDict()
        #: Longest expected gap between two looks at the clock, seconds (None: stalls are not credited).
        self.sweep_period: float | None = None
        #: Clock time of the last look (expire()).
        self._looked_at = clock()
        #: No lease expires before this clock time (a stall was just credited).
        self._hold_until = float("-inf")
        #: Seconds of stalls credited to every lease so far.
        self.stall_credit = 0.0

    def watch_stalls(self, period: float) -> None:
        """Credit stalls of the service to every lease (module docstring): from now on :meth:`expire`
        runs at least every ``period`` seconds (> 0; the sweep's period), and a longer gap is a stall.

        Raises:
            ValueError: ``period`` <= 0.
        """
        if period <= 0:
            raise ValueError(f"the sweep period must be > 0 seconds, got {period}")
        self.sweep_period = period
        self._looked_at = self.clock()

    def _credit_stall(self, now: float) -> None:
        """Add the gap since the last look beyond :attr:`sweep_period` to every lease's deadline."""
        late = now - self._looked_at - self.sweep_period
        self._looked_at = now
        if late <= 0:
            return
        for lease in self._live.values():
            lease.expires_at += late
        self._hold_until = now + self.sweep_period
        self.stall_credit += late
        log.warning("stall_credited", seconds=round(late, 3), leases=len(self._live))

    def create(self, ttl: float | None = None, owner: str = "") -> Lease:
        """Open a lease with ``ttl`` seconds (default: the table's).

        Raises:
            InvalidArgumentError: ttl not in (0, 86400].
        """
        ttl = self.default_ttl if ttl is None else ttl
        if not 0 < ttl <= MAX_TTL:
            raise InvalidArgumentError(f"ttl_seconds must be in (0, {MAX_TTL}], got {ttl}")
        self.expire()
        lease = Lease(uuid.uuid4().hex, ttl, self.clock() + ttl, owner)
        self._live[lease.lease_id] = lease
        log.info("lease_created", lease_id=lease.lease_id, ttl=ttl, owner=owner)
        return lease

    def keep_alive(self, lease_id: str) -> float:
        """Renew a lease for another TTL; returns seconds until it expires (errors as :meth:`lookup`)."""
        lease = self.lookup(lease_id)
        lease.expires_at = self.clock() + lease.ttl
        return lease.ttl

    def release(self, lease_id: str) -> int:
        """Free every sequence of the lease and forget it; returns sequences freed (errors as :meth:`lookup`)."""
        n = self._drop(self.lookup(lease_id))
        log.info("lease_released", lease_id=lease_id, freed_sequences=n)
        return n

    def expire(self) -> list[str]:
        """Drop every lease past its TTL (freeing its sequences); returns their ids.

        With :meth:`watch_stalls` on, a stall since the last call is credited first, and nothing
        expires for one period after it (module docstring).
        """
        now = self.clock()
        if self.sweep_period is not None:
            self._credit_stall(now)
            if now < self._hold_until:
                return []
        expired = [lease for lease in self._live.values() if lease.expires_at <= now]
        for lease in expired:
            n = self._drop(lease)
            self._expired[lease.lease_id] = now
            if len(self._expired) > EXPIRED_LEASES_REMEMBERED:
                self._expired.popitem(last=False)
            log.info("lease_expired", lease_id=lease.lease_id, freed_sequences=n, owner=lease.owner)
        return [lease.lease_id for lease in expired]

    def lookup(self, lease_id: str) -> Lease:
        """The live lease ``lease_id``, after expiring overdue ones.

        Raises:
            InvalidArgumentError: an empty id.
            FailedPreconditionError: the lease expired (recently enough to be remembered).
            NotFoundError: an id never issued, released, or expired long ago.
        """
        if not lease_id:
            raise InvalidArgumentError("lease_id is empty; call CreateLease first and pass its lease_id")
        self.expire()
        lease = self._live.get(lease_id)
        if lease is not None:
            return lease
        if lease_id in self._expired:
            raise FailedPreconditionError(
                f"lease {lease_id} expired (no keep-alive within its TTL) and its sequences were "
                "freed; create a new lease and allocate again", reason=LEASE_EXPIRED
            )
        raise NotFoundError(f"unknown lease {lease_id!r}; call CreateLease first", reason=LEASE_NOT_FOUND)

    def _drop(self, lease: Lease) -> int:
        n = self._on_drop(lease)
        del self._live[lease.lease_id]
        return n
