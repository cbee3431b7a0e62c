"""The worker socket's wire format: one message from the memory service to a worker.

DESIGN.md, "Trust model": the pool's handle goes only to workers. The memory service listens
on a Unix-domain socket (mode 0600 in a 0700 folder, peers checked by uid); on each connection
it sends exactly one message and closes:

    u32 length (big-endian) | JSON of `length` bytes
    + SCM_RIGHTS with the file descriptors the JSON's "fds" names, in order

The JSON is ``{"version": 1, "descriptor": <PoolDescriptor as protobuf JSON, with the handle
fields>, "plane_key": <32 bytes, hex>, "fds": ["pool", "epochs", "host"]}`` (``"pool"`` only on the
cpu backend, where the pool is a memfd; on cuda the IPC handle is in the descriptor; ``"host"``
only with a host tier, the read-write memfd of its ``host_num_blocks`` blocks). The epochs fd is
read-only (int64[num_blocks + host_num_blocks]): the worker can map the epoch table but never
change it.

Both ends live here so that they cannot drift apart; the server's accept loop is
:mod:`memory_service.worker_socket`, the worker's mapping :mod:`compute_service.pool_map`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass, field

from google.protobuf import json_format

from pagedkv.memory.v1 import memory_service_pb2 as pb

#: Wire format version; a receiver refuses any other.
VERSION = 1
#: Bytes of the plane key (HMAC-SHA256 key for grants and receipts).
PLANE_KEY_BYTES = 32
#: Longest JSON accepted (a descriptor is well under 4 KiB).
MAX_MESSAGE_BYTES = 1 << 16
#: Most file descriptors one message carries.
MAX_FDS = 4
#: Longest Unix socket path Linux takes (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH_BYTES = 107
_LEN = struct.Struct(">I")


@dataclass
class PoolHandle:
    """What a worker receives: the full descriptor, the plane key and the open fds.

    The caller owns the fds (close them, or let :func:`compute_service.pool_map.map_pool` do).
    """

    #: The PoolDescriptor with its handle fields (cuda_ipc_handle, cuda_offset, cuda_device_uuid).
    descriptor: pb.PoolDescriptor
    #: 32 bytes, one per pool generation: signs grants and receipts.
    plane_key: bytes
    #: Open fds by name: "pool" (cpu only, read-write memfd), "epochs" (read-only memfd,
    #: int64[num_blocks + host_num_blocks]), "host" (host tier only, read-write memfd).
    fds: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        """Close every fd still held."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def send_handle(conn: socket.socket, descriptor: pb.PoolDescriptor, plane_key: bytes, fds: dict[str, int]) -> None:
    """Send one message on a connected Unix stream socket (blocking; the message fits its buffer).

    Args:
        descriptor: the PoolDescriptor with its handle fields.
        plane_key: 32 bytes.
        fds: name -> fd, sent in insertion order (the fds stay open here).
    """
    assert len(plane_key) == PLANE_KEY_BYTES, len(plane_key)
    body = json.dumps({
        "version": VERSION,
        "descriptor": json_format.MessageToDict(descriptor),
        "plane_key": plane_key.hex(),
        "fds": list(fds),
    }).encode()
    assert len(body) <= MAX_MESSAGE_BYTES, len(body)
    data = _LEN.pack(len(body)) + body
    sent = socket.send_fds(conn, [data], list(fds.values()))
    if sent < len(data):
        conn.sendall(data[sent:])


def receive_handle(path: str, timeout: float = 10.0) -> PoolHandle:
    """Connect to the worker socket at ``path`` and receive the pool's handle.

    Raises:
        FileNotFoundError, ConnectionRefusedError: nobody serves ``path`` (the memory service is
            gone, or the path is not shared with this container).
        PermissionError: the socket is not ours to open (another uid).
        ConnectionError: the service closed without a message (it refused this process's uid:
            its log says so).
        ValueError: a malformed message.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data, fds, _, _ = socket.recv_fds(s, MAX_MESSAGE_BYTES + _LEN.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        try:
            if not data:
                raise ConnectionError(
                    f"the memory service at {path} closed the worker socket without sending the pool "
                    "(it serves only processes of its own uid; see its log)")
            while len(data) < _LEN.size:
                data += _recv_some(s, path)
            (length,) = _LEN.unpack_from(data)
            if length > MAX_MESSAGE_BYTES:
                raise ValueError(f"worker socket message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
            while len(data) < _LEN.size + length:
                data += _recv_some(s, path)
            return _parse(data[_LEN.size:_LEN.size + length], fds)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise


def _recv_some(s: socket.socket, path: str) -> bytes:
    chunk = s.recv(MAX_MESSAGE_BYTES)
    if not chunk:
        raise ConnectionError(f"the memory service at {path} closed the worker socket mid-message")
    return chunk


def _parse(body: bytes, fds: list[int]) -> PoolHandle:
    try:
        msg = json.loads(body)
        if msg.get("version") != VERSION:
            raise ValueError(f"worker socket version {msg.get('version')!r}, this worker speaks {VERSION}")
        names = list(msg["fds"])
        key = bytes.fromhex(msg["plane_key"])
        desc = json_format.ParseDict(msg["descriptor"], pb.PoolDescriptor())
    except (KeyError, TypeError, json.JSONDecodeError, json_format.ParseError) as e:
        raise ValueError(f"malformed worker socket message: {e}") from e
    if len(names) != len(fds) or len(key) != PLANE_KEY_BYTES:
        raise ValueError(f"worker socket message names fds {names} but carried {len(fds)}, "
                         f"and a {len(key)}-byte plane key (want {PLANE_KEY_BYTES})")
    return PoolHandle(desc, key, dict(zip(names, fds)))


__all__ = ["MAX_SOCKET_PATH_BYTES", "PLANE_KEY_BYTES", "PoolHandle", "receive_handle", "send_handle"]
