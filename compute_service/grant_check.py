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

import hmac
import time
from dataclasses import dataclass

import numpy as np

from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.errors import PermissionDeniedError
from pagedkv.grants import copy_tuple, grant_parts_message, mac, receipt_parts_message, token_digest


def _deny(what: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"Step refused, nothing was read or written: {what}; send each sequence with the "
                                 "grant of its latest memory-service reply, unchanged")


@dataclass(slots=True)
class Checked:
    """What :func:`check_grants` read of one sequence's grant, for :func:`sign_receipts`."""

    block_ids: list[int]  # the grant's (== the step's) block table
    block_epochs: list[int]  # their epochs, as granted (== the pool's at the check)
    token_digest: bytes  # digest of the step's token ids (the grant's when it names one: checked equal)


def check_grants(request: pb.StepRequest, key: bytes, generation: int, epochs: np.ndarray,
                 now: float | None = None) -> list[Checked]:
    """Check every sequence and copy of ``request`` against the grants it carries.

    The epochs of every sequence's blocks are compared with the pool's in one numpy call after
    the per-sequence checks (a violation there names the first sequence whose epochs differ).

    Args:
        request: a structurally valid step (``build_step_inputs`` accepted it).
        key: the plane key of the mapped pool's generation.
        generation: the mapped pool's generation.
        epochs: the pool's epoch table, int64 [num_blocks] (read-only view).
        now: Unix time, seconds (default: now).

    Returns:
        per sequence, in batch order, what :func:`sign_receipts` signs for it.

    Raises:
        PermissionDeniedError: the first violation found.
    """
    now = time.time() if now is None else now
    allowed_copies: set[tuple[int, int]] = set()
    checked: list[Checked] = []
    all_ids: list[int] = []
    all_epochs: list[int] = []
    for s in request.sequences:
        if not s.HasField("grant"):
            raise _deny(f"sequence {s.seq_id} has no grant")
        g = s.grant
        ids, ep = list(g.block_ids), list(g.block_epochs)
        copies = [copy_tuple(c) for c in g.copies]
        digest = g.token_digest
        expires = g.expires_at
        if g.seq_id != s.seq_id or g.pool_generation != generation or not hmac.compare_digest(
                g.signature, mac(key, grant_parts_message(generation, g.seq_id, ids, ep, g.readable_tokens, g.write_end,
                                                          digest, copies, expires))):
            raise _deny(f"the grant of sequence {s.seq_id} is not the memory service's grant for it in pool "
                        f"generation {generation}")
        if expires < now:
            raise _deny(f"the grant of sequence {s.seq_id} expired {now - expires:.1f} s ago")
        start, end = s.positions[0], s.positions[-1] + 1
        if start != g.readable_tokens or end > g.write_end:
            raise _deny(f"sequence {s.seq_id} writes positions [{start}, {end}) but its grant allows "
                        f"[{g.readable_tokens}, {g.write_end}) after {g.readable_tokens} computed tokens")
        if list(s.block_ids) != ids:
            raise _deny(f"sequence {s.seq_id}'s block table is not the one its grant names")
        if digest:
            if end != g.write_end or token_digest(s.token_ids) != digest:
                raise _deny(f"sequence {s.seq_id}'s tokens are not the ones its grant names")
        else:
            digest = token_digest(s.token_ids)
        if len(ep) != len(ids):
            raise _deny(f"a block of sequence {s.seq_id} was handed out anew since its grant")
        for src, src_epoch, dst, dst_epoch, _, _ in copies:
            if epochs[src] != src_epoch or epochs[dst] != dst_epoch:
                raise _deny(f"copy {src} -> {dst} of sequence {s.seq_id} names a block handed out anew")
            allowed_copies.add((src, dst))
        all_ids += ids
        all_epochs += ep
        checked.append(Checked(ids, ep, digest))
    if not np.array_equal(epochs[all_ids], np.array(all_epochs, dtype=np.int64)):
        for s, c in zip(request.sequences, checked):
            if not np.array_equal(epochs[c.block_ids], np.array(c.block_epochs, dtype=np.int64)):
                raise _deny(f"a block of sequence {s.seq_id} was handed out anew since its grant")
    for c in request.copies:
        if (c.src, c.dst) not in allowed_copies:
            raise _deny(f"copy {c.src} -> {c.dst} is in no grant of this step")
    return checked


def sign_receipts(request: pb.StepRequest, results: list[pb.StepResult], key: bytes, block_size: int,
                  checked: list[Checked] | None = None) -> None:
    """Attach to each result the signed receipt of what its sequence's step wrote (after :func:`check_grants`;
    ``checked``: its return value, read instead of the grants again)."""
    seqs = request.sequences
    if checked is None:
        checked = [Checked(list(s.grant.block_ids), list(s.grant.block_epochs), token_digest(s.token_ids))
                   for s in seqs]
    for s, c, res in zip(seqs, checked, results):
        start, end = s.positions[0], s.positions[-1] + 1
        first, last = start // block_size, -(-end // block_size)
        ids, ep = c.block_ids[first:last], c.block_epochs[first:last]
        generation = s.grant.pool_generation
        r = res.receipt
        r.pool_generation, r.seq_id, r.start, r.end, r.token_digest = generation, s.seq_id, start, end, c.token_digest
        r.block_ids.extend(ids)
        r.block_epochs.extend(ep)
        r.signature = mac(key, receipt_parts_message(generation, s.seq_id, start, end, c.token_digest, ids, ep))


__all__ = ["Checked", "check_grants", "sign_receipts"]
