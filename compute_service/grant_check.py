"""The worker's side of grants and receipts: check a step against its grants, sign what it computed.

DESIGN.md, "Trust model". Before a step reads or writes any KV, every sequence
in it must carry a grant signed with the plane key of the mapped pool's
generation, unexpired, for that sequence, whose blocks still have the epochs it
names in the pool's epoch table (a block freed and handed out anew has a new
epoch), and the step must stay inside it:

- block table == the grant's; positions start at ``readable_tokens`` (everything
  before is proven computed) and end by ``write_end``;
- with a token digest, the step writes exactly ``[readable_tokens, write_end)``
  with tokens of that digest;
- every copy-on-write copy of the request is one a grant of the step allows.

Anything else is PERMISSION_DENIED, raised before the first copy or write. After
the forward, :func:`sign_receipts` gives each sequence a receipt for the
positions written, their token digest and blocks; only with it does the memory
service count them as computed.

Residual window (docs/security.md): epochs are read at the check, not again at
the write; a block freed and handed out anew while a step over it is in flight
on the same worker is written by that step before its new owner's first write.
"""

from __future__ import annotations

import time

import numpy as np

from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.errors import PermissionDeniedError
from pagedkv.grant.v1 import grant_pb2
from pagedkv.grants import grant_signed, sign_receipt, token_digest


def _deny(what: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"Step refused, nothing was read or written: {what}; send each sequence with the "
                                 "grant of its latest memory-service reply, unchanged")


def check_grants(request: pb.StepRequest, key: bytes, generation: int, epochs: np.ndarray,
                 now: float | None = None) -> None:
    """Check every sequence and copy of ``request`` against the grants it carries.

    Args:
        request: a structurally valid step (``build_step_inputs`` accepted it).
        key: the plane key of the mapped pool's generation.
        generation: the mapped pool's generation.
        epochs: the pool's epoch table, int64 [num_blocks] (read-only view).
        now: Unix time, seconds (default: now).

    Raises:
        PermissionDeniedError: the first violation found.
    """
    now = time.time() if now is None else now
    allowed_copies: set[tuple[int, int]] = set()
    for s in request.sequences:
        if not s.HasField("grant"):
            raise _deny(f"sequence {s.seq_id} has no grant")
        g = s.grant
        if g.seq_id != s.seq_id or g.pool_generation != generation or not grant_signed(key, g):
            raise _deny(f"the grant of sequence {s.seq_id} is not the memory service's grant for it in pool "
                        f"generation {generation}")
        if g.expires_at < now:
            raise _deny(f"the grant of sequence {s.seq_id} expired {now - g.expires_at:.1f} s ago")
        start, end = s.positions[0], s.positions[-1] + 1
        if start != g.readable_tokens or end > g.write_end:
            raise _deny(f"sequence {s.seq_id} writes positions [{start}, {end}) but its grant allows "
                        f"[{g.readable_tokens}, {g.write_end}) after {g.readable_tokens} computed tokens")
        if list(s.block_ids) != list(g.block_ids):
            raise _deny(f"sequence {s.seq_id}'s block table is not the one its grant names")
        if g.token_digest and (end != g.write_end or token_digest(s.token_ids) != g.token_digest):
            raise _deny(f"sequence {s.seq_id}'s tokens are not the ones its grant names")
        if len(g.block_epochs) != len(g.block_ids) or not np.array_equal(epochs[list(g.block_ids)], g.block_epochs):
            raise _deny(f"a block of sequence {s.seq_id} was handed out anew since its grant")
        for c in g.copies:
            if epochs[c.src] != c.src_epoch or epochs[c.dst] != c.dst_epoch:
                raise _deny(f"copy {c.src} -> {c.dst} of sequence {s.seq_id} names a block handed out anew")
            allowed_copies.add((c.src, c.dst))
    for c in request.copies:
        if (c.src, c.dst) not in allowed_copies:
            raise _deny(f"copy {c.src} -> {c.dst} is in no grant of this step")


def sign_receipts(request: pb.StepRequest, results: list[pb.StepResult], key: bytes, block_size: int) -> None:
    """Attach to each result the signed receipt of what its sequence's step wrote (after :func:`check_grants`)."""
    for s, res in zip(request.sequences, results):
        g = s.grant
        start, end = s.positions[0], s.positions[-1] + 1
        first, last = start // block_size, -(-end // block_size)
        res.receipt.CopyFrom(sign_receipt(key, grant_pb2.StepReceipt(
            pool_generation=g.pool_generation, seq_id=s.seq_id, start=start, end=end,
            token_digest=token_digest(s.token_ids), block_ids=g.block_ids[first:last],
            block_epochs=g.block_epochs[first:last])))


__all__ = ["check_grants", "sign_receipts"]
