"""Synchronous stubs for the two services, with typed errors and a kept-alive lease.

Each method is one RPC; ``grpc.RpcError`` becomes a :mod:`client.errors`
exception. :class:`Lease` renews itself from a daemon thread every third of
its TTL and is released on :meth:`Lease.close`; a client process that dies
stops renewing, and the memory service frees its sequences when the TTL runs out.

Credentials (memory_service/authz.py): :class:`MemoryClient` keeps the secret of
each lease it created and sends it (metadata ``pagedkv-lease-secret``) on every
call on that lease; given an admin token (:func:`read_admin_token`) it sends
``authorization: Bearer <token>`` on the admin calls (every lease's sequences,
ResetPrefixCache, CheckInvariants). Given the token's file for leases
(``lease_admin_token_file``, what ``pagedkv serve`` does), CreateLease carries the token too:
such a lease is exempt from the per-lease block quota and the limit of leases per peer.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import grpc

from client.errors import from_rpc_error
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.config import env
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA, default_admin_token_file
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles
from pagedkv.runtime.tls import channel as plane_channel

log = get_logger("client")

#: Message bounds; and reconnect backoff held to at most 1 s (gRPC's default grows to 120 s), so a
#: service that comes back at its address is reached again within a second (worker failover).
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]
#: Sequences asked for in each page of ListSequences (the service's default; at most 2,000).
LIST_PAGE_SIZE = 1000


def admin_token_path() -> Path:
    """Where the memory service on this host wrote its admin token: ``$PAGEDKV_ADMIN_TOKEN_FILE``,
    default ``$PAGEDKV_HOME/admin-token`` (the service's ``--admin-token-file`` default)."""
    return Path(env("PAGEDKV_ADMIN_TOKEN_FILE") or default_admin_token_file())


def read_admin_token(path: str | os.PathLike | None = None) -> str | None:
    """The admin token in ``path`` (default :func:`admin_token_path`), or None when there is no such file.

    Raises:
        PermissionError: the file exists but this user may not read it (it is mode 0600).
    """
    try:
        return Path(path or admin_token_path()).read_text().strip() or None
    except FileNotFoundError:
        return None


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that makes a call the admin's: ``authorization: Bearer <token>``."""
    return (("authorization", f"Bearer {token}"),)


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

    With ``tls`` (:class:`pagedkv.runtime.tls.TlsFiles`) the channel is mutual TLS: the server must present
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
    """The memory service at ``address`` (``host:port``).

    Args:
        address: ``host:port``.
        timeout: seconds per call.
        tls: mutual-TLS files (pagedkv.runtime.tls); None = plaintext (loopback only).
        admin_token: the service's admin token (:func:`read_admin_token`), for the admin calls;
            None = no admin rights (under TLS, an admin certificate gives them instead).
        lease_admin_token_file: the service's admin token file, read at each :meth:`create_lease`
            (a restarted service has a new token) so that the lease is the admin's: exempt from the
            per-lease block quota and the limit of leases per peer (``pagedkv serve``). None, an
            unreadable file or a token the service refuses: a plain lease (logged).

    Each lease created through :meth:`create_lease` has its secret kept here and sent
    on every call naming the lease; :meth:`add_lease` adds one created elsewhere.
    """

    def __init__(self, address: str, timeout: float = 30.0, tls: TlsFiles | None = None,
                 admin_token: str | None = None, lease_admin_token_file: str | os.PathLike | None = None):
        super().__init__(address, timeout, mpb_grpc.MemoryServiceStub, tls)
        self.admin_token = admin_token
        self.lease_admin_token_file = lease_admin_token_file
        self._secrets: dict[str, str] = {}  # lease id -> its secret

    def add_lease(self, lease_id: str, secret: str) -> None:
        """Send ``secret`` on the calls on ``lease_id`` from now on."""
        self._secrets[lease_id] = secret

    def _lease_md(self, lease_id: str | None) -> tuple[tuple[str, str], ...]:
        secret = self._secrets.get(lease_id) if lease_id else None
        return ((LEASE_SECRET_METADATA, secret),) if secret else ()

    def _admin_md(self) -> tuple[tuple[str, str], ...]:
        return _bearer(self.admin_token) if self.admin_token else ()

    @_typed
    def pool(self) -> mpb.PoolDescriptor:
        return self.stub.GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=self.timeout).pool

    def create_lease(self, ttl: float | None = None) -> mpb.CreateLeaseResponse:
        """A new lease (``ttl`` seconds; None: the service's default); its secret (``lease_secret``) is
        kept for the calls on it. With :attr:`lease_admin_token_file`, created with the admin token in
        it (``max_blocks`` 0: no block quota), else, or when the service refuses that token, a plain lease.

        Raises:
            client.errors.QuotaExceeded: the service's --max-leases, or this caller's --max-leases-per-peer.
            client.errors.ServiceError: any other refusal.
        """
        req = mpb.CreateLeaseRequest(ttl_seconds=ttl, owner=f"{socket.gethostname()}:{os.getpid()}")
        token = self._lease_admin_token()
        try:
            if token is not None:
                try:
                    resp = self.stub.CreateLease(req, timeout=self.timeout, metadata=_bearer(token))
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                        raise
                    log.warning("lease_admin_token_refused", file=str(self.lease_admin_token_file), error=e.details(),
                                effect="a plain lease: the per-lease block quota applies")
                    token = None
            if token is None:
                resp = self.stub.CreateLease(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self._secrets[resp.lease_id] = resp.lease_secret
        return resp

    def _lease_admin_token(self) -> str | None:
        """The token in :attr:`lease_admin_token_file` now, or None (no file given, or unreadable: logged)."""
        if self.lease_admin_token_file is None:
            return None
        try:
            token = read_admin_token(self.lease_admin_token_file)
        except OSError as e:
            token, why = None, str(e)
        else:
            why = "no such file, or empty"
        if token is None:
            log.info("lease_admin_token_unread", file=str(self.lease_admin_token_file), error=why,
                     effect="a plain lease: the per-lease block quota applies")
        return token

    @_typed
    def keep_alive(self, lease_id: str) -> float:
        return self.stub.KeepAlive(mpb.KeepAliveRequest(lease_id=lease_id), timeout=self.timeout,
                                   metadata=self._lease_md(lease_id)).expires_in_seconds

    @_typed
    def release_lease(self, lease_id: str) -> int:
        freed = self.stub.ReleaseLease(mpb.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.timeout,
                                       metadata=self._lease_md(lease_id)).freed_sequences
        self._secrets.pop(lease_id, None)
        return freed

    @_typed
    def allocate(self, lease_id: str, sequences: list[mpb.SequenceAllocation | int]) -> mpb.AllocateSequencesResponse:
        """Allocate sequences (token counts, or full ``SequenceAllocation`` messages for prefix caching);
        the reply has their block tables and grants."""
        seqs = [mpb.SequenceAllocation(num_tokens=s) if isinstance(s, int) else s for s in sequences]
        req = mpb.AllocateSequencesRequest(lease_id=lease_id, sequences=seqs)
        return self.stub.AllocateSequences(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def prefetch_prefix(self, lease_id: str, token_ids: list[int], model_id: str = "",
                        cache_salt: str = "") -> mpb.PrefetchPrefixResponse:
        """How much of a prompt is cached on the device, the host and the disk tier; the disk's blocks
        are queued to be read into the host tier (``disk_reads_pending``: not yet there)."""
        req = mpb.PrefetchPrefixRequest(lease_id=lease_id, token_ids=token_ids, model_id=model_id,
                                        cache_salt=cache_salt)
        return self.stub.PrefetchPrefix(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def take_disk_work(self, lease_id: str, max_copies: int = 16) -> mpb.TakeDiskWorkResponse:
        """The disk tier's queued copies, signed, for a worker's CopyDiskBlocks."""
        req = mpb.TakeDiskWorkRequest(lease_id=lease_id, max_copies=max_copies)
        return self.stub.TakeDiskWork(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def settle_disk_work(self, lease_id: str, receipts: list) -> int:
        """Hand in a worker's disk receipts (unchanged); returns how many settled taken work."""
        req = mpb.SettleDiskWorkRequest(lease_id=lease_id, receipts=receipts)
        return self.stub.SettleDiskWork(req, timeout=self.timeout, metadata=self._lease_md(lease_id)).settled

    @_typed
    def export_prefix(self, lease_id: str, token_ids: list[int], model_id: str = "",
                      cache_salt: str = "") -> mpb.ExportPrefixResponse:
        """Pin the prompt's cached leading blocks on this node for another node to read (a sequence
        of ``lease_id``; free it when done); the reply's ticket goes in that node's AllocateSequences."""
        req = mpb.ExportPrefixRequest(lease_id=lease_id, token_ids=token_ids, model_id=model_id, cache_salt=cache_salt)
        return self.stub.ExportPrefix(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def pin_prefix(self, lease_id: str, token_ids: list[int], *, ttl: float, priority: int = 0, model_id: str = "",
                   cache_salt: str = "", label: str = "") -> mpb.PrefixPin | None:
        """Keep the prompt's cached leading blocks resident for ``ttl`` seconds, charged to ``lease_id``,
        with retention ``priority`` (0-100) once unpinned; None when none is cached."""
        req = mpb.PinPrefixRequest(lease_id=lease_id, token_ids=token_ids, model_id=model_id, cache_salt=cache_salt,
                                   ttl_seconds=ttl, priority=priority, label=label)
        resp = self.stub.PinPrefix(req, timeout=self.timeout, metadata=self._lease_md(lease_id))
        return resp.pin if resp.HasField("pin") else None

    @_typed
    def unpin_prefix(self, lease_id: str, pin_id: str) -> int:
        """End a prefix pin of ``lease_id`` now; returns the blocks it held (they stay cached)."""
        req = mpb.UnpinPrefixRequest(lease_id=lease_id, pin_id=pin_id)
        return self.stub.UnpinPrefix(req, timeout=self.timeout, metadata=self._lease_md(lease_id)).num_blocks

    @_typed
    def list_pins(self) -> list[mpb.PrefixPin]:
        """Every live prefix pin (admin: the admin token, else the one in ``lease_admin_token_file``)."""
        md = self._admin_md()
        if not md and self.lease_admin_token_file is not None:
            token = read_admin_token(self.lease_admin_token_file)
            md = _bearer(token) if token else ()
        return list(self.stub.ListPins(mpb.ListPinsRequest(), timeout=self.timeout, metadata=md).pins)

    @_typed
    def append(self, lease_id: str, appends: list[tuple[int, int] | tuple[int, int, list[int]]],
               receipts: list = ()) -> mpb.AppendSlotsResponse:
        """Grow sequences by ``(seq_id, num_tokens[, token_ids])``; ``receipts`` (the last step's, unchanged)
        are taken first, as :meth:`commit` would take them."""
        req = mpb.AppendSlotsRequest(lease_id=lease_id, receipts=receipts, appends=[
            mpb.SlotAppend(seq_id=a[0], num_tokens=a[1], token_ids=a[2] if len(a) > 2 else ()) for a in appends])
        return self.stub.AppendSlots(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def commit(self, lease_id: str, receipts: list) -> mpb.CommitComputedTokensResponse:
        """Hand in workers' receipts (``StepResult.receipt``, unchanged); the reply has fresh grants."""
        req = mpb.CommitComputedTokensRequest(lease_id=lease_id, receipts=receipts)
        return self.stub.CommitComputedTokens(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def fork(self, lease_id: str, parents: list[int], proven_only: bool = False) -> mpb.ForkSequencesResponse:
        """Fork each parent; the reply has the children's block tables and grants. ``proven_only``:
        each child holds only its parent's proven tokens (a failover fork: SequenceFork.proven_only)."""
        req = mpb.ForkSequencesRequest(lease_id=lease_id, forks=[
            mpb.SequenceFork(parent_seq_id=p, proven_only=proven_only) for p in parents])
        return self.stub.ForkSequences(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def free(self, lease_id: str, seq_ids: list[int], reason: int = mpb.FREE_REASON_FINISHED) -> int:
        req = mpb.FreeSequencesRequest(lease_id=lease_id, seq_ids=seq_ids, reason=reason)
        return self.stub.FreeSequences(req, timeout=self.timeout, metadata=self._lease_md(lease_id)).freed_blocks

    @_typed
    def swap_out(self, lease_id: str, seq_ids: list[int]) -> mpb.SwapOutSequencesResponse:
        """Swap sequences out to the host tier, all or none (preemption by swap): they stay live but
        not runnable until :meth:`swap_in`.

        Raises:
            client.errors.OutOfHostBlocks: the host tier cannot hold their blocks now (nothing changed).
            client.errors.FailedPrecondition: reason HOST_TIER_OFF, the service has no host tier.
        """
        req = mpb.SwapOutSequencesRequest(lease_id=lease_id, seq_ids=seq_ids)
        return self.stub.SwapOutSequences(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def swap_in(self, lease_id: str, seq_ids: list[int],
                appends: list[tuple[int, int, list[int]]] = ()) -> mpb.SwapInSequencesResponse:
        """Bring swapped-out sequences back to the device, all or none, and grow them by ``appends``
        ``(seq_id, num_tokens, token_ids)`` (their next step's tokens) in the same call; the reply has
        their block tables (``num_tokens``: the slots each holds) and one grant each (whose copies
        reload what left the device, and offload what the call evicted: run the step on that grant).

        Raises:
            client.errors.OutOfBlocks: the device cannot hold them now (try again later).
            client.errors.FailedPrecondition: reason SWAP_LOST, a block's host copy was never made.
        """
        req = mpb.SwapInSequencesRequest(lease_id=lease_id, seq_ids=seq_ids, appends=[
            mpb.SlotAppend(seq_id=i, num_tokens=n, token_ids=t) for i, n, t in appends])
        return self.stub.SwapInSequences(req, timeout=self.timeout, metadata=self._lease_md(lease_id))

    @_typed
    def block_table(self, seq_id: int, lease_id: str | None = None) -> mpb.SequenceInfo:
        """Sequence ``seq_id``'s block table, read with the secret of ``lease_id`` (default: this client's only
        lease) and the admin token when there is one (needed for another lease's sequence)."""
        if lease_id is None and len(self._secrets) == 1:
            lease_id = next(iter(self._secrets))
        md = self._lease_md(lease_id) + self._admin_md()
        return self.stub.GetBlockTable(mpb.GetBlockTableRequest(seq_id=seq_id), timeout=self.timeout,
                                       metadata=md).sequence

    @_typed
    def sequences(self, lease_id: str | None = None, page_size: int = LIST_PAGE_SIZE) -> list[mpb.SequenceInfo]:
        """Every live sequence of ``lease_id`` (with its secret), or of every lease (None: needs the admin
        token), by id, read page by page."""
        md = self._lease_md(lease_id) + self._admin_md()
        out: list[mpb.SequenceInfo] = []
        token = ""
        while True:
            req = mpb.ListSequencesRequest(lease_id=lease_id, page_size=page_size, page_token=token)
            resp = self.stub.ListSequences(req, timeout=self.timeout, metadata=md)
            out.extend(resp.sequences)
            token = resp.next_page_token
            if not token:
                return out

    @_typed
    def stats(self) -> mpb.GetStatsResponse:
        return self.stub.GetStats(mpb.GetStatsRequest(), timeout=self.timeout)

    @_typed
    def reset_prefix_cache(self) -> int:
        """Drop every cached block (admin); returns blocks cleared."""
        return self.stub.ResetPrefixCache(mpb.ResetPrefixCacheRequest(), timeout=self.timeout,
                                          metadata=self._admin_md()).blocks_cleared

    @_typed
    def check_invariants(self) -> mpb.CheckInvariantsResponse:
        """The block manager's invariants checked now (admin)."""
        return self.stub.CheckInvariants(mpb.CheckInvariantsRequest(), timeout=self.timeout, metadata=self._admin_md())


class WorkerClient(_Channel):
    """A compute worker at ``address``."""

    def __init__(self, address: str, timeout: float = 600.0, tls: TlsFiles | None = None):
        super().__init__(address, timeout, cpb_grpc.ComputeServiceStub, tls)

    @_typed
    def model_info(self, timeout: float = 30.0) -> cpb.GetModelInfoResponse:
        return self.stub.GetModelInfo(cpb.GetModelInfoRequest(), timeout=timeout)

    @_typed
    def copy_disk_blocks(self, generation: int, copies) -> cpb.CopyDiskBlocksResponse:
        """Have the worker do disk-tier copies (TakeDiskWork's, unchanged); one receipt each."""
        return self.stub.CopyDiskBlocks(cpb.CopyDiskBlocksRequest(pool_generation=generation, copies=copies),
                                        timeout=self.timeout)

    @_typed
    def step(self, request: cpb.StepRequest) -> cpb.StepResponse:
        return self.stub.Step(request, timeout=self.timeout)

