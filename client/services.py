"""Synchronous stubs for the two services, with typed errors and a kept-alive lease.

Each method is one RPC; ``grpc.RpcError`` becomes a :mod:`client.errors`
exception. :class:`Lease` renews itself from a daemon thread every third of
its TTL and is released on :meth:`Lease.close`; a client process that dies
stops renewing, and the memory service frees its sequences when the TTL runs out.
"""

from __future__ import annotations

import functools
import os
import socket
import threading

import grpc

from client.errors import ServiceError, from_rpc_error
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.errors import LEASE_EXPIRED, LEASE_NOT_FOUND
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.tls import TlsFiles
from pagedkv.tls import channel as plane_channel

log = get_logger("client")

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _typed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    return wrapper


class _Channel:
    """A channel to ``address`` (``host:port``) and the service's stub on it; ``timeout`` in seconds.

    With ``tls`` (:class:`pagedkv.tls.TlsFiles`) the channel is mutual TLS: the server must present
    a certificate signed by ``tls.ca`` that names the host dialled, and this client presents
    ``tls.cert`` (its role); without, plaintext (the services then listen on loopback only).
    """

    def __init__(self, address: str, timeout: float, stub_class, tls: TlsFiles | None = None):
        self.address = address
        self.timeout = timeout
        self.tls = tls
        self.channel = plane_channel(address, tls, _OPTIONS)
        self.stub = stub_class(self.channel)

    def close(self) -> None:
        self.channel.close()


class MemoryClient(_Channel):
    """The memory service at ``address`` (``host:port``)."""

    def __init__(self, address: str, timeout: float = 30.0, tls: TlsFiles | None = None):
        super().__init__(address, timeout, mpb_grpc.MemoryServiceStub, tls)

    @_typed
    def pool(self) -> mpb.PoolDescriptor:
        return self.stub.GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=self.timeout).pool

    @_typed
    def create_lease(self, ttl: float | None = None) -> mpb.CreateLeaseResponse:
        owner = f"{socket.gethostname()}:{os.getpid()}"
        return self.stub.CreateLease(mpb.CreateLeaseRequest(ttl_seconds=ttl, owner=owner), timeout=self.timeout)

    @_typed
    def keep_alive(self, lease_id: str) -> float:
        return self.stub.KeepAlive(mpb.KeepAliveRequest(lease_id=lease_id), timeout=self.timeout).expires_in_seconds

    @_typed
    def release_lease(self, lease_id: str) -> int:
        return self.stub.ReleaseLease(mpb.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.timeout).freed_sequences

    @_typed
    def allocate(self, lease_id: str, sequences: list[mpb.SequenceAllocation | int]) -> mpb.AllocateSequencesResponse:
        """Allocate sequences (token counts, or full ``SequenceAllocation`` messages for prefix caching);
        the reply has their block tables and grants."""
        seqs = [mpb.SequenceAllocation(num_tokens=s) if isinstance(s, int) else s for s in sequences]
        req = mpb.AllocateSequencesRequest(lease_id=lease_id, sequences=seqs)
        return self.stub.AllocateSequences(req, timeout=self.timeout)

    @_typed
    def append(self, lease_id: str, appends: list[tuple[int, int] | tuple[int, int, list[int]]]) -> mpb.AppendSlotsResponse:
        """Grow sequences by ``(seq_id, num_tokens[, token_ids])``."""
        req = mpb.AppendSlotsRequest(lease_id=lease_id, appends=[
            mpb.SlotAppend(seq_id=a[0], num_tokens=a[1], token_ids=a[2] if len(a) > 2 else ()) for a in appends])
        return self.stub.AppendSlots(req, timeout=self.timeout)

    @_typed
    def commit(self, lease_id: str, receipts: list) -> mpb.CommitComputedTokensResponse:
        """Hand in workers' receipts (``StepResult.receipt``, unchanged); the reply has fresh grants."""
        req = mpb.CommitComputedTokensRequest(lease_id=lease_id, receipts=receipts)
        return self.stub.CommitComputedTokens(req, timeout=self.timeout)

    @_typed
    def fork(self, lease_id: str, parents: list[int]) -> mpb.ForkSequencesResponse:
        """Fork each parent; the reply has the children's block tables and grants."""
        req = mpb.ForkSequencesRequest(lease_id=lease_id, forks=[mpb.SequenceFork(parent_seq_id=p) for p in parents])
        return self.stub.ForkSequences(req, timeout=self.timeout)

    @_typed
    def free(self, lease_id: str, seq_ids: list[int], reason: int = mpb.FREE_REASON_FINISHED) -> int:
        req = mpb.FreeSequencesRequest(lease_id=lease_id, seq_ids=seq_ids, reason=reason)
        return self.stub.FreeSequences(req, timeout=self.timeout).freed_blocks

    @_typed
    def block_table(self, seq_id: int) -> mpb.SequenceInfo:
        return self.stub.GetBlockTable(mpb.GetBlockTableRequest(seq_id=seq_id), timeout=self.timeout).sequence

    @_typed
    def sequences(self, lease_id: str | None = None) -> list[mpb.SequenceInfo]:
        return list(self.stub.ListSequences(mpb.ListSequencesRequest(lease_id=lease_id), timeout=self.timeout).sequences)

    @_typed
    def stats(self) -> mpb.GetStatsResponse:
        return self.stub.GetStats(mpb.GetStatsRequest(), timeout=self.timeout)


class WorkerClient(_Channel):
    """A compute worker at ``address``."""

    def __init__(self, address: str, timeout: float = 600.0, tls: TlsFiles | None = None):
        super().__init__(address, timeout, cpb_grpc.ComputeServiceStub, tls)

    @_typed
    def model_info(self) -> cpb.GetModelInfoResponse:
        return self.stub.GetModelInfo(cpb.GetModelInfoRequest(), timeout=30)

    @_typed
    def step(self, request: cpb.StepRequest) -> cpb.StepResponse:
        return self.stub.Step(request, timeout=self.timeout)


class Lease:
    """A lease on ``memory`` renewed in the background until :meth:`close`.

    When a keep-alive is refused because the memory service no longer knows the lease (reason
    LEASE_NOT_FOUND: it restarted) or it expired (LEASE_EXPIRED), renewing stops and :attr:`lost`
    holds that error; the engine then recovers with a new lease (client.recovery).
    """

    def __init__(self, memory: MemoryClient, ttl: float | None = None):
        self.memory = memory
        resp = memory.create_lease(ttl)
        self.lease_id = resp.lease_id
        self.ttl = resp.ttl_seconds
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
