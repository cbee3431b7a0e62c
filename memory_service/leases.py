"""Leases: client sessions that own sequences, each renewed by keep-alive within its TTL.

A lease that is released, or that sees no keep-alive within its TTL, is
dropped: the table calls ``on_drop(lease)``, which frees every sequence the
lease owns (the block manager passes its own), so no client crash leaks
blocks. Expiry is lazy (checked at each lookup) plus periodic
(:meth:`LeaseTable.expire` from a background task). Time comes from an
injectable ``clock`` (seconds, monotonic), so tests can advance it by hand.

Keep-alives are never starved by the service's own stalls. Once the periodic
sweep runs (:meth:`LeaseTable.watch_stalls`), the table knows it looks at the
clock at least every ``period`` seconds; a gap longer than two periods between
two looks means the service itself did not run (a long call on the event loop,
the process paused, the host suspended), not that clients fell silent (a sweep
a little late, by the event loop's jitter or a busy machine, is not a stall:
crediting every such lateness would hold expiry off for ever). Then:

* the gap beyond ``period`` is credited to every live lease (added to its
  deadline) before anything expires, since no client could reach the service
  meanwhile; a lease nobody keeps alive still expires, one credit later;
* no lease expires during the next ``period`` seconds, so the keep-alives that
  queued during the stall are served first (a lookup in that window finds an
  overdue lease still live; its keep-alive renews it).

Recently ended ids are remembered (with their secret's hash) so their owner
hears "expired" or "released" rather than "unknown".

Secrets: :meth:`LeaseTable.open` returns a new lease's secret once
(``secrets.token_urlsafe(32)``, 256 random bits); the table keeps only its
SHA-256, and the lease's id is derived from the secret too (:func:`lease_id_of`,
a different hash), so whoever holds the secret can prove a lease id is theirs
even to a service that never heard of it (after a restart).
:meth:`LeaseTable.authorize` checks a secret before a call touches the lease,
and answers so that a lease id alone tells a caller nothing::

    secret missing                                   -> UNAUTHENTICATED
    live lease, its secret                           -> the lease
    ended lease (remembered), its secret             -> FAILED_PRECONDITION (expired)
                                                        / NOT_FOUND (released)
    unknown lease, a secret the id derives from      -> NOT_FOUND (e.g. the service restarted)
    any other case: wrong secret for a live, ended   -> PERMISSION_DENIED, one message
      or unknown lease                                  for all of them

So NOT_FOUND / FAILED_PRECONDITION about a lease go only to whoever proves
they hold it; everyone else gets the same PERMISSION_DENIED whether the lease
exists or not.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_service.manager.live_table import LiveTable
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA
from pagedkv.runtime.errors import (
    LEASE_EXPIRED,
    LEASE_NOT_FOUND,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    UnauthenticatedError,
)
from pagedkv.runtime.logs import get_logger

log = get_logger("block_manager")

#: Ended (expired or released) lease ids remembered, so their owner hears why rather than "unknown".
EXPIRED_LEASES_REMEMBERED = 4096
#: Compared against when a lease id is unknown, so every refusal costs the same.
_NO_HASH = hashlib.sha256(b"no lease").digest()


def secret_hash(secret: str) -> bytes:
    """SHA-256 of a lease secret (32 bytes); the table keeps only this."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def lease_id_of(secret: str) -> str:
    """The id of the lease whose secret is ``secret``: 32 hex characters of a domain-separated SHA-256.

    Public, and says nothing about the secret; it lets the holder of a secret prove which
    lease id is theirs without the service remembering anything.
    """
    return hashlib.sha256(b"pagedkv lease id\0" + secret.encode("utf-8", "surrogatepass")).hexdigest()[:32]
#: Longest TTL a lease may ask for, seconds.
MAX_TTL = 86_400
#: Longest owner label of a lease, characters.
MAX_OWNER_CHARS = 256


@dataclass(slots=True)
class Lease:
    """A client session owning sequences."""

    #: Public id: :func:`lease_id_of` its secret (32 hex characters).
    lease_id: str
    #: Lifetime without keep-alive, seconds.
    ttl: float
    #: Clock time at which it expires.
    expires_at: float
    #: Free-form owner label.
    owner: str = ""
    #: Ids of its live sequences.
    seq_ids: set[int] = field(default_factory=set)
    #: SHA-256 of its secret (the secret itself is never kept).
    secret_hash: bytes = b""
    #: Block-table entries of its sequences (a block shared by two of them counts twice); quotas count these.
    num_block_entries: int = 0
    #: Who opened it (:func:`memory_service.peers.peer_identity`), for the limit of leases per peer.
    peer: str = ""
    #: Opened by the admin: no per-lease block quota, and not counted against its peer.
    exempt: bool = False


