"""Content hashes of KV blocks for automatic prefix caching (vLLM's ``kv_cache_utils.hash_block_tokens``).

A full block's hash chains its parent's hash, its token ids and the extra keys
that change its KV (model identity, cache salt), so equal hashes mean equal
prefixes. SHA-256 over an unambiguous encoding: a version tag, then fields each
introduced by a one-byte kind and a length, so no two different inputs are
spelled alike (a salt can never pass for tokens, a parent for a salt). Stable
across processes and restarts (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_VERSION = b"pagedkv.block.v1"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Extra keys that change a block's KV besides its tokens."""

    #: Model / adapter identity.
    model_id: str = ""
    #: Per-request isolation: only equal salts share blocks.
    cache_salt: str = ""

    def encoded(self) -> bytes:
        return _field(b"M", self.model_id.encode()) + _field(b"S", self.cache_salt.encode())


def _field(kind: bytes, value: bytes) -> bytes:
    return kind + struct.pack("<Q", len(value)) + value


def block_hash(parent: bytes | None, token_ids: Sequence[int], key: CacheKey) -> bytes:
    """32-byte hash of one full block.

    Args:
        parent: hash of the previous block of the sequence; None for the first block.
        token_ids: the block's tokens (block_size of them), int32 range.
        key: extra keys.
    """
    h = hashlib.sha256(_VERSION)
    h.update(_field(b"P", parent or b""))
    h.update(_field(b"T", struct.pack(f"<{len(token_ids)}i", *token_ids)))
    h.update(key.encoded())
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, key: CacheKey, num_blocks: int,
                 parent: bytes | None = None) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``, chained from ``parent``."""
    out = []
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], key)
        out.append(parent)
    return out


def leading_hits(token_ids: Sequence[int], block_size: int, key: CacheKey, find: Callable[[bytes, tuple], int | None],
                 parent: bytes | None = None, start: int = 0) -> list[tuple[bytes, int]]:
    """The run of full blocks of ``token_ids`` from block index ``start`` (chained from ``parent``,
    the hash before it) that ``find(hash, token ids)`` finds, as ``(hash, block id)``; it stops at
    the first miss and never reaches the block holding the last token (the worker needs a query)."""
    hits = []
    for i in range(start, (len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent, chunk, key)
        b = find(parent, chunk)
        if b is None:
            break
        hits.append((parent, b))
    return hits
