"""Typed requests and results of the block manager's calls, and the checks of per-call limits.

Each batched call takes a list of small request dataclasses and returns a
result dataclass, so no meaning hangs on a tuple position. Copy-on-write is
data, as in vLLM v0 (``vllm/core/block/common.py``): :class:`BlockCopy` pairs
the worker copies before it writes. A capacity shortfall is the typed result
:class:`OutOfBlocks` (-> RESOURCE_EXHAUSTED), never an exception.

Requests are checked by the call that takes them, after its lease, so an
expired lease is reported before a malformed entry and messages can name the
pool's capacity; results assert their invariants in ``__post_init__``. The per-call limits
themselves are defined in :mod:`pagedkv.runtime.limits` (shared with the client).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import InvalidArgumentError
from pagedkv.runtime.limits import MAX_BATCH, MAX_FORK_BLOCK_IDS, MAX_TOKEN_IDS_PER_CALL  # noqa: F401 - re-exported


def check_batch(n: int, what: str) -> None:
    """Check the size of a batch of ``n`` entries for call ``what`` (before anything changes).

    Raises:
        InvalidArgumentError: an empty batch, or more than :data:`pagedkv.runtime.limits.MAX_BATCH` entries.
    """
    if n == 0:
        raise InvalidArgumentError(f"{what}: the batch is empty; send at least one entry")
    if n > MAX_BATCH:
        raise InvalidArgumentError(f"{what}: {n} entries is more than the {MAX_BATCH} one call may carry "
                                   "(pagedkv.runtime.limits.MAX_BATCH); split the batch into several calls")


def check_token_ids(n: int, what: str) -> None:
    """Check the token ids one call carries, ``n`` over all its entries (before anything changes).

    Raises:
        InvalidArgumentError: more than :data:`pagedkv.runtime.limits.MAX_TOKEN_IDS_PER_CALL`.
    """
    if n > MAX_TOKEN_IDS_PER_CALL:
        raise InvalidArgumentError(
            f"{what}: {n} token ids is more than the {MAX_TOKEN_IDS_PER_CALL} one call may "
            "carry (pagedkv.runtime.limits.MAX_TOKEN_IDS_PER_CALL); split the batch into several calls"
        )


def check_request_size(entries: Seq, what: str) -> None:
    """Check a request's entries (protos with ``token_ids``) against the per-call limits before
    they are converted: a refusal costs no more than reading the request.

    Raises:
        InvalidArgumentError: as :func:`check_batch` and :func:`check_token_ids`.
    """
    check_batch(len(entries), what)
    check_token_ids(sum(len(e.token_ids) for e in entries), what)


@dataclass(frozen=True, slots=True)
class OutOfBlocks:
    """Typed result of a request the pool cannot satisfy now (-> RESOURCE_EXHAUSTED)."""

    #: Blocks the whole batch needs.
    required: int
    #: Blocks available (free + cached) when it was refused.
    available: int

    def __post_init__(self) -> None:
        assert 0 <= self.available < self.required, f"refused {self.required} blocks with {self.available} available"


@dataclass(frozen=True, slots=True)
class Allocation:
    """One sequence to allocate."""

    #: Tokens to reserve slots for; with ``token_ids``, beyond the cached prefix.
    num_tokens: int
    #: The sequence's known tokens: enables prefix-cache lookup and registration.
    token_ids: tuple[int, ...] | None = None
    #: Extra cache keys.
    cache_key: CacheKey = CacheKey()
    #: Blocks another node holds for these tokens (a checked transfer ticket), or None.
    remote: RemotePrefix | None = None


@dataclass(frozen=True, slots=True)
class RemotePrefix:
    """Leading full blocks of a prompt pinned on another node (a transfer ticket whose signature,
    layout and expiry the server checked): block ``i`` of the prompt is the remote block
    ``block_ids[i]`` (epoch ``block_epochs[i]``, hash ``block_hashes[i]``) of the pool that
    ``source`` (a ``TransferSource`` digest) reads."""

    block_ids: tuple[int, ...]
    block_epochs: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    source: bytes


@dataclass(slots=True)
class Append:
    """Slots to add to one sequence (a decode step, or a chunk of a chunked prefill).

    Not frozen, and ``token_ids`` is any sequence (the request's own repeated field, not a
    copy): one is built per sequence per decode step, so it stays as cheap as a tuple.
    """

    #: The sequence.
    seq_id: int
    #: Tokens to reserve slots for (>= 1).
    num_tokens: int
    #: Ids of the appended tokens (prefix caching); None or empty ends caching for the sequence.
    token_ids: Seq[int] | None = None


@dataclass(frozen=True, slots=True)
class BlockTableUpdate:
    """How one sequence's block table changed: entries from ``first_changed`` on are replaced."""

    #: The sequence.
    seq_id: int
    #: Its token count after the change.
    num_tokens: int
    #: Index of the first block-table entry that changed (a copied last block, or the first new one).
    first_changed: int
    #: The table's entries from ``first_changed`` to its end.
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.first_changed >= 0 and self.block_ids, f"empty update of sequence {self.seq_id}"


