"""Signing and checking grants and receipts (``pagedkv.grant.v1``), shared by the memory service and workers.

DESIGN.md, "Trust model": the memory service signs a :class:`StepGrant` saying
what one step may touch of one sequence; the worker checks it before any read or
write and signs a :class:`StepReceipt` for what it computed; the memory service
takes a position as computed (readable, cacheable) only with a receipt. Both
signatures are HMAC-SHA256 (RFC 2104) under the plane key, which only the memory
service and its workers hold (one per pool generation, handed to workers over
the memory service's Unix socket). The signed bytes are a canonical encoding
built here from the fields (not the protobuf wire bytes, which are not
canonical), prefixed with a domain string per kind, so a grant can never pass for
a receipt or the other way round.

Token ids are bound by digest: SHA-256 of the ids as int32 little-endian.

A copy is the tuple ``(src, src_epoch, dst, dst_epoch, src_medium, dst_medium, src_source)``
(media as ``grant_pb2.Medium`` values: 0 device, 1 host, 2 another node's pool; ``src_source``
the digest of that node's ``TransferSource`` for a remote src, ``b""`` otherwise), signed in
grants (copies to do) and in receipts (tier copies and node transfers done).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from array import array
from collections.abc import Sequence as Seq

from pagedkv.grant.v1 import grant_pb2

_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("I").itemsize == 4 and array("Q").itemsize == 8

#: Bytes of a plane key.
KEY_BYTES = 32
_GRANT_DOMAIN = b"pagedkv.grant.v1.StepGrant\x00"
_RECEIPT_DOMAIN = b"pagedkv.grant.v1.StepReceipt\x00"


def _packed(typecode: str, values) -> bytes:
    """``values`` as a little-endian C array of ``typecode`` (the array module: no numpy per call,
    which cost more than the hashing on short lists).

    Raises:
        OverflowError: a value outside the type.
    """
    arr = array(typecode, values)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def token_digest(token_ids: Seq[int]) -> bytes:
    """SHA-256 (32 bytes) of ``token_ids`` as int32 little-endian.

    Raises:
        OverflowError: an id outside int32.
    """
    return hashlib.sha256(_packed("i", token_ids)).digest()


def _u32(values) -> bytes:
    return struct.pack("<I", len(values)) + _packed("I", values)


def _u64(values) -> bytes:
    return struct.pack("<I", len(values)) + _packed("Q", values)


def _bytes(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def copy_tuple(c: grant_pb2.GrantedCopy) -> tuple[int, int, int, int, int, int, bytes]:
    """``(src, src_epoch, dst, dst_epoch, src_medium, dst_medium, src_source)`` of a granted copy."""
    return c.src, c.src_epoch, c.dst, c.dst_epoch, c.src_medium, c.dst_medium, bytes(c.src_source)


def granted_copy(t: tuple) -> grant_pb2.GrantedCopy:
    """The message of a :func:`copy_tuple` tuple."""
    return grant_pb2.GrantedCopy(src=t[0], src_epoch=t[1], dst=t[2], dst_epoch=t[3], src_medium=t[4],
                                 dst_medium=t[5], src_source=t[6])


def _copies(copies) -> bytes:
    return struct.pack("<I", len(copies)) + b"".join(struct.pack("<IQIQBB", *c[:6]) + _bytes(c[6]) for c in copies)


def grant_message(g: grant_pb2.StepGrant) -> bytes:
    """The canonical bytes a grant's signature covers (every field but ``signature``)."""
    return grant_parts_message(g.pool_generation, g.seq_id, g.block_ids, g.block_epochs, g.readable_tokens,
                               g.write_end, g.token_digest, [copy_tuple(c) for c in g.copies], g.expires_at)


def grant_parts_message(pool_generation: int, seq_id: int, block_ids, block_epochs, readable_tokens: int,
                        write_end: int, digest: bytes, copies, expires_at: float) -> bytes:
    """:func:`grant_message` from the fields themselves (``copies``: tuples as :func:`copy_tuple`),
    so the signer need not read them back out of a message it is building."""
    return b"".join((
        _GRANT_DOMAIN,
        struct.pack("<QQqqd", pool_generation, seq_id, readable_tokens, write_end, expires_at),
        _u32(block_ids), _u64(block_epochs), _bytes(digest), _copies(copies),
    ))


