"""Computed tokens: a sequence's positions count as computed only with a worker's receipt.

DESIGN.md, "Trust model": the memory service never sees KV bytes, so what a worker wrote is
known only from the receipt it signs for each step (pagedkv.runtime.grants). Taking a receipt makes its
positions proven (readable by the sequence's next step, the next grant's ``readable_tokens``) and
enters full blocks of known tokens into the prefix cache; the receipt's token digest must equal
the tokens the sequence was given, so no block is cached as tokens it was not computed from.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from memory_service.block_pool import BlockPool
from memory_service.manager.requests import Commit, CommitResult, Receipt, check_batch
from memory_service.manager.sequence import Sequence, SequenceTable
from memory_service.prefix_cache import PrefixCache
from memory_service.tiers.manager import Tiers
from pagedkv.runtime.errors import InvalidArgumentError, NotFoundError
from pagedkv.runtime.grants import token_digest
from pagedkv.runtime.logs import get_logger

log = get_logger("block_manager")


def _live(sequences: SequenceTable, lease_id: str, seq_id: int) -> Sequence | None:
    """The live sequence ``seq_id`` of ``lease_id``; None if it was freed or preempted meanwhile.

    Raises:
        NotFoundError: never allocated, or of another lease.
    """
    seq = sequences.get(seq_id)
    if seq is None and sequences.was_allocated(seq_id):
        return None
    if seq is None or seq.lease_id != lease_id:
        raise NotFoundError(f"CommitComputedTokens: sequence {seq_id} is not a live sequence of lease {lease_id}")
    return seq


def _check_unique(ids: list[int]) -> None:
    check_batch(len(ids), "CommitComputedTokens")
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError("CommitComputedTokens: a sequence appears more than once in the batch")


def _wrote_over_reload(tiers: Tiers, seq: Sequence, r: Receipt) -> bool:
    """Whether receipt ``r`` writes into a block of ``seq`` whose reload it does not prove.

    Only a swap-in's reload lands in a block the sequence writes (its partly or not yet computed
    blocks; a prefix hit's reloads fill full blocks before the first position it computes). Such a
    step computed over KV that was never restored, and repeating the reload later would copy over
    what it wrote: the positions stay unproven and the reload stays in the next grant (workers copy
    before they write). The tier copies it lists are still settled, and the blocks it wrote get a
    new epoch, as for a taken receipt: no earlier grant can run its copies again over them.
    """
    if not seq.reloads:
        return False
    written, done = set(r.block_ids), set(r.copies)
    return any(rl.copy.dst in written and tiers.copy_key(rl.copy) not in done for rl in seq.reloads)


def take_receipts(sequences: SequenceTable, pool: BlockPool, cache: PrefixCache, lease_id: str,
                  receipts: Seq[Receipt], tiers: Tiers | None = None) -> CommitResult:
    """Take the receipts of ``lease_id``'s sequences (signatures already checked).

    A receipt is taken when it continues its sequence exactly (``start`` equals the tokens proven
    so far, ``end`` within the sequence) and names the sequence's current blocks for those
    positions with their current epochs; otherwise it is stale (a sequence freed, preempted or
    handed other blocks meanwhile) and skipped. A taken receipt whose token digest differs from the
    token ids the sequence was given ends prefix caching for that sequence (its KV is not of those
    tokens). The blocks a taken receipt proves get a new epoch, so every grant issued before (the
    one it answers included) no longer matches them: a grant is good for one counted step (a
    replayed copy-on-write grant could otherwise re-copy its source over positions proven and
    cached since). Full blocks of proven, known tokens are then registered in the prefix cache.
    A taken receipt also settles the sequence's tier copies (``tiers``, :meth:`Tiers.settle`): the
    offloads and reloads it lists are proven; a reload it leaves unproven ends prefix caching for
    the sequence; one that writes into a block whose reload it leaves unproven proves no position
    and is counted as skipped (:func:`_wrote_over_reload`). A receipt of a swapped-out sequence is stale.

    Returns:
        blocks registered, receipts skipped, and the sequences whose receipt was taken.

    Raises:
        InvalidArgumentError: empty batch, a sequence twice.
        NotFoundError: a sequence never allocated, or of another lease.
    """
    _check_unique([r.seq_id for r in receipts])
    bs, epochs = pool.block_size, pool.epochs
    taken: list[tuple[Sequence, Receipt]] = []
    for r in receipts:
        seq = _live(sequences, lease_id, r.seq_id)
        if seq is None or seq.swap is not None:
            continue
        first, last = r.start // bs, -(-r.end // bs)
        if not (r.start == seq.num_proven < r.end <= seq.num_tokens) or \
                tuple(seq.block_ids[first:last]) != r.block_ids or \
                tuple(int(e) for e in epochs[list(r.block_ids)]) != r.block_epochs:
            log.info("receipt_stale", seq_id=r.seq_id, start=r.start, end=r.end, proven=seq.num_proven)
            continue
        if tiers is not None and _wrote_over_reload(tiers, seq, r):
            log.warning("receipt_over_unproven_reload", seq_id=r.seq_id, start=r.start, end=r.end)
            tiers.settle(seq, r.copies)  # the copies it lists ran before its writes
            epochs[list(r.block_ids)] += 1  # no grant issued before may run again over these blocks
            continue
        taken.append((seq, r))
    for seq, r in taken:
        if tiers is not None and not tiers.settle(seq, r.copies):  # before the epochs below move
            log.warning("receipt_without_reload", seq_id=seq.seq_id)
            seq.token_ids = None
        toks = seq.token_ids
        if toks is not None and (len(toks) < r.end or token_digest(toks[r.start:r.end]) != r.token_digest):
            log.warning("receipt_tokens_differ", seq_id=seq.seq_id, start=r.start, end=r.end)
            seq.token_ids = None
        seq.num_proven, seq.copy_pending = r.end, None  # the step that proved r did the copy-on-write too
        epochs[list(r.block_ids)] += 1
    registered = sum(cache.commit(seq, seq.num_proven) for seq, _ in taken)
    return CommitResult(registered, len(receipts) - len(taken), tuple(seq for seq, _ in taken))


def commit_unproven(sequences: SequenceTable, cache: PrefixCache, lease_id: str, entries: Seq[Commit]) -> CommitResult:
    """Count each :class:`Commit`'s leading tokens as computed without a receipt, and register their
    full blocks. For in-process callers that computed the KV themselves (tests, benchmarks); the
    gRPC API refuses it. Entries naming a sequence freed or preempted meanwhile are skipped.

    Raises:
        InvalidArgumentError: empty batch, duplicates, a count outside [0, num_tokens].
        NotFoundError: a sequence never allocated, or of another lease.
    """
    _check_unique([c.seq_id for c in entries])
    live = []
    for c in entries:
        seq = _live(sequences, lease_id, c.seq_id)
        if seq is None:
            continue
        if not 0 <= c.num_computed_tokens <= seq.num_tokens:
            raise InvalidArgumentError(f"CommitComputedTokens(sequence {c.seq_id}): num_computed_tokens must be in "
                                       f"[0, {seq.num_tokens}], got {c.num_computed_tokens}")
        live.append((seq, c.num_computed_tokens))
    for seq, n in live:
        seq.num_proven, seq.copy_pending = max(seq.num_proven, n), None
    registered = sum(cache.commit(seq, n) for seq, n in live)
    return CommitResult(registered, len(entries) - len(live))


__all__ = ["commit_unproven", "take_receipts"]
