"""A model of the KV bytes both tiers hold, and a worker that fills them, for the block manager's
state machine (tests/memory_service/test_block_manager_stateful.py).

The memory service never sees KV bytes (DESIGN.md, "Trust model"), so a copy that goes to the
wrong block, or a block that becomes a prefix-cache hit before its copy ran, shows only in what a
worker would read. Here a slot's KV is the token ids it was computed from: the slot of position
``p`` of a sequence with tokens ``t`` holds ``tuple(t[:p + 1])`` (the token at ``p`` and every token
before it, which is what attention's KV at ``p`` depends on); an unwritten slot holds None. A block
is a list of ``block_size`` slots, in the device pool and in the host tier alike.

The worker does what DESIGN.md ("Tiers and transfers") asks of a step: every copy of the grants it
runs, offloads (device->host) first, then reloads (host->device), then copy-on-write, then the
step's writes, and signs a receipt per sequence naming the tier copies it did.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import BlockCopy, Receipt
from memory_service.manager.sequence import Sequence
from memory_service.tiers.manager import DEVICE, HOST
from pagedkv.runtime.grants import token_digest


def slot_kv(tokens, p: int) -> tuple[int, ...]:
    """The KV of position ``p`` of a sequence with ``tokens``: the ids it was computed from."""
    return tuple(tokens[:p + 1])


def is_tier(c: BlockCopy) -> bool:
    """An offload or a reload (a side in the host tier), not a copy-on-write."""
    return c.src_medium == HOST or c.dst_medium == HOST


def worker_rank(c: BlockCopy) -> int:
    """A copy's place in a step: offloads, reloads, copy-on-write."""
    return 0 if c.dst_medium == HOST else 1 if c.src_medium == HOST else 2


class KvContent:
    """What every block of both tiers holds: ``tier[medium][block][slot]`` (medium 0 device, 1 host)."""

    def __init__(self, num_blocks: int, host_num_blocks: int, block_size: int):
        self.bs = block_size
        self.tier = [[[None] * block_size for _ in range(n)] for n in (num_blocks, host_num_blocks)]

    def copy(self, c: BlockCopy) -> None:
        """Do copy ``c``: the whole block, as a worker does."""
        self.tier[c.dst_medium][c.dst] = list(self.tier[c.src_medium][c.src])

    def write(self, block_ids, tokens, start: int, end: int) -> None:
        """Write positions [start, end) of a sequence with ``tokens`` through its block table."""
        for p in range(start, end):
            self.tier[0][block_ids[p // self.bs]][p % self.bs] = slot_kv(tokens, p)

    def wrong_slots(self, medium: int, block: int, tokens, index: int, upto: int | None = None) -> list[int]:
        """Positions of logical block ``index`` (below ``upto``, default the block's end) that
        ``block`` of ``medium`` does not hold as a sequence with ``tokens`` computed them."""
        bs = self.bs
        end = (index + 1) * bs if upto is None else min(upto, (index + 1) * bs)
        held = self.tier[medium][block]
        return [p for p in range(index * bs, end) if held[p % bs] != slot_kv(tokens, p)]


    def wrong_in_sequence(self, seq: Sequence, tokens, later=()) -> list[tuple[int, list[int]]]:
        """(block index, positions) where ``seq`` would not read its own proven KV (positions below
        ``num_proven``): through its block table, skipping device blocks in ``later`` (copies not
        done yet); a swapped-out sequence through the device blocks it keeps and the host blocks
        whose offload was proven (a block whose offload was not is lost: its swap-in fails)."""
        out = []
        for i, b in enumerate(seq.block_ids):
            e = seq.swap[i] if seq.swap is not None else None
            if e is None:
                if b in later:
                    continue
                where = (DEVICE, b)
            elif e.device is not None:
                where = (DEVICE, e.device)
            elif e.proven:
                where = (HOST, e.host)
            else:
                continue
            wrong = self.wrong_slots(*where, tokens, i, seq.num_proven)
            if wrong:
                out.append((i, wrong))
        return out


class Clock:
    """A fake monotonic clock (seconds) for lease expiry."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Job:
    """One sequence's part of a worker step."""

    seq: Sequence
    #: The sequence's token ids (the client's history).
    tokens: list[int]
    #: The copies of the grants the step runs for it (tier copies and copy-on-write).
    copies: list[BlockCopy]
    #: Do its tier copies (a worker that runs an older grant, or fails them, does not).
    do_tier: bool = True
    #: List its tier copies in the receipt (False: a receipt leaving them out).
    list_tier: bool = True


def run_step(manager: BlockManager, kv: KvContent, jobs: list[Job]) -> list[Receipt]:
    """Run one worker step over ``jobs`` (copies in worker order across every job, then each job's
    writes of positions [num_proven, num_tokens)) and return a receipt per job."""
    bs = manager.block_size
    copies = sorted(((worker_rank(c), n, c) for n, j in enumerate(jobs) for c in j.copies
                     if j.do_tier or not is_tier(c)), key=lambda x: (x[0], x[1]))
    done = [set() for _ in jobs]
    for _, n, c in copies:
        kv.copy(c)
        if is_tier(c):
            done[n].add(manager.tiers.copy_key(c))
    receipts = []
    for j, did in zip(jobs, done):
        s = j.seq
        start, end = s.num_proven, s.num_tokens
        kv.write(s.block_ids, j.tokens, start, end)
        ids = tuple(s.block_ids[start // bs:-(-end // bs)])
        receipts.append(Receipt(s.seq_id, start, end, token_digest(j.tokens[start:end]), ids,
                                tuple(int(e) for e in manager.pool.epochs[list(ids)]),
                                tuple(sorted(did)) if j.list_tier else ()))
    return receipts


def snapshot(m: BlockManager) -> tuple:
    """Everything a refused call must leave as it was: stats (but the refusal counter), every
    sequence's table and tier state, the pool, the prefix cache, the host tier, the swap maps."""
    s = m.stats()
    stats = tuple((f, getattr(s, f)) for f in s.__slots__ if f != "allocation_failures")
    seqs = tuple(
        (q.seq_id, q.lease_id, q.num_tokens, tuple(q.block_ids), q.num_proven, q.num_cached_tokens,
         None if q.token_ids is None else tuple(q.token_ids), tuple(q.block_hashes),
         None if q.swap is None else tuple(None if e is None else (e.host, e.device, e.proven) for e in q.swap),
         tuple(q.fresh_offloads), tuple(q.offloads), tuple(r.copy for r in q.reloads))
        for q in sorted(m.sequences.values(), key=lambda q: q.seq_id))
    p = m.pool
    pool = (tuple(p.ref_counts), tuple(p.has_content), tuple(p.fill), tuple(p.epochs), tuple(p.free_queue),
            tuple(sorted(m.prefix_cache.cached.items())))
    t = m.tiers
    tiers = (tuple(sorted((b, q.seq_id, i) for b, (q, i) in t.held.items())),
             tuple(sorted((h, None if o is None else (o[0].seq_id, o[1])) for h, o in t.swap_targets.items())))
    h = t.host
    host = () if h is None else (tuple(h.state), tuple(h.pins), tuple(h.hash_of), tuple(h.free_queue),
                                 tuple(h.lru), tuple(h.epochs), tuple(sorted(h.cached.items())),
                                 tuple(sorted(h.pending.items())))
    return stats, seqs, pool, tiers, host


__all__ = ["Clock", "Job", "KvContent", "is_tier", "run_step", "slot_kv", "snapshot", "worker_rank"]
