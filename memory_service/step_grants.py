"""The memory service's side of grants and receipts: sign what a sequence's next step may touch, check receipts.

DESIGN.md, "Trust model". A grant for a sequence says: its whole block table
with each block's allocation epoch, the positions proven computed (readable),
the positions it may write next (``[readable_tokens, write_end)``, i.e. up to
the slots it holds) with the digest of their token ids when known, the
copy-on-write copies it may do, and an expiry within its lease's TTL. The
signing key is the pool generation's plane key, which only workers receive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import numpy as np

from memory_service.manager.requests import BlockCopy, Receipt
from memory_service.manager.sequence import Sequence
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import PermissionDeniedError
from pagedkv.runtime.grants import (
    copy_tuple,
    disk_signed,
    grant_parts_message,
    granted_copy,
    mac,
    receipt_signed,
    sign_disk,
    token_digest,
)

#: ``pagedkv.grant.v1.Medium`` of another node's pool.
REMOTE = grant_pb2.MEDIUM_REMOTE


#: Seconds a disk copy's grant is valid (the memory service drops taken work after DISK_WORK_TIMEOUT).
DISK_COPY_TTL = 30.0


class GrantSigner:
    """Signs grants and checks receipts for one pool generation.

    Args:
        key: the plane key (pagedkv.runtime.grants.KEY_BYTES bytes).
        generation: the pool generation grants name.
        epochs: the pool's epoch table, int64 [num_blocks] (read when signing).
        wall_clock: Unix time in seconds (grant expiry is wall time: workers compare it with theirs).
        host_epochs: the host tier's epochs, int64 [host_num_blocks], or None (no host tier).
    """

    def __init__(self, key: bytes, generation: int, epochs: np.ndarray,
                 wall_clock: Callable[[], float] = time.time, host_epochs: np.ndarray | None = None):
        self.key = key
        self.generation = generation
        self.epochs = epochs
        self.wall_clock = wall_clock
        #: The host tier's epochs (the host part of the pool's epoch table), when it has one.
        self.host_epochs = host_epochs

    def grant(self, seq: Sequence, ttl: float, copies: Iterable[BlockCopy] = ()) -> grant_pb2.StepGrant:
        """The signed grant for ``seq``'s next step, valid for ``ttl`` seconds (its lease's TTL)."""
        readable, end = seq.num_proven, seq.num_tokens
        toks = seq.token_ids
        digest = token_digest(toks[readable:end]) if toks is not None and len(toks) >= end > readable else b""
        ep = self.epochs
        ids = seq.block_ids
        epochs = ep[ids].tolist()
        host = self.host_epochs
        copied = [(c.src, c.src_epoch if c.src_medium == REMOTE else int((host if c.src_medium else ep)[c.src]),
                   c.dst, int((host if c.dst_medium else ep)[c.dst]), c.src_medium, c.dst_medium, c.source)
                  for c in copies]
        expires = self.wall_clock() + ttl
        # Signed from the fields (not read back out of the message): this runs once per sequence per step.
        signature = mac(self.key, grant_parts_message(self.generation, seq.seq_id, ids, epochs, readable, end,
                                                       digest, copied, expires))
        return grant_pb2.StepGrant(
            pool_generation=self.generation, seq_id=seq.seq_id, block_ids=ids, block_epochs=epochs,
            readable_tokens=readable, write_end=end, token_digest=digest, expires_at=expires, signature=signature,
            copies=[granted_copy(t) for t in copied])

    def receipts(self, msgs: Seq[grant_pb2.StepReceipt]) -> list[Receipt]:
        """Check every receipt's signature and generation; returns them typed.

        Raises:
            PermissionDeniedError: a receipt not signed with this generation's plane key (nothing
                of the call is applied), or of another pool generation.
        """
        out = []
        for r in msgs:
            if r.pool_generation != self.generation or not receipt_signed(self.key, r):
                raise PermissionDeniedError(
                    f"CommitComputedTokens: the receipt for sequence {r.seq_id} is not a worker's receipt for pool "
                    f"generation {self.generation}; hand in StepResult.receipt unchanged (nothing was committed)")
            if len(r.block_ids) != len(r.block_epochs):
                raise PermissionDeniedError(f"CommitComputedTokens: the receipt for sequence {r.seq_id} is malformed")
            out.append(Receipt(r.seq_id, r.start, r.end, bytes(r.token_digest), tuple(r.block_ids),
                               tuple(r.block_epochs), tuple(copy_tuple(c) for c in r.copies)))
        return out

    def disk_copy(self, w, ttl: float = DISK_COPY_TTL) -> grant_pb2.DiskCopy:
        """The signed grant of disk work ``w`` (:class:`memory_service.tiers.disk_traffic.DiskWork`),
        valid for ``ttl`` seconds."""
        return sign_disk(self.key, grant_pb2.DiskCopy(
            pool_generation=self.generation, work_id=w.work_id, write=w.kind == "write", host_block=w.host,
            host_epoch=w.host_epoch, slot=w.slot, slot_epoch=w.slot_epoch, block_hash=w.block_hash,
            parent_hash=w.parent, token_ids=w.tokens, sequence=w.sequence, expires_at=self.wall_clock() + ttl))

    def disk_receipts(self, msgs: Seq[grant_pb2.DiskReceipt]) -> list[tuple[int, bool | None]]:
        """Check every disk receipt's signature and generation; returns ``(work_id, ok)`` each: True
        done, False failed on the slot's bytes or the file (header, checksum, io), None not done
        (refused: a stale or expired grant).

        Raises:
            PermissionDeniedError: a receipt not signed with this generation's plane key, or of another
                generation (nothing of the call is applied).
        """
        out = []
        for r in msgs:
            if r.pool_generation != self.generation or not disk_signed(self.key, r):
                raise PermissionDeniedError(
                    f"SettleDiskWork: the receipt for disk work {r.work_id} is not a worker's receipt for pool "
                    f"generation {self.generation}; hand in CopyDiskBlocksResponse.receipts unchanged (nothing was "
                    "settled)")
            out.append((r.work_id, True if r.ok else None if r.failure == "refused" else False))
        return out


__all__ = ["DISK_COPY_TTL", "GrantSigner"]