class LeaseTable(LiveTable[str, Lease]):
    """Live leases by id (a read-only mapping), with create / keep-alive / expiry / release.

    Args:
        default_ttl: TTL of a lease created without one, seconds (> 0).
        on_drop: called with a lease about to be forgotten (released or expired); frees its
            sequences and returns how many it freed (logged).
        clock: monotonic time source in seconds.
        max_leases: most live leases (None: no limit).
        max_leases_per_peer: most live leases one peer opened, exempt ones not counted (None: no limit).

    Raises:
        ValueError: ``default_ttl`` <= 0.
    """

    def __init__(self, default_ttl: float, on_drop: Callable[[Lease], int],
                 clock: Callable[[], float] = time.monotonic, max_leases: int | None = None,
                 max_leases_per_peer: int | None = None):
        if default_ttl <= 0:
            raise ValueError(f"lease_ttl must be > 0 seconds, got {default_ttl}")
        super().__init__()
        #: TTL of a lease created without one, seconds.
        self.default_ttl = default_ttl
        #: Time source, seconds.
        self.clock = clock
        self._on_drop = on_drop
        #: Most live leases (None: no limit): bounds the table every expiry sweep walks, and what one
        #: caller can hold by opening lease after lease (each lease has its own quotas).
        self.max_leases = max_leases
        #: Most live leases of one peer, the admin's not counted (None: no limit): without it one local
        #: caller gets round the per-lease block quota by opening lease after lease.
        self.max_leases_per_peer = max_leases_per_peer
        #: Peer -> its live leases that count (not exempt).
        self._per_peer: Counter[str] = Counter()
        #: Recently ended lease id -> (how it ended: "expired" / "released", its secret's hash), oldest first.
        self._ended: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
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
        """Add the gap since the last look beyond :attr:`sweep_period` to every lease's deadline, when it
        is a stall: longer than two periods (a sweep later than that is the service not running)."""
        late = now - self._looked_at - self.sweep_period
        self._looked_at = now
        if late <= self.sweep_period:
            return
        for lease in self._live.values():
            lease.expires_at += late
        self._hold_until = now + self.sweep_period
        self.stall_credit += late
        log.warning("stall_credited", seconds=round(late, 3), leases=len(self._live))

    def open(self, ttl: float | None = None, owner: str = "", *, peer: str = "",
             exempt: bool = False) -> tuple[Lease, str]:
        """Open a lease with ``ttl`` seconds (default: the table's) for ``peer`` (who asks; ``exempt``:
        the admin, not counted against it); returns the lease and its secret.

        The secret (43 URL-safe characters) is returned only here; the table keeps its hash.

        Raises:
            InvalidArgumentError: ttl not in (0, 86400], or an owner label too long.
            QuotaExceededError: ``max_leases`` leases live, or (unless ``exempt``) ``max_leases_per_peer``
                of ``peer``'s; nothing changed.
        """
        ttl = self.default_ttl if ttl is None else ttl
        if not 0 < ttl <= MAX_TTL:
            raise InvalidArgumentError(f"ttl_seconds must be in (0, {MAX_TTL}], got {ttl}")
        if len(owner) > MAX_OWNER_CHARS:
            raise InvalidArgumentError(f"owner is {len(owner)} characters; at most {MAX_OWNER_CHARS}")
        self.expire()
        if self.max_leases is not None and len(self._live) >= self.max_leases:
            raise QuotaExceededError("leases", self.max_leases, 1, len(self._live), "CreateLease",
                                     holder="the memory service", flag="--max-leases")
        limit, held = self.max_leases_per_peer, self._per_peer[peer]
        if not exempt and limit is not None and held >= limit:
            raise QuotaExceededError("leases", limit, 1, held, "CreateLease", holder=f"this caller ({peer})",
                                     flag="--max-leases-per-peer")
        secret = secrets.token_urlsafe(32)
        lease = Lease(lease_id_of(secret), ttl, self.clock() + ttl, owner, secret_hash=secret_hash(secret), peer=peer,
                      exempt=exempt)
        self._live[lease.lease_id] = lease
        if not exempt:
            self._per_peer[peer] += 1
        log.info("lease_created", lease_id=lease.lease_id, ttl=ttl, owner=owner, peer=peer, exempt=exempt)
        return lease, secret

    def create(self, ttl: float | None = None, owner: str = "") -> Lease:
        """:meth:`open` for callers inside the process, which need no secret."""
        return self.open(ttl, owner)[0]

    def authorize(self, lease_id: str, secret: str | None) -> Lease:
        """The live lease ``lease_id`` if ``secret`` is its secret (module docstring: the answers).

        Checked before anything changes; the comparison is constant-time.

        Raises:
            InvalidArgumentError: an empty id.
            UnauthenticatedError: no secret.
            FailedPreconditionError / NotFoundError: the lease expired / was released or is
                unknown here, and ``secret`` is its secret.
            PermissionDeniedError: any other mismatch (the same message whether the lease exists or not).
        """
        if not lease_id:
            raise InvalidArgumentError("lease_id is empty; call CreateLease first and pass its lease_id")
        if not secret:
            raise UnauthenticatedError(
                f"a call on lease {lease_id!r} needs the lease's secret in metadata {LEASE_SECRET_METADATA!r} "
                "(CreateLease returned it as lease_secret)")
        self.expire()
        presented = secret_hash(secret)
        lease = self._live.get(lease_id)
        ended = self._ended.get(lease_id) if lease is None else None
        known = lease.secret_hash if lease is not None else ended[1] if ended is not None else _NO_HASH
        if hmac.compare_digest(presented, known) and known is not _NO_HASH:
            if lease is not None:
                return lease
            return self.lookup(lease_id)  # raises: expired (FAILED_PRECONDITION) or released (NOT_FOUND)
        # Bytes: compare_digest refuses str with non-ASCII characters, and a caller may send any id.
        if lease is None and ended is None and hmac.compare_digest(
                lease_id_of(secret).encode(), lease_id.encode("utf-8", "surrogatepass")):
            return self.lookup(lease_id)  # raises NOT_FOUND: the holder of this id's secret hears it is gone
        raise PermissionDeniedError(
            f"the secret in {LEASE_SECRET_METADATA!r} is not the secret of lease {lease_id!r}: the lease is another "
            "caller's, or it no longer exists here (released, expired, or the memory service restarted); send the "
            "lease_secret CreateLease returned for it, or create a new lease")

    def matches(self, lease: Lease, secret: str | None) -> bool:
        """Whether ``secret`` is the secret of the live ``lease`` (constant-time)."""
        return bool(secret) and hmac.compare_digest(secret_hash(secret), lease.secret_hash)

    def keep_alive(self, lease_id: str) -> float:
        """Renew a lease for another TTL; returns seconds until it expires (errors as :meth:`lookup`)."""
        lease = self.lookup(lease_id)
        lease.expires_at = self.clock() + lease.ttl
        return lease.ttl

    def release(self, lease_id: str) -> int:
        """Free every sequence of the lease and forget it; returns sequences freed (errors as :meth:`lookup`)."""
        lease = self.lookup(lease_id)
        n = self._drop(lease)
        self._remember(lease, "released")
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
            self._remember(lease, "expired")
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
        how = self._ended.get(lease_id, ("",))[0]
        if how == "expired":
            raise FailedPreconditionError(
                f"lease {lease_id} expired (no keep-alive within its TTL) and its sequences were "
                "freed; create a new lease and allocate again", reason=LEASE_EXPIRED
            )
        if how == "released":
            raise NotFoundError(f"lease {lease_id} was released and its sequences freed; create a new lease",
                                reason=LEASE_NOT_FOUND)
        raise NotFoundError(f"unknown lease {lease_id!r}; call CreateLease first", reason=LEASE_NOT_FOUND)

    def _remember(self, lease: Lease, how: str) -> None:
        self._ended[lease.lease_id] = (how, lease.secret_hash)
        if len(self._ended) > EXPIRED_LEASES_REMEMBERED:
            self._ended.popitem(last=False)

    def _drop(self, lease: Lease) -> int:
        n = self._on_drop(lease)
        del self._live[lease.lease_id]
        if not lease.exempt:
            self._per_peer[lease.peer] -= 1
            if not self._per_peer[lease.peer]:
                del self._per_peer[lease.peer]
        return n
