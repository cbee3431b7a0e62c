"""A worker's reads and writes of disk-tier slots: whole blocks, checksummed, O_DIRECT where it works.

The layout and header are `pagedkv.runtime.disk_block`'s. A write puts the payload first and the
header last, so the header commits the slot. A read checks the header (magic, MAC, identity, the
hash the grant expects) and then the payload's checksum before the bytes count as
read. A slot that fails either check is reported, never used.

Buffered I/O by default (docs/benchmarks.md, section 21: faster than ``O_DIRECT`` where it was
measured). ``O_DIRECT`` on request skips the page cache, so that a disk tier larger than memory
does not evict the host's other pages. It needs aligned offsets, lengths and buffers: the slots
are 4 KiB aligned, and a page-aligned bounce buffer (an anonymous mmap) carries each slot. A file
system that refuses ``O_DIRECT`` (tmpfs) is opened buffered, with a log line; the bytes are the
same either way.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

import numpy as np

from pagedkv.runtime import test_hooks
from pagedkv.runtime.disk_block import HEADER_BYTES, BlockHeader, checksum, pack_header, unpack_header
from pagedkv.runtime.logs import get_logger

log = get_logger("disk_io")


def open_slab(path: str, direct: bool = False) -> tuple[int, bool]:
    """Open slab file ``path`` for reading and writing: (fd, whether O_DIRECT is on).

    ``direct`` asks for O_DIRECT; where the file system refuses it (EINVAL: tmpfs), the file is
    opened buffered and a line is logged.

    Raises:
        OSError: the file cannot be opened at all.
    """
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("disk_direct_io_refused", path=path, message="the file system refuses O_DIRECT; buffered I/O")
    return os.open(path, flags), False


@dataclass(frozen=True, slots=True)
class ReadResult:
    """What :meth:`SlabIO.read` found: ``ok``, or why not (``reason``: "header" or "checksum")."""

    ok: bool
    reason: str = ""
    header: BlockHeader | None = None


class SlabIO:
    """Whole-slot reads and writes of one open slab file.

    Args:
        fd: the slab, from :func:`open_slab`.
        slot_bytes: bytes per slot (`pagedkv.runtime.disk_block.slot_bytes`).
        direct: whether ``fd`` has O_DIRECT (every transfer then goes through the aligned bounce buffer).
    """

    def __init__(self, fd: int, slot_bytes: int, direct: bool):
        self.fd, self.slot_bytes, self.direct = fd, slot_bytes, direct
        self._bounce = mmap.mmap(-1, slot_bytes)  # page-aligned
        self._view = np.frombuffer(self._bounce, dtype=np.uint8)

    def close(self) -> None:
        """Close the file (and the bounce buffer, unless a traceback still holds a view of it: then
        it goes with that view)."""
        self._view = None
        try:
            self._bounce.close()
        except BufferError:
            pass
        os.close(self.fd)

    def write(self, slot: int, header: BlockHeader, payload: np.ndarray) -> None:
        """Write ``payload`` (uint8, the block's bytes) into ``slot``, then ``header`` (whose
        checksum and size must be the payload's; see :func:`header_for`).

        Raises:
            OSError: the write failed (ENOSPC, EIO): the slot is not committed (its old header, if
                any, no longer matches its bytes).
        """
        off = slot * self.slot_bytes
        n = payload.nbytes
        if self.direct:
            self._view[HEADER_BYTES:HEADER_BYTES + n] = payload.reshape(-1).view(np.uint8)
            self._view[HEADER_BYTES + n:] = 0
            _full(os.pwrite(self.fd, memoryview(self._bounce)[HEADER_BYTES:], off + HEADER_BYTES),
                  self.slot_bytes - HEADER_BYTES)
        else:
            _full(os.pwrite(self.fd, memoryview(payload.reshape(-1).view(np.uint8)), off + HEADER_BYTES), n)
        test_hooks.call("disk.between_payload_and_header", slot=slot)
        raw = pack_header(header)
        if self.direct:
            self._view[:HEADER_BYTES] = np.frombuffer(raw, dtype=np.uint8)
            _full(os.pwrite(self.fd, memoryview(self._bounce)[:HEADER_BYTES], off), HEADER_BYTES)
        else:
            _full(os.pwrite(self.fd, raw, off), HEADER_BYTES)

    def read(self, slot: int, into: np.ndarray, *, identity: bytes | None = None,
             block_hash: bytes | None = None) -> ReadResult:
        """Read ``slot`` and check it: its header (its size the block's; given, ``identity`` and
        ``block_hash`` the ones expected), then its payload against the header's checksum; only
        then is the payload copied ``into`` (uint8, the block's size: e.g. a host-tier block).
        Nothing is copied on a failed check.

        Raises:
            OSError: the read failed.
        """
        off = slot * self.slot_bytes
        n = into.nbytes
        if self.direct:
            got = os.preadv(self.fd, [self._bounce], off)
            raw, body = bytes(self._view[:HEADER_BYTES]), self._view[HEADER_BYTES:HEADER_BYTES + n]
            if got < HEADER_BYTES + n:
                return ReadResult(False, "header")
        else:
            raw = os.pread(self.fd, HEADER_BYTES, off)
            body = self._view[HEADER_BYTES:HEADER_BYTES + n]
            if os.preadv(self.fd, [memoryview(self._bounce)[HEADER_BYTES:HEADER_BYTES + n]], off + HEADER_BYTES) < n:
                return ReadResult(False, "header")
        header = unpack_header(raw)
        if (header is None or header.payload_bytes != n or identity not in (None, header.identity)
                or block_hash not in (None, header.block_hash)):
            return ReadResult(False, "header", header)
        if checksum(body) != header.checksum:
            return ReadResult(False, "checksum", header)
        into.reshape(-1).view(np.uint8)[:] = body
        return ReadResult(True, "", header)


def header_for(payload: np.ndarray, *, identity: bytes, block_hash: bytes, parent_hash: bytes | None,
               tokens, sequence: int) -> BlockHeader:
    """The header of a slot holding ``payload`` (uint8, the block's bytes): its checksum and size
    computed here."""
    data = payload.reshape(-1).view(np.uint8)
    return BlockHeader(identity, block_hash, parent_hash or bytes(32), checksum(data), data.nbytes, sequence,
                       tuple(int(t) for t in tokens))


def _full(written: int, want: int) -> None:
    if written != want:  # a short write: the file system is full part-way
        raise OSError(errno.ENOSPC, f"short write: {written} of {want} bytes")


__all__ = ["ReadResult", "SlabIO", "header_for", "open_slab"]
