"""The memory service's gRPC API (``pagedkv.memory.v1.MemoryService``).

Thin: each handler validates the request shape, calls the :class:`BlockManager`
(synchronously, on the event loop, so every call is atomic) and converts the
result. Errors map to codes in one place (:func:`pagedkv.service.map_errors`).
"""

from __future__ import annotations

import asyncio

from memory_service.block_hash import CacheKey
from memory_service.block_manager import Allocation, BlockManager, OutOfBlocks
from memory_service.pool import Pool
from memory_service.prefix_cache import KvEvent
from memory_service.sequence import Sequence
from pagedkv.errors import FailedPreconditionError, InvalidArgumentError, OutOfBlocksError
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


def _ok(result, what: str):
    """Unwrap a block-manager result, turning :class:`OutOfBlocks` into its error."""
    if isinstance(result, OutOfBlocks):
        raise OutOfBlocksError(result.required, result.available, what)
    return result


@map_errors
class MemoryServicer(pb_grpc.MemoryServiceServicer):
    """Serves one :class:`BlockManager` over one :class:`Pool`."""

    def __init__(self, manager: BlockManager, pool: Pool):
        self.manager = manager
        self.pool = pool

    def _info(self, seq: Sequence) -> pb.SequenceInfo:
        rc = self.manager.pool.ref_counts
        return pb.SequenceInfo(
            seq_id=seq.seq_id,
            lease_id=seq.lease_id,
            num_tokens=seq.num_tokens,
            block_ids=seq.block_ids,
            ref_counts=[rc[b] for b in seq.block_ids],
            parent_seq_id=seq.parent_seq_id,
        )

    async def CreateLease(self, request, context):
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        lease = self.manager.create_lease(ttl, request.owner)
        return pb.CreateLeaseResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl)

    async def KeepAlive(self, request, context):
        return pb.KeepAliveResponse(expires_in_seconds=self.manager.keep_alive(request.lease_id))

    async def ReleaseLease(self, request, context):
        return pb.ReleaseLeaseResponse(freed_sequences=self.manager.release_lease(request.lease_id))

    async def GetPoolDescriptor(self, request, context):
        return pb.GetPoolDescriptorResponse(pool=self.pool.descriptor())

    async def AllocateSequences(self, request, context):
        reqs = [Allocation(s.num_tokens, tuple(s.token_ids) if s.token_ids else None, CacheKey(s.model_id, s.cache_salt))
                for s in request.sequences]
        seqs = _ok(self.manager.allocate(request.lease_id, reqs), "allocation")
        return pb.AllocateSequencesResponse(sequences=[_table(s) for s in seqs])

    async def AppendSlots(self, request, context):
        appends = [(a.seq_id, a.num_tokens, a.token_ids) for a in request.appends]
        live = self.manager.sequences
        # (length, last block) before the call, to report each table as a delta.
        before = {a[0]: (len(live[a[0]].block_ids), live[a[0]].block_ids[-1]) for a in appends if a[0] in live}
        seqs, copies = _ok(self.manager.append_slots(request.lease_id, appends), "append")
        updates = []
        for seq in seqs:
            old_len, old_last = before[seq.seq_id]
            first = old_len - 1 if seq.block_ids[old_len - 1] != old_last else old_len
            if first < len(seq.block_ids):  # only tables that changed go back
                updates.append(pb.BlockTableUpdate(
                    seq_id=seq.seq_id, num_tokens=seq.num_tokens, first_changed=first, block_ids=seq.block_ids[first:]))
        return pb.AppendSlotsResponse(updates=updates, copies=[pb.BlockCopy(src=s, dst=d) for s, d in copies])

    async def ForkSequences(self, request, context):
        children = self.manager.fork(request.lease_id, [f.parent_seq_id for f in request.forks])
        return pb.ForkSequencesResponse(children=[_table(s) for s in children])

    async def FreeSequences(self, request, context):
        if request.reason not in pb.FreeReason.values():
            raise InvalidArgumentError(f"unknown free reason {request.reason}")
        preempted = request.reason == pb.FREE_REASON_PREEMPTED
        freed = self.manager.free(request.lease_id, list(request.seq_ids), preempted=preempted)
        return pb.FreeSequencesResponse(freed_blocks=freed)

    async def GetBlockTable(self, request, context):
        return pb.GetBlockTableResponse(sequence=self._info(self.manager.get_sequence(request.seq_id)))

    async def ListSequences(self, request, context):
        lease_id = request.lease_id if request.HasField("lease_id") else None
        return pb.ListSequencesResponse(sequences=[self._info(s) for s in self.manager.list_sequences(lease_id)])

    async def GetStats(self, request, context):
        s = self.manager.stats()
        return pb.GetStatsResponse(**{f: getattr(s, f) for f in s.__slots__}, generation=self.pool.generation)

    async def CommitComputedTokens(self, request, context):
        registered, skipped = self.manager.commit_computed(
            request.lease_id, [(c.seq_id, c.num_computed_tokens) for c in request.sequences])
        return pb.CommitComputedTokensResponse(blocks_registered=registered, skipped=skipped)

    async def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(blocks_cleared=self.manager.reset_prefix_cache())

    async def StreamKvEvents(self, request, context):
        """Server streaming: replay retained events from a sequence number, then follow."""
        events = self.manager.prefix_cache.events
        if request.HasField("from_sequence_number"):
            nxt = request.from_sequence_number
            oldest = events[0].sequence_number if events else nxt
            if nxt < oldest:
                raise FailedPreconditionError(
                    f"events before {oldest} are no longer retained; resubscribe from {oldest} and resync the cache")
        else:
            nxt = events[-1].sequence_number + 1 if events else 1
        while True:
            if events and events[-1].sequence_number >= nxt:
                start = nxt - events[0].sequence_number
                for e in list(events)[max(0, start):]:
                    yield _event(e)
                nxt = events[-1].sequence_number + 1
            await asyncio.sleep(0.05)


async def expire_leases_forever(manager: BlockManager, period: float) -> None:
    """Background task: free the sequences of expired leases every ``period`` seconds."""
    while True:
        await asyncio.sleep(period)
        manager.expire_leases()


__all__ = ["MemoryServicer", "SERVICE_NAME", "expire_leases_forever"]
