"""The pool as the dashboard draws it: one state and one refcount per block, sent compactly.

A block's state comes from two sources (the memory service has no "list every block" call, and
needs none): the block tables of ListSequences (a block in a table is *used*, with that entry's
refcount) and the prefix cache's KV events (a block stored and not yet removed holds cached
content; with refcount 0 it is *cached*, i.e. evictable). Every other block is *free*. The host
tier (``--host-cache-memory``) is a second map of the same kind, from the host-medium entries.

NOTE: exactness
- *used* and the refcounts are exact for the listing read (a block is in some table iff its
  refcount > 0).
- *cached* is exact when the event stream was followed from its first event
  (:class:`client.serve.dashboard.kv_follower.CachedBlocks` says so) and no sequence is swapped out: the
  device blocks a swap-out leaves cached are counted by GetStats but announced by no event. The
  counts of GetStats stay the reference; :func:`encode` reports its own counts beside them.

Encoding (JSON, one per snapshot): up to :data:`MAX_CELLS` blocks, the state and the refcount of
every block as runs ``[value, length, value, length, ...]`` (a fresh pool is one run; a busy pool
one run per change of state); above it, cells of ``blocks_per_cell`` consecutive blocks with their
used / cached / free counts and largest refcount, so a snapshot of a pool with millions of blocks
is still 4,096 cells (the page draws them as a heat map).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

#: Block states as sent (``state_runs`` values).
FREE, USED, CACHED = 0, 1, 2
STATE_NAMES = ("free", "used", "cached")
#: Pools with more blocks than this are sent as cells of several blocks (a heat map).
MAX_CELLS = 4096
#: ``pagedkv.grant.v1.Medium`` values of SequenceInfo.media and of KV events.
MEDIUM_DEVICE, MEDIUM_HOST = 0, 1


@dataclass(slots=True)
class PoolMap:
    """One tier's blocks: state and refcount per block id."""

    #: State of each block (FREE, USED, CACHED): [total] uint8.
    state: np.ndarray
    #: Refcount of each block (0 unless used): [total] uint32.
    refcount: np.ndarray

    @property
    def total(self) -> int:
        return len(self.state)

    def counts(self) -> dict[str, int]:
        """Blocks per state name."""
        n = np.bincount(self.state, minlength=len(STATE_NAMES))
        return {name: int(n[i]) for i, name in enumerate(STATE_NAMES)}


def pool_map(total: int, sequences: Iterable, cached: Iterable[int], medium: int = MEDIUM_DEVICE) -> PoolMap:
    """The map of one tier of ``total`` blocks.

    Args:
        total: blocks in the tier.
        sequences: SequenceInfo-like rows (``block_ids``, ``ref_counts``, ``media``; empty media
            means every block is on the device).
        cached: block ids of this tier holding prefix-cache content (from the KV events).
        medium: MEDIUM_DEVICE or MEDIUM_HOST: which entries of the tables belong to this map.

    Ids outside ``[0, total)`` are ignored (a listing read across a pool restart).
    """
    state = np.zeros(total, dtype=np.uint8)
    refcount = np.zeros(total, dtype=np.uint32)
    ids = np.fromiter(cached, dtype=np.int64)
    state[ids[(ids >= 0) & (ids < total)]] = CACHED
    blocks: list[int] = []
    refs: list[int] = []
    for s in sequences:
        media = s.media
        # The tier of the whole table (no media: the device), or None when it spans both.
        tier = MEDIUM_DEVICE if not media else media[0] if min(media) == max(media) else None
        if tier == medium:  # no per-entry loop
            blocks.extend(s.block_ids)
            refs.extend(s.ref_counts)
        elif tier is None:
            for b, rc, m in zip(s.block_ids, s.ref_counts, media):
                if m == medium:
                    blocks.append(b)
                    refs.append(rc)
    if blocks:
        b = np.asarray(blocks, dtype=np.int64)
        keep = b < total
        state[b[keep]] = USED
        refcount[b[keep]] = np.asarray(refs, dtype=np.uint32)[keep]
    return PoolMap(state, refcount)


def runs(values: np.ndarray) -> list[int]:
    """``values`` run-length encoded as a flat ``[value, length, value, length, ...]`` list."""
    if len(values) == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values.astype(np.int64))) + 1))
    out = np.empty(2 * len(starts), dtype=np.int64)
    out[0::2] = values[starts]
    out[1::2] = np.diff(np.concatenate((starts, [len(values)])))
    return out.tolist()


def unruns(encoded: list[int]) -> list[int]:
    """The values of a :func:`runs` list, one per block (for viewers and tests)."""
    out: list[int] = []
    for value, length in zip(encoded[0::2], encoded[1::2]):
        out.extend([value] * length)
    return out


def encode(pm: PoolMap, max_cells: int = MAX_CELLS) -> dict:
    """The JSON form of a map (the module's encoding), with its counts per state."""
    out = {"total_blocks": pm.total, "counts": pm.counts()}
    if pm.total <= max_cells:
        out.update(encoding="blocks", state_runs=runs(pm.state), refcount_runs=runs(pm.refcount))
        return out
    per = math.ceil(pm.total / max_cells)
    cells = math.ceil(pm.total / per)
    pad = cells * per - pm.total
    state = np.concatenate((pm.state, np.full(pad, 255, dtype=np.uint8))).reshape(cells, per)
    refcount = np.concatenate((pm.refcount, np.zeros(pad, dtype=np.uint32))).reshape(cells, per)
    out.update(encoding="cells", blocks_per_cell=per,
               cells={name: (state == i).sum(axis=1).tolist() for i, name in enumerate(STATE_NAMES)}
               | {"max_refcount": refcount.max(axis=1).tolist()})
    return out


__all__ = ["CACHED", "FREE", "MAX_CELLS", "MEDIUM_DEVICE", "MEDIUM_HOST", "STATE_NAMES", "USED", "PoolMap", "encode",
           "pool_map", "runs", "unruns"]
