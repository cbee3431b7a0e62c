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
- every copy-on-write copy of the request is one a grant of the step allows;
- every copy of every grant (DESIGN.md, "Tiers and transfers") goes device ->
  device (copy-on-write), device -> host (offload), host -> device (reload) or
  another node's pool -> device (node transfer), never host -> host; names blocks
  inside their tier (host copies only when a host tier is mapped) whose epochs
  are the ones the epoch table holds (device block b: ``epochs[b]``; host block
  h: ``host_epochs[h]`` = the whole table's ``[num_blocks + h]``; a remote
  block's epoch is its node's, vouched for by that node's signed ticket); a node
  transfer reads from the source in the request's ``transfer_sources`` whose
  digest the grant signed, inside its pool; and no two copies of the step write
  one block (nor does a copy-on-write read a block another one writes).

Anything else is PERMISSION_DENIED, before the first copy or write: of that sequence alone
when its own grant is violated (the step's result for it carries the error, and the others are
computed), of the whole step for a request copy no grant names or copies that race. The
check's answer carries the step's :class:`CopyPlan`: every accepted grant copy, deduped,
in the order the worker does them (offloads, reloads, copy-on-write). After the
forward, :func:`sign_receipts` gives each sequence a receipt for the positions
written, their token digest and blocks, and the tier copies (offloads and
reloads) of its grant; only with it does the memory service count them as
computed (and a host or reloaded block as proven).

Residual window (docs/security.md): epochs are read at the check, not again at
the write; a block freed and handed out anew while a step over it is in flight
on the same worker is written by that step before its new owner's first write.
A grant is not one-shot either: a step replayed with the same grant after its
forward wrote an offloaded block (a lost response retried) offloads the new
bytes; only the memory service can make such a replay fail (a new host epoch).
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

import numpy as np

from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import PermissionDeniedError
from pagedkv.runtime.grants import (
    copy_tuple,
    grant_parts_message,
    granted_copy,
    mac,
    receipt_parts_message,
    token_digest,
)
from pagedkv.runtime.transfer import source_digest

_DEVICE, _HOST, _REMOTE = grant_pb2.MEDIUM_DEVICE, grant_pb2.MEDIUM_HOST, grant_pb2.MEDIUM_REMOTE
_MEDIUM_NAMES = {_DEVICE: "device", _HOST: "host", _REMOTE: "remote"}
#: (src_medium, dst_medium) -> the copy's kind; any other pair is refused.
_KINDS = {(_DEVICE, _DEVICE): "copy-on-write", (_DEVICE, _HOST): "offload", (_HOST, _DEVICE): "reload",
          (_REMOTE, _DEVICE): "transfer"}


def _deny(what: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"Step refused, nothing was read or written: {what}; send each sequence with the "
                                 "grant of its latest memory-service reply, unchanged")


@dataclass(slots=True)
class Checked:
    """What :func:`check_grants` read of one sequence's grant, for :func:`sign_receipts`."""

    block_ids: list[int]  # the grant's (== the step's) block table
    block_epochs: list[int]  # their epochs, as granted (== the pool's at the check)
    token_digest: bytes  # digest of the step's token ids (the grant's when it names one: checked equal)
    #: The grant's offloads, reloads and node transfers as :func:`pagedkv.runtime.grants.copy_tuple` tuples, grant
    #: order.
    tier_copies: tuple = ()


@dataclass(slots=True)
class CopyPlan:
    """Every copy of a step's grants, deduped, as (src id, dst id) pairs, in the order the worker
    does them: ``offloads`` (device src -> host dst), then ``reloads`` (host src -> device dst) and
    ``transfers`` (another node's block -> device dst, per source), then ``copy_on_write``
    (device -> device)."""

    offloads: list[tuple[int, int]]
    reloads: list[tuple[int, int]]
    copy_on_write: list[tuple[int, int]]
    #: Node transfers: source digest -> (remote src, device dst) pairs.
    transfers: dict[bytes, list[tuple[int, int]]] = field(default_factory=dict)
    #: The request's transfer sources by digest (those a transfer names).
    sources: dict[bytes, grant_pb2.TransferSource] = field(default_factory=dict)

    @property
    def has_tier_copies(self) -> bool:
        """True when the step moves a block between the pool and the host tier."""
        return bool(self.offloads or self.reloads)


class CheckedStep(list):
    """``list[Checked | None]``, one per sequence in batch order (None: refused), ``plan``, the step's
    :class:`CopyPlan` (the accepted sequences' copies), and ``refused``: batch index -> the error
    (a PagedKVError) of each sequence refused alone."""

    plan: CopyPlan
    refused: dict[int, Exception]


def check_grants(request: pb.StepRequest, key: bytes, generation: int, epochs: np.ndarray,
                 now: float | None = None, host_epochs: np.ndarray | None = None,
                 refused: dict[int, Exception] | None = None) -> CheckedStep:
    """Check every sequence and copy of ``request`` against the grants it carries.

    A violation of one sequence's grant (no grant, not the memory service's, expired, positions,
    block table or tokens outside it, a block handed out anew, a copy of it refused) refuses that
    sequence alone: it goes to ``refused`` and none of its copies to the plan, and the caller
    computes the others. The epochs of every sequence's blocks are compared with the pool's in one
    numpy call after the per-sequence checks. A step whose grants name no copy does no per-copy
    work.

    Args:
        request: a structurally valid step (``build_step_inputs`` accepted it).
        key: the plane key of the mapped pool's generation.
        generation: the mapped pool's generation.
        epochs: the device blocks' epochs, int64 [num_blocks] (read-only view).
        now: Unix time, seconds (default: now).
        host_epochs: the host tier's epochs, int64 [host_num_blocks] (read-only view of the
            table's part past num_blocks); None when no host tier is mapped (then every copy
            to or from the host is refused).
        refused: batch index -> error of sequences the caller refused already (not checked; in
            ``.refused`` as given).

    Returns:
        per sequence, in batch order, what :func:`sign_receipts` signs for it (None when
        refused); ``.plan``: the accepted sequences' copies in the order to do them;
        ``.refused``: the refused sequences' errors by batch index.

    Raises:
        PermissionDeniedError: a fault of the whole step: a request copy that no grant names
            (one that only a refused sequence's block table holds goes with it), or two copies
            that race.
    """
    now = time.time() if now is None else now
    sources = {source_digest(s): s for s in request.transfer_sources} if request.transfer_sources else {}
    checked, scratch = CheckedStep(), []
    checked.refused = dict(refused or {})
    for i, s in enumerate(request.sequences):
        if i in checked.refused:
            checked.append(None)
            scratch.append(None)
            continue
        try:
            c, own = _check_sequence(s, key, generation, epochs, host_epochs, now, sources)
        except PermissionDeniedError as e:
            checked.refused[i] = e
            c, own = None, None
        checked.append(c)
        scratch.append(own)
    live = [i for i, c in enumerate(checked) if c is not None]
    all_ids = [b for i in live for b in checked[i].block_ids]
    all_epochs = [e for i in live for e in checked[i].block_epochs]
    if not np.array_equal(epochs[all_ids], np.array(all_epochs, dtype=np.int64)):
        for i in live:
            c = checked[i]
            if not np.array_equal(epochs[c.block_ids], np.array(c.block_epochs, dtype=np.int64)):
                checked.refused[i] = _deny(f"a block of sequence {request.sequences[i].seq_id} was handed out anew "
                                           "since its grant")
                checked[i] = None
    plan = CopyPlan([], [], [], sources=sources)
    allowed_copies: set[tuple[int, int]] = set()
    for own, c in zip(scratch, checked):
        if c is not None and own is not None:
            _merge(plan, own)
            allowed_copies.update(own.copy_on_write)
    checked.plan = plan
    refused_blocks = {b for i in checked.refused for s in [request.sequences[i]]
                      for b in (*s.block_ids, *s.grant.block_ids)}  # the copies of neither table are done
    accepted_blocks = {b for c in checked if c is not None for b in c.block_ids}
    for c in request.copies:
        if (c.src, c.dst) not in allowed_copies and not (c.dst in refused_blocks and c.dst not in accepted_blocks):
            raise _deny(f"copy {c.src} -> {c.dst} is in no grant of this step")
    if plan.copy_on_write or plan.has_tier_copies or plan.transfers:
        _check_plan(plan)
    return checked


def _check_sequence(s: pb.StepSequence, key: bytes, generation: int, epochs: np.ndarray,
                    host_epochs: np.ndarray | None, now: float,
                    sources: dict[bytes, grant_pb2.TransferSource]) -> tuple[Checked, CopyPlan]:
    """One sequence against its grant: what :func:`sign_receipts` signs for it, and the copies of its
    grant (a plan of its own, merged into the step's once every check passed).

    Raises:
        PermissionDeniedError: its first violation.
    """
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
    own = CopyPlan([], [], [], sources=sources)
    tier = tuple(c for c in copies if _check_copy(c, s.seq_id, epochs, host_epochs, own)) if copies else ()
    return Checked(ids, ep, digest, tier), own


def _merge(plan: CopyPlan, own: CopyPlan) -> None:
    """Add ``own``'s copies to ``plan``, each once, in order."""
    for mine, theirs in ((plan.offloads, own.offloads), (plan.reloads, own.reloads),
                         (plan.copy_on_write, own.copy_on_write)):
        mine.extend(p for p in theirs if p not in mine)
    for digest, pairs in own.transfers.items():
        mine = plan.transfers.setdefault(digest, [])
        mine.extend(p for p in pairs if p not in mine)


def _check_copy(c: tuple, seq_id: int, epochs: np.ndarray, host_epochs: np.ndarray | None, plan: CopyPlan) -> bool:
    """Check one grant copy (a :func:`copy_tuple`) and add it to ``plan`` unless already there;
    True for a tier copy (offload, reload or node transfer)."""
    src, src_epoch, dst, dst_epoch, src_medium, dst_medium, source = c
    what = (f"copy {_MEDIUM_NAMES.get(src_medium, f'medium {src_medium}')} block {src} -> "
            f"{_MEDIUM_NAMES.get(dst_medium, f'medium {dst_medium}')} block {dst} of sequence {seq_id}")
    kind = _KINDS.get((src_medium, dst_medium))
    if kind is None:
        raise _deny(f"{what} is not a device->device, device->host or host->device copy")
    if kind == "transfer":
        return _check_transfer(c, what, epochs, plan)
    if kind != "copy-on-write" and host_epochs is None:
        raise _deny(f"{what} needs the host tier, and this worker maps none (the memory service's pool has "
                    "no host tier)")
    src_table = host_epochs if src_medium == _HOST else epochs
    dst_table = host_epochs if dst_medium == _HOST else epochs
    if src >= len(src_table) or dst >= len(dst_table):
        raise _deny(f"{what} names a block outside its tier ({len(epochs)} device blocks, "
                    f"{0 if host_epochs is None else len(host_epochs)} host blocks)")
    if src_table[src] != src_epoch or dst_table[dst] != dst_epoch:
        raise _deny(f"{what} names a block handed out anew")
    if kind == "copy-on-write" and src == dst:
        raise _deny(f"{what} copies a block onto itself")
    pairs = plan.offloads if kind == "offload" else plan.reloads if kind == "reload" else plan.copy_on_write
    if (src, dst) not in pairs:
        pairs.append((src, dst))
    return kind != "copy-on-write"


def _check_transfer(c: tuple, what: str, epochs: np.ndarray, plan: CopyPlan) -> bool:
    """Check one node transfer and add it to ``plan`` unless already there."""
    src, _, dst, dst_epoch, _, _, source = c
    peer = plan.sources.get(source)
    if peer is None:
        raise _deny(f"{what} reads from a node whose transfer source is not in the step's transfer_sources "
                    "(pass the ticket's source unchanged)")
    if src >= peer.num_blocks or dst >= len(epochs):
        raise _deny(f"{what} names a block outside its pool ({peer.num_blocks} remote, {len(epochs)} device blocks)")
    if epochs[dst] != dst_epoch:
        raise _deny(f"{what} names a block handed out anew")
    pairs = plan.transfers.setdefault(source, [])
    if (src, dst) not in pairs:
        pairs.append((src, dst))
    return True


def _check_plan(plan: CopyPlan) -> None:
    """Refuse a step whose copies would race: one block written twice in a phase, or a copy-on-write
    reading a block another copy-on-write writes."""
    pulled = [*plan.reloads, *(p for pairs in plan.transfers.values() for p in pairs)]
    for name, pairs in (("offloads", plan.offloads), ("reloads and transfers", pulled),
                        ("copies-on-write", plan.copy_on_write)):
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise _deny(f"two {name} of this step write one block ({pairs})")
    cow_dsts = {d for _, d in plan.copy_on_write}
    if any(s in cow_dsts for s, _ in plan.copy_on_write):
        raise _deny(f"a copy-on-write of this step reads a block another one writes ({plan.copy_on_write})")


def sign_receipts(request: pb.StepRequest, results: list[pb.StepResult], key: bytes, block_size: int,
                  checked: list[Checked] | None = None) -> None:
    """Attach to each result the signed receipt of what its sequence's step wrote and the tier copies
    (offloads, reloads) of its grant, as granted (after :func:`check_grants`; ``checked``: its return
    value, read instead of the grants again)."""
    seqs = request.sequences
    if checked is None:
        checked = [Checked(list(s.grant.block_ids), list(s.grant.block_epochs), token_digest(s.token_ids),
                           tuple(copy_tuple(c) for c in s.grant.copies if c.src_medium or c.dst_medium))
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
        if c.tier_copies:
            r.copies.extend(granted_copy(t) for t in c.tier_copies)
        r.signature = mac(key, receipt_parts_message(generation, s.seq_id, start, end, c.token_digest, ids, ep,
                                                     c.tier_copies))


__all__ = ["Checked", "CheckedStep", "CopyPlan", "check_grants", "sign_receipts"]
