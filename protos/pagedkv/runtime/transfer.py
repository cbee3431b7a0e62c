"""Node transfers: the digest naming a peer's pool, and the tickets memory services sign for each other.

DESIGN.md, "Nodes" and "Tiers and transfers". A node's worker publishes a ``TransferSource`` (its
NIXL agent over the pool it maps); a node's memory service pins a prompt's cached blocks for
another node (``ExportPrefix``) and signs a ``TransferTicket`` naming them, their epochs and
hashes, the layout and the source; the reading node's memory service takes the ticket in
``AllocateSequences`` only when its signature is good under the *transfer key* the memory
services of one deployment share (a 32-byte secret, ``--transfer-key-file``), its layout equals
its own and it has not expired. It then grants its worker node transfers (``MEDIUM_REMOTE``
copies) that name the source by :func:`source_digest`, and the worker reads from exactly the
source whose digest the grant signed. A scheduler can therefore neither forge which remote blocks
a prompt's hashes map to, nor point a worker at other bytes.

Signatures are HMAC-SHA256 (RFC 2104) over a canonical encoding built here (not protobuf's wire
bytes), with a domain string of their own. The transfer plane (NIXL over UCX) itself is for a
trusted network only: docs/security.md says what it exposes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.grants import KEY_BYTES, mac

_SOURCE_DOMAIN = b"pagedkv.grant.v1.TransferSource\x00"
_TICKET_DOMAIN = b"pagedkv.memory.v1.TransferTicket\x00"
_PUBLISH_DOMAIN = b"pagedkv.memory.v1.PublishTransferSource\x00"


def _bytes(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def source_digest(s: grant_pb2.TransferSource) -> bytes:
    """SHA-256 (32 bytes) of a transfer source's canonical encoding: what grants name it by."""
    return hashlib.sha256(b"".join((
        _SOURCE_DOMAIN, _bytes(s.agent_name.encode()), _bytes(s.agent_metadata),
        struct.pack("<QIQ", s.base_address, s.num_blocks, s.block_bytes), _bytes(s.mem_type.encode()),
        struct.pack("<I", s.device_id)))).digest()


def source_message(pool_generation: int, source: grant_pb2.TransferSource, withdraw: bool = False) -> bytes:
    """The canonical bytes a PublishTransferSource signature covers."""
    return b"".join((_PUBLISH_DOMAIN, struct.pack("<Q?", pool_generation, withdraw), source_digest(source)))


def sign_source(key: bytes, pool_generation: int, source: grant_pb2.TransferSource, withdraw: bool = False) -> bytes:
    """The signature of publishing (or withdrawing) ``source`` for ``pool_generation`` under the
    plane ``key`` (HMAC-SHA256, 32 bytes)."""
    return mac(key, source_message(pool_generation, source, withdraw))


def ticket_message(t: mpb.TransferTicket) -> bytes:
    """The canonical bytes a ticket's signature covers (every field but ``signature``)."""
    lay = t.layout
    n = len(t.block_ids)
    return b"".join((
        _TICKET_DOMAIN, _bytes(t.node_name.encode()),
        struct.pack("<QIIII", t.pool_generation, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size),
        _bytes(lay.dtype.encode()), struct.pack("<I", lay.num_blocks),
        struct.pack(f"<I{n}I", n,
                    *t.block_ids), struct.pack(f"<I{len(t.block_epochs)}Q", len(t.block_epochs), *t.block_epochs),
        struct.pack("<I", len(t.block_hashes)), b"".join(_bytes(h) for h in t.block_hashes),
        source_digest(t.source), struct.pack("<d", t.expires_at), _bytes(t.model.encode())))


def sign_ticket(key: bytes, ticket: mpb.TransferTicket) -> mpb.TransferTicket:
    """Set ``ticket.signature`` under the transfer ``key``; returns ``ticket``."""
    ticket.signature = mac(key, ticket_message(ticket))
    return ticket


def ticket_signed(key: bytes, ticket: mpb.TransferTicket) -> bool:
    """True when ``ticket.signature`` is a memory service's signature under ``key`` (constant-time compare)."""
    return hmac.compare_digest(ticket.signature, mac(key, ticket_message(ticket)))


def load_transfer_key(path: str | os.PathLike) -> bytes:
    """The transfer key in ``path``: 64 hex digits (``openssl rand -hex 32``), surrounding space ignored.

    Raises:
        ValueError: the file does not hold 32 bytes of hex, or others may read it (mode & 0o077).
        OSError: the file cannot be read.
    """
    return read_private_hex(path, KEY_BYTES, "transfer key file",
                            "make one with: openssl rand -hex 32 > FILE; chmod 600 FILE")


def read_private_hex(path: str | os.PathLike, nbytes: int, what: str, make: str) -> bytes:
    """The ``nbytes`` bytes a private file holds as hex digits (surrounding space ignored): a key or
    secret of this user's (the transfer key, the cache-salt secret).

    Raises:
        ValueError: others may read the file (mode & 0o077), or it does not hold ``nbytes`` bytes of
            hex; ``make`` tells how to make a good one.
        OSError: the file cannot be read.
    """
    p = Path(path)
    if p.stat().st_mode & 0o077:
        raise ValueError(f"{what} {p} must be readable by its owner only (chmod 600 {p})")
    try:
        data = bytes.fromhex(p.read_text().strip())
    except ValueError:
        data = b""
    if len(data) != nbytes:
        raise ValueError(f"{what} {p} must hold {nbytes} bytes as {2 * nbytes} hex digits ({make})")
    return data


def layouts_match(a: mpb.PoolLayout, b: mpb.PoolLayout) -> bool:
    """Whether blocks of one pool can be read into the other: equal layout and dtype, any number of blocks."""
    return (a.num_layers, a.num_kv_heads, a.head_dim, a.block_size, a.dtype) == \
        (b.num_layers, b.num_kv_heads, b.head_dim, b.block_size, b.dtype)


__all__ = ["layouts_match", "load_transfer_key", "sign_ticket", "source_digest", "ticket_message", "ticket_signed"]
