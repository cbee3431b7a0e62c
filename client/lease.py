"""A lease of the memory service, kept alive in the background (the engine's, a Client's).

DESIGN.md, "Block manager semantics": a lease's sequences live while it is renewed; when it
expires or is released, every one of them is freed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from client.errors import ServiceError
from pagedkv.runtime.errors import LEASE_EXPIRED, LEASE_NOT_FOUND
from pagedkv.runtime.logs import get_logger

if TYPE_CHECKING:
    from client.services import MemoryClient

log = get_logger("client")


class Lease:
    """A lease on ``memory`` renewed in the background until :meth:`close`.

    When a keep-alive is refused because the memory service no longer knows the lease (reason
    LEASE_NOT_FOUND: it restarted) or it expired (LEASE_EXPIRED), renewing stops and :attr:`lost`
    holds that error; the engine then recovers with a new lease (client.engine.recovery).
    """

    def __init__(self, memory: MemoryClient, ttl: float | None = None):
        self.memory = memory
        resp = memory.create_lease(ttl)
        self.lease_id = resp.lease_id
        #: The lease's secret (``memory`` sends it on every call on the lease).
        self.secret = resp.lease_secret
        self.ttl = resp.ttl_seconds
        #: Block-table entries the lease may hold; None: no quota (none set, or created with the admin token).
        self.max_blocks = resp.max_blocks or None
        #: The refusal that showed the lease is gone, once a keep-alive met one; None while it lives.
        self.lost: ServiceError | None = None
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="pagedkv-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.memory.keep_alive(self.lease_id)
            except Exception as e:  # noqa: BLE001 - keep trying unless the lease is gone
                if isinstance(e, ServiceError) and e.reason in (LEASE_NOT_FOUND, LEASE_EXPIRED):
                    self.lost = e
                    log.warning("lease_lost", lease_id=self.lease_id, reason=e.reason, error=e.message)
                    return
                log.warning("keep_alive_failed", lease_id=self.lease_id, error=str(e))

    def stop_renewing(self) -> None:
        """Stop the keep-alives and keep the lease: it expires after its TTL unless :meth:`close` releases it."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def close(self) -> None:
        """Stop renewing and release the lease (its sequences are freed)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self.memory.release_lease(self.lease_id)
        except Exception as e:  # noqa: BLE001 - the service may already be gone
            log.info("release_failed", lease_id=self.lease_id, error=str(e))


__all__ = ["Lease"]
