"""The worker socket: where workers of the memory service's own uid receive the pool's handle.

DESIGN.md, "Trust model": the pool's handle (the cpu memfd, the CUDA IPC handle), the epoch
table and the plane key go only to workers; everyone else reads the layout over gRPC
(GetPoolDescriptor names this socket in ``worker_socket``). The socket is a Unix-domain stream
socket, mode 0600 (created so, under a 0700 folder for the default path); on each connection
the server reads the peer's credentials (``SO_PEERCRED``), closes the connection with a logged
refusal unless the peer runs as this process's uid, and otherwise sends one message
(:mod:`pagedkv.runtime.pool_socket`: descriptor with handle, plane key, fds) and closes.

The default path is ``$PAGEDKV_HOME/run/memory-<pid>.sock``; a starting service removes sockets
there that nobody listens on any more (their service was killed). Containers share one folder
(a volume) and pass the path with ``--worker-socket`` / the worker's ``--memory-socket``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memory_service.pool import Pool
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.paths import pagedkv_home
from pagedkv.runtime.pool_socket import MAX_SOCKET_PATH_BYTES, send_handle

log = get_logger("worker_socket")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The connecting process as the kernel saw it at connect time."""

    #: Process id (0 when the peer is in another pid namespace).
    pid: int
    #: Effective user id.
    uid: int
    #: Effective group id.
    gid: int


def peer_credentials(conn: socket.socket) -> PeerCred:
    """``SO_PEERCRED`` of a connected Unix socket."""
    return PeerCred(*_UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


def check_peer(peer: PeerCred, own_uid: int) -> bool:
    """True when ``peer`` may receive the pool: it runs as ``own_uid``. Logs a refusal otherwise."""
    if peer.uid == own_uid:
        return True
    log.warning("worker_socket_refused", peer_pid=peer.pid, peer_uid=peer.uid, own_uid=own_uid,
                reason="the pool's handle goes only to processes of the memory service's own uid")
    return False


def default_socket_path() -> Path:
    """``$PAGEDKV_HOME/run/memory-<pid>.sock``."""
    return pagedkv_home() / "run" / f"memory-{os.getpid()}.sock"


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # something is there that we cannot judge: leave it
    return True


def remove_stale_sockets(folder: Path) -> list[Path]:
    """Delete ``memory-*.sock`` sockets in ``folder`` that nobody listens on; returns them."""
    removed = []
    for path in folder.glob("memory-*.sock"):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode) and not _listening(path):
                path.unlink()
                removed.append(path)
    if removed:
        log.info("stale_worker_sockets_removed", paths=[str(p) for p in removed])
    return removed


def _prepare_path(path: Path, *, default: bool) -> None:
    """Make the socket's folder (0700 when ours to make) and clear a dead socket at ``path``.

    Raises:
        ValueError: the path is too long for a Unix socket.
        OSError: another process serves ``path``, or a non-socket file is there.
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"worker socket path {str(path)!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes "
                         "(a Unix socket limit); pass a shorter one with --worker-socket")
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if default:
        if folder.stat().st_uid != os.getuid():
            raise PermissionError(f"{folder} belongs to another user; set $PAGEDKV_HOME or pass --worker-socket")
        folder.chmod(0o700)
        remove_stale_sockets(folder)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket; remove it or pass another --worker-socket")
        if _listening(path):
            raise OSError(f"another memory service serves the worker socket {path}; pass another --worker-socket")
        path.unlink()


class WorkerSocketServer:
    """Serves ``pool``'s handle on a Unix socket to processes of this uid.

    Args:
        pool: the pool whose ``worker_descriptor()``, ``plane_key`` and ``worker_fds()`` are sent
            (read at each connection).
        path: where to listen; None = :func:`default_socket_path`.
        credentials: how to read a connection's peer (tests pass a fake one).
    """

    def __init__(self, pool: Pool, path: str | os.PathLike | None = None,
                 credentials: Callable[[socket.socket], PeerCred] = peer_credentials):
        self.pool = pool
        self._default = path is None
        self.path = Path(path) if path is not None else default_socket_path()
        self._credentials = credentials
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listen (socket mode 0600) and accept in a background task; sets ``pool.worker_socket``.

        Raises:
            ValueError, OSError: see :func:`_prepare_path`; or the bind failed.
        """
        _prepare_path(self.path, default=self._default)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            sock.bind(str(self.path))
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self.pool.worker_socket = str(self.path)
        self._task = asyncio.create_task(self._accept_forever())
        log.info("worker_socket_listening", path=str(self.path))

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            with conn:
                try:
                    self._serve(conn)
                except OSError as e:  # the peer left early, or its buffer is full: its problem
                    log.warning("worker_socket_send_failed", error=str(e))

    def _serve(self, conn: socket.socket) -> None:
        peer = self._credentials(conn)
        if not check_peer(peer, os.getuid()):
            return
        conn.setblocking(True)
        conn.settimeout(1.0)  # one small message into a fresh socket's buffer: never waits in practice
        send_handle(conn, self.pool.worker_descriptor(), self.pool.plane_key, self.pool.worker_fds())
        log.info("worker_socket_sent", peer_pid=peer.pid, generation=self.pool.generation)

    async def close(self) -> None:
        """Stop accepting and remove the socket file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            log.info("worker_socket_closed", path=str(self.path))


__all__ = ["PeerCred", "WorkerSocketServer", "check_peer", "default_socket_path", "peer_credentials",
           "remove_stale_sockets"]
