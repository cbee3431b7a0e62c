"""The memory service's gRPC API (``pagedkv.memory.v1.MemoryService``).

Thin: each handler converts the request's protos to the block manager's typed
requests (:mod:`memory_service.manager.requests`), calls the :class:`BlockManager`
(synchronously, on the event loop, so every call is atomic) and converts the
typed result back. Errors map to codes in one place (:func:`pagedkv.runtime.service.map_errors`).
Each handler's first line checks the caller's right to make the call
(:mod:`memory_service.authz` has the table), before anything changes.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from memory_service.authz import ROUTER, SCHEDULER, WORKER, Authorizer
from memory_service.event_stream import stream_events
from memory_service.leases import Lease
from memory_service.manager.block_manager import RELEASE_CHUNK_BLOCKS, BlockManager
from memory_service.manager.paging import decode_page_token, encode_page_token, page_size
from memory_service.manager.requests import Allocation, Append, BlockCopy, OutOfBlocks, check_batch, check_request_size
from memory_service.manager.sequence import Sequence, SequenceInfo
from memory_service.peers import peer_identity
from memory_service.pin_rpcs import PinRpcs
from memory_service.pool import Pool
from memory_service.step_grants import GrantSigner
from memory_service.transfers import NodeTransfers
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfBlocksError,
    PermissionDeniedError,
)
from pagedkv.runtime.kv_scales import sign_scales
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.service import map_errors
from pagedkv.runtime.tls import require_role

log = get_logger("memory_service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MemoryService"].full_name


def _table(seq: Sequence) -> pb.SequenceBlockTable:
    return pb.SequenceBlockTable(seq_id=seq.seq_id, num_tokens=seq.num_tokens, block_ids=seq.block_ids,
                                 num_cached_tokens=seq.num_cached_tokens, num_reloaded_tokens=seq.num_reloaded_tokens,
                                 num_transferred_tokens=seq.num_transferred_tokens)


def _copy(c: BlockCopy) -> pb.BlockCopy:
    return pb.BlockCopy(src=c.src, dst=c.dst, src_medium=c.src_medium, dst_medium=c.dst_medium, seq_id=max(c.seq_id, 0))


def _info(info: SequenceInfo, with_lease_id: bool) -> pb.SequenceInfo:
    """The snapshot as sent; its lease id only when ``with_lease_id`` (the admin)."""
    return pb.SequenceInfo(seq_id=info.seq_id, lease_id=info.lease_id if with_lease_id else "",
                           num_tokens=info.num_tokens, block_ids=info.block_ids, ref_counts=info.ref_counts,
                           parent_seq_id=info.parent_seq_id, media=info.media, swapped=info.swapped)


def _ok(result, what: str):
    """Unwrap a block-manager result, turning :class:`OutOfBlocks` into its error."""
    if isinstance(result, OutOfBlocks):
        raise OutOfBlocksError(result.required, result.available, what)
    return result


def _worker_order(copies: list[BlockCopy]) -> list[BlockCopy]:
    """Copies in the order a worker does them: offloads, reloads, copy-on-write (DESIGN.md)."""
    return sorted(copies, key=lambda c: (0 if c.dst_medium else 1 if c.src_medium else 2))


@map_errors
class MemoryServicer(PinRpcs, pb_grpc.MemoryServiceServicer):
    """Serves one :class:`BlockManager` over one :class:`Pool`; ``signer`` signs its grants.

    ``admin_token``: the loopback admin credential (None: admin only by TLS certificate);
    ``admin_token_file``: where it was written (named in refusals); ``transfers``: this node's side of
    node transfers (default: a node named ``pool.pool_id`` without a transfer key, taking no part).
    """

    def __init__(self, manager: BlockManager, pool: Pool, signer: GrantSigner, *, admin_token: str | None = None,
                 admin_token_file: str | None = None, transfers: NodeTransfers | None = None):
        self.manager = manager
        self.pool = pool
        self.signer = signer
        self.transfers = transfers or NodeTransfers(pool.pool_id, pool.descriptor(), None)
        self.authz = Authorizer(manager.leases, admin_token, admin_token_file)

    def _grants(self, lease: Lease, seqs, copies=(), tier_copies: list | None = None) -> list:
        """Signed grants for ``seqs`` (valid for ``lease``'s TTL, the lease authorized at the call's
        start: no second lookup after the change); ``copies`` (copy-on-write) go to the sequence
        holding dst, after each sequence's tier copies (:meth:`Tiers.grant_copies`), which are also
        appended to ``tier_copies`` when given."""
        ttl = lease.ttl
        by_seq: dict[int, list] = {}
        for c in copies:
            by_seq.setdefault(c.seq_id, []).append(c)
        tiers = self.manager.tiers
        out = []
        for s in seqs:
            tier = tiers.grant_copies(s)
            if tier_copies is not None:
                tier_copies += tier
            out.append(self.signer.grant(s, ttl, [*tier, *by_seq.get(s.seq_id, ())]))
        return out

    async def CreateLease(self, request, context):
        """A lease of the caller: the admin's is exempt from the block quota and the limit per peer
        (:mod:`memory_service.quotas`); a bad admin token is refused, not taken for no token."""
        require_role(context, {SCHEDULER}, "CreateLease")  # routers and workers hold no leases
        admin = self.authz.caller(context).is_admin
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        peer = "" if admin or self.manager.leases.max_leases_per_peer is None else peer_identity(context)
        lease, secret = self.manager.leases.open(ttl, request.owner, peer=peer, exempt=admin)
        return pb.CreateLeaseResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl, lease_secret=secret,
                                      max_blocks=self.manager.block_quota(lease) or 0)

    async def KeepAlive(self, request, context):
        self.authz.lease(context, request.lease_id)
        return pb.KeepAliveResponse(expires_in_seconds=self.manager.leases.keep_alive(request.lease_id))

    async def ReleaseLease(self, request, context):
        self.authz.lease(context, request.lease_id)
        return pb.ReleaseLeaseResponse(freed_sequences=self.manager.leases.release(request.lease_id))

    async def GetPoolDescriptor(self, request, context):
        d = self.pool.descriptor()
        d.node_name = self.transfers.node_name
        d.transfer_sources.extend(self.transfers.sources.values())
        return pb.GetPoolDescriptorResponse(pool=d)

    async def PublishTransferSource(self, request, context):
        require_role(context, {WORKER}, "PublishTransferSource")
        self.transfers.publish(request, self.pool.plane_key)
        return pb.PublishTransferSourceResponse()

    async def SetKvScales(self, request, context):
        require_role(context, {WORKER}, "SetKvScales")
        if request.pool_generation != self.pool.generation:
            raise FailedPreconditionError(f"SetKvScales: pool generation {request.pool_generation} is not this pool's "
                                          f"({self.pool.generation}); map the pool again")
        if not hmac.compare_digest(request.signature, sign_scales(self.pool.plane_key, request.pool_generation,
                                                                  request.scales)):
            raise PermissionDeniedError("SetKvScales: the signature is not made with this pool generation's plane "
                                        "key; only a worker that maps the pool may set its scales")
        kept, accepted = self.pool.set_kv_scales(request.scales)
        return pb.SetKvScalesResponse(scales=kept, accepted=accepted)

    async def ExportPrefix(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        self.transfers.require_export()  # before pinning anything
        seq = self.manager.export_prefix(request.lease_id, request.token_ids,
                                         CacheKey(request.model_id, request.cache_salt))
        if seq is None:
            return pb.ExportPrefixResponse()
        try:
            ticket = self.transfers.ticket(seq, lease.ttl, self.manager.pool.epochs)
        except BaseException:
            self.manager.free(request.lease_id, [seq.seq_id])  # no ticket, no pin
            raise
        return pb.ExportPrefixResponse(num_tokens=seq.num_tokens, seq_id=seq.seq_id, ticket=ticket)

    async def AllocateSequences(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        check_request_size(request.sequences, "AllocateSequences")  # before the work of converting it
        reqs = [Allocation(s.num_tokens, tuple(s.token_ids) if s.token_ids else None,
                           CacheKey(s.model_id, s.cache_salt),
                           self.transfers.take(s.remote_prefix) if s.HasField("remote_prefix") else None)
                for s in request.sequences]
        seqs = _ok(self.manager.allocate(request.lease_id, reqs), "allocation")
        tier: list = []
        grants = self._grants(lease, seqs, tier_copies=tier)
        return pb.AllocateSequencesResponse(sequences=[_table(s) for s in seqs], grants=grants,
                                            copies=[_copy(c) for c in _worker_order(tier)])

    async def AppendSlots(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        check_request_size(request.appends, "AppendSlots")
        appends = [Append(a.seq_id, a.num_tokens, a.token_ids or None) for a in request.appends]
        committed = []  # the last step's commit, taken once the appends fit (a refused call takes none)
        take = None
        if request.receipts:
            check_batch(len(request.receipts), "AppendSlots receipts")
            receipts = self.signer.receipts(request.receipts)  # forged ones refuse the call first
            take = lambda: committed.append(self.manager.commit_receipts(request.lease_id, receipts))  # noqa: E731
        result = _ok(self.manager.append_slots(request.lease_id, appends, take), "append")
        seqs = [self.manager.sequences[a.seq_id] for a in appends]
        tier: list = []
        grants = self._grants(lease, seqs, result.copies, tier)
        out = pb.AppendSlotsResponse(
            updates=[pb.BlockTableUpdate(seq_id=u.seq_id, num_tokens=u.num_tokens, first_changed=u.first_changed,
                                         block_ids=u.block_ids) for u in result.updates],
            copies=[_copy(c) for c in _worker_order([*tier, *result.copies])], grants=grants)
        if committed:
            (done,) = committed
            appended = {a.seq_id for a in appends}
            out.blocks_registered, out.receipts_skipped = done.blocks_registered, done.skipped
            out.committed_grants.extend(self._grants(lease, [s for s in done.accepted if s.seq_id not in appended]))
        return out

    async def ForkSequences(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        forks = request.forks
        children = self.manager.fork(request.lease_id, [f.parent_seq_id for f in forks], [f.proven_only for f in forks])
        return pb.ForkSequencesResponse(children=[_table(s) for s in children], grants=self._grants(lease, children))

    async def FreeSequences(self, request, context):
        self.authz.lease(context, request.lease_id)
        if request.reason not in pb.FreeReason.values():
            raise InvalidArgumentError(f"unknown free reason {request.reason}")
        preempted = request.reason == pb.FREE_REASON_PREEMPTED
        freed = self.manager.free(request.lease_id, list(request.seq_ids), preempted=preempted)
        return pb.FreeSequencesResponse(freed_blocks=freed)

    async def SwapOutSequences(self, request, context):
        self.authz.lease(context, request.lease_id)
        released, reserved = self.manager.swap_out(request.lease_id, list(request.seq_ids))
        return pb.SwapOutSequencesResponse(device_blocks_released=released, host_blocks_reserved=reserved)

    async def SwapInSequences(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        if request.appends:  # before the work of converting them
            check_request_size(request.appends, "SwapInSequences")
        appends = [Append(a.seq_id, a.num_tokens, a.token_ids or None) for a in request.appends]
        seqs, appended = _ok(self.manager.swap_in(request.lease_id, list(request.seq_ids), appends), "swap-in")
        tier: list = []
        cow = appended.copies if appended is not None else []
        grants = self._grants(lease, seqs, cow, tier)
        return pb.SwapInSequencesResponse(sequences=[_table(s) for s in seqs], grants=grants,
                                          copies=[_copy(c) for c in _worker_order([*tier, *cow])])

    async def LookupPrefix(self, request, context):
        self.authz.require_router(context, "LookupPrefix")
        device, host = self.manager.lookup_prefix(request.token_ids, CacheKey(request.model_id, request.cache_salt))
        return pb.LookupPrefixResponse(cached_tokens=device + host, device_tokens=device, host_tokens=host)

    async def PrefetchPrefix(self, request, context):
        self.authz.lease(context, request.lease_id)
        key = CacheKey(request.model_id, request.cache_salt)
        device, host, disk, pending = self.manager.prefetch_prefix(list(request.token_ids), key)
        return pb.PrefetchPrefixResponse(device_tokens=device, host_tokens=host, disk_tokens=disk,
                                         disk_reads_pending=pending)

    async def TakeDiskWork(self, request, context):
        self.authz.lease(context, request.lease_id)
        tiers = self.manager.tiers
        now = self.manager.leases.clock()
        if tiers.disk is None:
            return pb.TakeDiskWorkResponse()
        tiers.expire_disk_work(now)
        work = tiers.take_disk_work(min(request.max_copies or 16, 256), now)
        return pb.TakeDiskWorkResponse(copies=[self.signer.disk_copy(w) for w in work])

    async def SettleDiskWork(self, request, context):
        self.authz.lease(context, request.lease_id)
        check_batch(len(request.receipts), "SettleDiskWork receipts")
        settled = self.signer.disk_receipts(request.receipts)  # a forged one refuses the call first
        tiers = self.manager.tiers
        done = sum(tiers.settle_disk_work(work_id, ok) for work_id, ok in settled) if tiers.disk is not None else 0
        return pb.SettleDiskWorkResponse(settled=done)

    async def GetBlockTable(self, request, context):
        caller, seq = self.authz.read_sequence(context, request.seq_id, self.manager.get_sequence)
        return pb.GetBlockTableResponse(sequence=_info(self.manager.sequence_info(seq.seq_id), caller.is_admin))

    async def ListSequences(self, request, context):
        """One page of sequences by id: a lease's (with its secret, or as the admin), or every lease's (admin)."""
        lease_id = request.lease_id if request.HasField("lease_id") else None
        if lease_id is None:
            caller = self.authz.require_admin(context, "ListSequences without lease_id (every lease's sequences)")
        elif not (caller := self.authz.caller(context)).is_admin:
            self.authz.lease(context, lease_id)
        limit, start = page_size(request.page_size), decode_page_token(request.page_token)
        infos, next_id = self.manager.sequence_page(lease_id, start, limit)
        return pb.ListSequencesResponse(sequences=[_info(s, caller.is_admin) for s in infos],
                                        next_page_token=encode_page_token(next_id))

    async def GetStats(self, request, context):
        return self._stats()

    def _stats(self) -> pb.GetStatsResponse:
        s = self.manager.stats()
        lay = self.pool.layout
        fields = {f: getattr(s, f) for f in s.__slots__}
        disk = fields.pop("disk")
        if disk is not None:
            fields["disk"] = pb.DiskTierStats(**{k.removeprefix("disk_"): v for k, v in disk.items()})
        fields["pins"] = pb.PinStats(**fields["pins"])
        return pb.GetStatsResponse(**fields, generation=self.pool.generation,
                                   kv_cache_dtype=lay.dtype.name, kv_bytes_per_token=lay.block_nbytes // lay.block_size,
                                   token_capacity=lay.num_blocks * lay.block_size, pool_bytes=lay.nbytes,
                                   sizing=self.pool.sizing)

    async def CheckInvariants(self, request, context):
        """Assert the block manager's invariants now (admin); a broken one is reported, not raised."""
        self.authz.require_admin(context, "CheckInvariants")
        try:
            self.manager.check_invariants()
        except AssertionError as e:
            log.error("invariant_broken", method="CheckInvariants", error=str(e))
            return pb.CheckInvariantsResponse(ok=False, violation=str(e) or repr(e), stats=self._stats())
        return pb.CheckInvariantsResponse(ok=True, stats=self._stats())

    async def CommitComputedTokens(self, request, context):
        lease = self.authz.lease(context, request.lease_id)
        if request.sequences:
            raise PermissionDeniedError("CommitComputedTokens: computed tokens count only with a worker's receipt; "
                                        "send StepResult.receipt in `receipts` (nothing was committed)")
        receipts = self.signer.receipts(request.receipts)
        result = self.manager.commit_receipts(request.lease_id, receipts)
        return pb.CommitComputedTokensResponse(blocks_registered=result.blocks_registered, skipped=result.skipped,
                                               grants=self._grants(lease, result.accepted))

    async def ResetPrefixCache(self, request, context):
        self.authz.require_admin(context, "ResetPrefixCache (it drops every lease's cached blocks)")
        steps, t = self.manager.reset_prefix_cache_steps(RESET_CHUNK_BLOCKS), time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return pb.ResetPrefixCacheResponse(blocks_cleared=done.value)
            # Rest between steps as long as the step took (as the release drain does): a waiting call
            # needs several loop turns, and gRPC's poller thread the GIL, to be answered.
            await asyncio.sleep(max(0.001, time.perf_counter() - t))
            t = time.perf_counter()

    async def StreamKvEvents(self, request, context):
        """Server streaming: replay retained events from a sequence number, then follow.

        Every event in order, sent as soon as it is logged (the stream wakes on each event, no
        polling); a subscriber that falls more than the retained window behind, or asks for an
        event no longer kept, ends with FAILED_PRECONDITION naming the first number it lost; one
        past the next event to be logged is OUT_OF_RANGE at once (:mod:`memory_service.event_stream`).
        Token ids only for the admin role (routers get hashes and block ids). Under TLS only the
        router role (and the admin) may subscribe: the stream tells which prefixes are cached.
        """
        require_role(context, {ROUTER}, "StreamKvEvents")
        with_token_ids = self.authz.caller(context).is_admin
        first = request.from_sequence_number if request.HasField("from_sequence_number") else None
        async for event in stream_events(self.manager.prefix_cache, first, with_token_ids):
            yield event


