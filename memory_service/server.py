"""The memory service's gRPC API (``pagedkv.memory.v1.MemoryService``).

Thin: each handler converts the request's protos to the block manager's typed
requests (:mod:`memory_service.requests`), calls the :class:`BlockManager`
(synchronously, on the event loop, so every call is atomic) and converts the
typed result back. Errors map to codes in one place (:func:`pagedkv.service.map_errors`).
"""

from __future__ import annotations

import asyncio

from memory_service.block_hash import CacheKey
from memory_service.block_manager import BlockManager
from memory_service.pool import Pool
from memory_service.prefix_cache import KvEvent
from memory_service.requests import Allocation, Append, OutOfBlocks
from memory_service.sequence import Sequence, SequenceInfo
from memory_service.step_grants import GrantSigner
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PermissionDeniedError
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.service import map_errors

log = get_logger("memory_service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MemoryService"].full_name


def _table(seq: Sequence) -> pb.SequenceBlockTable:
    return pb.SequenceBlockTable(seq_id=seq.seq_id, num_tokens=seq.num_tokens, block_ids=seq.block_ids,
                                 num_cached_tokens=seq.num_cached_tokens)


def _event(e: KvEvent) -> pb.KvEvent:
    if e.kind == "stored":
        return pb.KvEvent(sequence_number=e.sequence_number, block_stored=pb.BlockStored(
            block_hash=e.block_hash, parent_block_hash=e.parent_hash, block_id=e.block_id, token_ids=e.token_ids))
    if e.kind == "removed":
        return pb.KvEvent(sequence_number=e.sequence_number,
                          block_removed=pb.BlockRemoved(block_hash=e.block_hash, block_id=e.block_id))
    return pb.KvEvent(sequence_number=e.sequence_number, all_cleared=pb.AllBlocksCleared())


def _info(info: SequenceInfo) -> pb.SequenceInfo:
    return pb.SequenceInfo(seq_id=info.seq_id, lease_id=info.lease_id, num_tokens=info.num_tokens,
                           block_ids=info.block_ids, ref_counts=info.ref_counts, parent_seq_id=info.parent_seq_id)


def _ok(result, what: str):
    """Unwrap a block-manager result, turning :class:`OutOfBlocks` into its error."""
    if isinstance(result, OutOfBlocks):
        raise OutOfBlocksError(result.required, result.available, what)
    return result


@map_errors
class MemoryServicer(pb_grpc.MemoryServiceServicer):
    """Serves one :class:`BlockManager` over one :class:`Pool`; ``signer`` signs its grants."""

    def __init__(self, manager: BlockManager, pool: Pool, signer: GrantSigner):
        self.manager = manager
        self.pool = pool
        self.signer = signer

    def _grants(self, lease_id: str, seqs, copies=()) -> list:
        """Signed grants for ``seqs`` (valid for their lease's TTL); ``copies`` go to the sequence holding dst."""
        ttl = self.manager.leases.lookup(lease_id).ttl
        by_seq: dict[int, list] = {}
        for c in copies:
            by_seq.setdefault(c.seq_id, []).append(c)
        return [self.signer.grant(s, ttl, by_seq.get(s.seq_id, ())) for s in seqs]

    async def CreateLease(self, request, context):
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        lease = self.manager.leases.create(ttl, request.owner)
        return pb.CreateLeaseResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl)

    async def KeepAlive(self, request, context):
        return pb.KeepAliveResponse(expires_in_seconds=self.manager.leases.keep_alive(request.lease_id))

    async def ReleaseLease(self, request, context):
        return pb.ReleaseLeaseResponse(freed_sequences=self.manager.leases.release(request.lease_id))

    async def GetPoolDescriptor(self, request, context):
        return pb.GetPoolDescriptorResponse(pool=self.pool.descriptor())

    async def AllocateSequences(self, request, context):
        reqs = [Allocation(s.num_tokens, tuple(s.token_ids) if s.token_ids else None, CacheKey(s.model_id, s.cache_salt))
                for s in request.sequences]
        seqs = _ok(self.manager.allocate(request.lease_id, reqs), "allocation")
        return pb.AllocateSequencesResponse(sequences=[_table(s) for s in seqs], grants=self._grants(request.lease_id, seqs))

    async def AppendSlots(self, request, context):
        appends = [Append(a.seq_id, a.num_tokens, a.token_ids or None) for a in request.appends]
        result = _ok(self.manager.append_slots(request.lease_id, appends), "append")
        seqs = [self.manager.sequences[a.seq_id] for a in appends]
        return pb.AppendSlotsResponse(
            updates=[pb.BlockTableUpdate(seq_id=u.seq_id, num_tokens=u.num_tokens, first_changed=u.first_changed,
                                         block_ids=u.block_ids) for u in result.updates],
            copies=[pb.BlockCopy(src=c.src, dst=c.dst) for c in result.copies],
            grants=self._grants(request.lease_id, seqs, result.copies))

    async def ForkSequences(self, request, context):
        children = self.manager.fork(request.lease_id, [f.parent_seq_id for f in request.forks])
        return pb.ForkSequencesResponse(children=[_table(s) for s in children],
                                        grants=self._grants(request.lease_id, children))

    async def FreeSequences(self, request, context):
        if request.reason not in pb.FreeReason.values():
            raise InvalidArgumentError(f"unknown free reason {request.reason}")
        preempted = request.reason == pb.FREE_REASON_PREEMPTED
        freed = self.manager.free(request.lease_id, list(request.seq_ids), preempted=preempted)
        return pb.FreeSequencesResponse(freed_blocks=freed)

    async def GetBlockTable(self, request, context):
        return pb.GetBlockTableResponse(sequence=_info(self.manager.sequence_info(request.seq_id)))

    async def ListSequences(self, request, context):
        lease_id = request.lease_id if request.HasField("lease_id") else None
        return pb.ListSequencesResponse(sequences=[_info(s) for s in self.manager.sequence_infos(lease_id)])

    async def GetStats(self, request, context):
        s = self.manager.stats()
        return pb.GetStatsResponse(**{f: getattr(s, f) for f in s.__slots__}, generation=self.pool.generation)

    async def CommitComputedTokens(self, request, context):
        if request.sequences:
            raise PermissionDeniedError("CommitComputedTokens: computed tokens count only with a worker's receipt; "
                                        "send StepResult.receipt in `receipts` (nothing was committed)")
        receipts = self.signer.receipts(request.receipts)
        result = self.manager.commit_receipts(request.lease_id, receipts)
        return pb.CommitComputedTokensResponse(blocks_registered=result.blocks_registered, skipped=result.skipped,
                                               grants=self._grants(request.lease_id, result.accepted))

    async def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(blocks_cleared=self.manager.reset_prefix_cache())

    async def StreamKvEvents(self, request, context):
        """Server streaming: replay retained events from a sequence number, then follow."""
        first = request.from_sequence_number if request.HasField("from_sequence_number") else None
        cursor = self.manager.prefix_cache.subscribe(first)
        while True:
            for e in cursor.poll():
                yield _event(e)
            await asyncio.sleep(0.05)


async def expire_leases_forever(manager: BlockManager, period: float) -> None:
    """Background task: free the sequences of expired leases every ``period`` seconds."""
    while True:
        await asyncio.sleep(period)
        manager.leases.expire()


__all__ = ["MemoryServicer", "SERVICE_NAME", "expire_leases_forever"]