def receipt_message(r: grant_pb2.StepReceipt) -> bytes:
    """The canonical bytes a receipt's signature covers (every field but ``signature``)."""
    return receipt_parts_message(r.pool_generation, r.seq_id, r.start, r.end, r.token_digest, r.block_ids,
                                 r.block_epochs, [copy_tuple(c) for c in r.copies])


def receipt_parts_message(pool_generation: int, seq_id: int, start: int, end: int, digest: bytes, block_ids,
                          block_epochs, copies=()) -> bytes:
    """:func:`receipt_message` from the fields themselves (the worker signs as it fills the receipt;
    ``copies``: the tier copies done, tuples as :func:`copy_tuple`)."""
    return b"".join((
        _RECEIPT_DOMAIN,
        struct.pack("<QQqq", pool_generation, seq_id, start, end),
        _bytes(digest), _u32(block_ids), _u64(block_epochs), _copies(copies),
    ))


def mac(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``key`` (32 bytes)."""
    return hmac.digest(key, message, "sha256")


def sign_grant(key: bytes, grant: grant_pb2.StepGrant) -> grant_pb2.StepGrant:
    """Set ``grant.signature`` under ``key``; returns ``grant``."""
    grant.signature = mac(key, grant_message(grant))
    return grant


def grant_signed(key: bytes, grant: grant_pb2.StepGrant) -> bool:
    """True when ``grant.signature`` is the memory service's signature of its fields (constant-time compare)."""
    return hmac.compare_digest(grant.signature, mac(key, grant_message(grant)))


def sign_receipt(key: bytes, receipt: grant_pb2.StepReceipt) -> grant_pb2.StepReceipt:
    """Set ``receipt.signature`` under ``key``; returns ``receipt``."""
    receipt.signature = mac(key, receipt_message(receipt))
    return receipt


def receipt_signed(key: bytes, receipt: grant_pb2.StepReceipt) -> bool:
    """True when ``receipt.signature`` is a worker's signature of its fields (constant-time compare)."""
    return hmac.compare_digest(receipt.signature, mac(key, receipt_message(receipt)))


_DISK_COPY_DOMAIN = b"pagedkv.grant.v1.DiskCopy\x00"
_DISK_RECEIPT_DOMAIN = b"pagedkv.grant.v1.DiskReceipt\x00"


def disk_copy_message(c: grant_pb2.DiskCopy) -> bytes:
    """The canonical bytes a disk copy's signature covers (every field but ``signature``)."""
    return b"".join((
        _DISK_COPY_DOMAIN,
        struct.pack("<QQBIQIQQd", c.pool_generation, c.work_id, c.write, c.host_block, c.host_epoch, c.slot,
                    c.slot_epoch, c.sequence, c.expires_at),
        _bytes(c.block_hash), _bytes(c.parent_hash), struct.pack("<I", len(c.token_ids)), _packed("i", c.token_ids),
    ))


def disk_receipt_message(r: grant_pb2.DiskReceipt) -> bytes:
    """The canonical bytes a disk receipt's signature covers (every field but ``signature``)."""
    return b"".join((
        _DISK_RECEIPT_DOMAIN, struct.pack("<QQB", r.pool_generation, r.work_id, r.ok),
        _bytes(r.failure.encode()), _bytes(r.checksum),
    ))


def sign_disk(key: bytes, message) -> object:
    """Set the ``signature`` of a DiskCopy or DiskReceipt under ``key``; returns it."""
    message.signature = mac(key, _disk_message(message))
    return message


def disk_signed(key: bytes, message) -> bool:
    """True when a DiskCopy's or DiskReceipt's ``signature`` is one made with ``key`` (constant-time compare)."""
    return hmac.compare_digest(message.signature, mac(key, _disk_message(message)))


def _disk_message(m) -> bytes:
    return disk_copy_message(m) if isinstance(m, grant_pb2.DiskCopy) else disk_receipt_message(m)


__all__ = ["KEY_BYTES", "copy_tuple", "disk_copy_message", "disk_receipt_message", "disk_signed", "grant_message",
           "grant_parts_message", "grant_signed", "granted_copy", "mac", "receipt_message", "receipt_parts_message",
           "receipt_signed", "sign_disk", "sign_grant", "sign_receipt", "token_digest"]
