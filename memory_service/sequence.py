"""A sequence's block table, and the read-only view of it the API reports.

PagedAttention (Kwon et al., SOSP 2023), section 4.2: a sequence's logical KV
blocks map to physical blocks through its block table; logical block ``i``
holds token positions ``[i * block_size, (i + 1) * block_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memory_service.block_hash import CacheKey


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Sequence:
    """One sequence's block table (owned and mutated by the block manager)."""

    #: Unique id for the manager's life, assigned in increasing order from 0.
    seq_id: int
    #: Lease that owns it.
    lease_id: str
    #: Tokens whose slots are reserved (prompt + generated).
    num_tokens: int
    #: Physical block ids in logical order; len == ceil(num_tokens / block_size).
    block_ids: list[int]
    #: The sequence it was forked from, if any.
    parent_seq_id: int | None = None
    #: Its token ids when the client sent them (prefix caching); None = unknown.
    token_ids: list[int] | None = None
    #: Hashes of its leading full blocks that were looked up or committed (a chain).
    block_hashes: list[bytes] = field(default_factory=list)
    #: Extra keys of its cache entries.
    cache_key: CacheKey = CacheKey()
    #: Leading tokens found in the prefix cache at allocation.
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """A snapshot of one sequence's block table with its blocks' refcounts (GetBlockTable, ListSequences)."""

    #: The sequence.
    seq_id: int
    #: Lease that owns it.
    lease_id: str
    #: Tokens whose slots are reserved.
    num_tokens: int
    #: Physical block ids in logical order.
    block_ids: tuple[int, ...]
    #: ref_counts[i]: refcount of block_ids[i] (> 1 = shared with a fork or a prefix-cache hit).
    ref_counts: tuple[int, ...]
    #: The sequence it was forked from, if any.
    parent_seq_id: int | None