#: Media of a :class:`BlockCopy`'s sides (``pagedkv.grant.v1.Medium``): the pool, the host tier,
#: another node's pool.
DEVICE, HOST, REMOTE, DISK = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy the worker does before writing: block ``src``'s KV into block ``dst``. Device to
    device is a copy-on-write; device to host an offload, host to device a reload
    (:mod:`memory_service.tiers.manager`)."""

    #: Block to read.
    src: int
    #: Block to write.
    dst: int
    #: The sequence whose grant carries the copy (not part of equality: a copy is its blocks).
    seq_id: int = field(default=-1, compare=False)
    #: Media of each side: 0 the device pool, 1 the host tier, 2 (src only) another node's pool
    #: (``pagedkv.grant.v1.Medium``).
    src_medium: int = 0
    dst_medium: int = 0
    #: A remote src: its epoch on its node (from the transfer ticket), and the digest of its
    #: node's TransferSource (``pagedkv.runtime.transfer.source_digest``); unused otherwise.
    src_epoch: int = 0
    source: bytes = b""

    def __post_init__(self) -> None:
        assert self.src != self.dst or self.src_medium != self.dst_medium, f"copy of block {self.src} onto itself"
        assert (self.src_medium, self.dst_medium) != (1, 1), "no copy runs inside the host tier"


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Result of :meth:`BlockManager.append_slots`."""

    #: Tables that changed, in request order (a sequence whose table did not change is absent).
    updates: list[BlockTableUpdate]
    #: Copies to do before any write, in order.
    copies: list[BlockCopy]


@dataclass(frozen=True, slots=True)
class Commit:
    """A sequence's progress: its first ``num_computed_tokens`` tokens have KV written."""

    #: The sequence.
    seq_id: int
    #: Tokens whose KV is computed (0..num_tokens).
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class Receipt:
    """A worker's receipt (signature already checked): it wrote positions [start, end) of a sequence."""

    #: The sequence.
    seq_id: int
    #: First position written.
    start: int
    #: One past the last position written.
    end: int
    #: SHA-256 of the written token ids (pagedkv.runtime.grants.token_digest).
    token_digest: bytes
    #: Blocks holding [start, end), logical order, with their allocation epochs.
    block_ids: tuple[int, ...]
    block_epochs: tuple[int, ...]
    #: Tier copies the step did, as granted (pagedkv.runtime.grants.copy_tuple).
    copies: tuple[tuple[int, int, int, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Result of :meth:`BlockManager.commit_computed`."""

    #: Blocks newly entered into the prefix cache.
    blocks_registered: int
    #: Entries naming a sequence freed or preempted meanwhile (or, for receipts, stale ones).
    skipped: int
    #: Sequences whose receipt was taken, in request order (receipts only).
    accepted: tuple = ()

    def __post_init__(self) -> None:
        assert self.blocks_registered >= 0 and self.skipped >= 0, self


@dataclass(frozen=True, slots=True)
class Stats:
    """Counters of :meth:`BlockManager.stats` (GetStats; fields as in ``GetStatsResponse``)."""

    #: Blocks in the pool.
    total_blocks: int
    #: Blocks with no content.
    free_blocks: int
    #: Refcount-0 blocks keeping content, evictable: prefix-cache blocks and swapped-out sequences' blocks.
    cached_blocks: int
    #: Blocks with refcount > 0.
    used_blocks: int
    #: free + cached: what an allocation may take now.
    available_blocks: int
    #: Tokens per block.
    block_size: int
    #: Token slots written in used blocks.
    tokens_stored: int
    #: tokens_stored / token capacity of used blocks (0 when none is used).
    utilization: float
    #: Live sequences.
    num_sequences: int
    #: Live leases.
    num_leases: int
    #: Requests refused with OutOfBlocks.
    allocation_failures: int
    #: Sequences freed as preempted.
    preemptions: int
    #: Prompt tokens looked up in the prefix cache.
    prefix_cache_queries: int
    #: Prompt tokens found there.
    prefix_cache_hits: int
    #: Block-table entries pointing at a shared block.
    shared_block_refs: int
    #: Cached blocks evicted.
    prefix_cache_evictions: int
    #: Automatic prefix caching is on.
    prefix_caching: bool
    #: Host tier (0 when off): blocks, free, cached (offloaded prefix blocks), used (pending, held).
    host_total_blocks: int = 0
    host_free_blocks: int = 0
    host_cached_blocks: int = 0
    host_used_blocks: int = 0
    #: Blocks offloaded / reloaded (copies proven); offloads that did not happen.
    offloads: int = 0
    reloads: int = 0
    offloads_dropped: int = 0
    #: Prompt tokens found in the host tier; its cached blocks evicted.
    host_cache_hits: int = 0
    host_cache_evictions: int = 0
    #: Sequences swapped out / in; swapped out now.
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_sequences: int = 0
    #: The disk tier's :meth:`DiskTier.stats` (``disk_`` names), or None without one.
    disk: dict | None = None
    #: Prefix pins and retention (:meth:`ManagerPins.pin_stats`, GetStats.pins).
    pins: dict | None = None

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1 (vLLM's KV cache usage)."""
        return self.used_blocks / self.total_blocks