#: Cached blocks ResetPrefixCache drops per turn of the event loop (~1.3 us each: ~10 ms a turn).
RESET_CHUNK_BLOCKS = 8192


async def expire_leases_forever(manager: BlockManager, period: float) -> None:
    """Background task: expire leases every ``period`` seconds; return released blocks in chunks.

    Keep-alives are never starved (:mod:`memory_service.leases`): the lease table is told the
    sweep's period, so a later wake-up (the process paused, a long call on the loop) is credited
    to every lease and nothing expires for one more period, while the keep-alives that queued
    meanwhile are served; the sweep also yields to the loop before each expiry so RPCs already
    received run first. Blocks of dropped leases return to the pool
    :data:`~memory_service.manager.block_manager.RELEASE_CHUNK_BLOCKS` references at a time, with a
    rest as long as each chunk took between chunks (at most half the loop's time).
    """
    leases = manager.leases
    leases.watch_stalls(period)
    wake = asyncio.Event()
    manager.on_releasing = wake.set

    async def drain() -> None:
        while True:
            await wake.wait()
            wake.clear()
            while True:
                t = time.perf_counter()
                if not manager.drain_released(RELEASE_CHUNK_BLOCKS):
                    break
                # Rest as long as the chunk took: a call needs several loop turns (and gRPC's
                # poller thread the GIL) to be answered, which one bare yield does not give.
                await asyncio.sleep(max(0.001, time.perf_counter() - t))

    drainer = asyncio.create_task(drain())
    try:
        while True:
            await asyncio.sleep(period)
            await asyncio.sleep(0)  # calls received meanwhile (keep-alives) run before the sweep
            leases.expire()
            manager.expire_pins()
    finally:
        drainer.cancel()
        manager.on_releasing = None


__all__ = ["MemoryServicer", "SERVICE_NAME", "expire_leases_forever"]
