"""``pagedkv memory --kv-events-*``: where the vLLM-format KV events go, and who may read token ids.

A ZMQ socket has no roles: whoever connects reads everything it sends. So a stored block's token
ids (a tenant's prompt) go out only where the operating system or a key restricts the readers:

- ``ipc://PATH`` in a directory of this uid's with mode 0700 (no group or other bits: only this uid
  can reach the socket, the same line the worker socket draws); an abstract socket (``ipc://@...``)
  has no permissions and is refused;
- ``tcp://`` with ``--kv-events-curve``: ZMQ CURVE (CurveZMQ: encrypted, and only a subscriber that
  holds the server's public key completes the handshake). The key pair is kept beside the admin
  token file, in ZMQ's certificate format (``zmq.auth.load_certificate`` reads both):
  ``kv-events.key_secret`` (the secret key) and ``kv-events.key`` (the public key a subscriber
  sets as its ``curve_serverkey``), both mode 0600 since the public key is the subscriber's
  credential here; made at the first start, kept across restarts;
- plain ``tcp://``: block hashes with EMPTY token ids, unless ``--kv-events-insecure`` (a trusted
  network: every host that reaches the port reads every prompt).

The replay socket (ROUTER) sends the same payloads, so it has the same transport and the same
protection as the PUB socket. Both sockets bind (a ``tcp://`` port 0 binds a free port; the ready
file names what was bound).
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass
from pathlib import Path

#: File names of the CURVE key pair, in the admin token file's folder (ZMQ's certificate names).
CURVE_PUBLIC_FILE = "kv-events.key"
CURVE_SECRET_FILE = "kv-events.key_secret"


def add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """The ``--kv-events-*`` flags of ``pagedkv memory`` (off unless ``--kv-events-endpoint``)."""
    g = p.add_argument_group("KV events in vLLM's format (ZMQ PUB, msgpack KVEventBatch; off by default)")
    g.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT|ipc://PATH",
                   help="publish every stored/removed/cleared KV event here, as vLLM 0.32 does, for Dynamo's or "
                        "llm-d's routers (port 0: a free port, named in the ready file); token ids only on ipc:// "
                        "in a 0700 directory of this uid, with --kv-events-curve, or with --kv-events-insecure")
    g.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="ROUTER socket where a subscriber that missed batches asks for them again (vLLM's replay "
                        "protocol; the same transport as --kv-events-endpoint)")
    g.add_argument("--kv-events-topic", default="", help="the topic frame of every message (default empty)")
    g.add_argument("--kv-events-curve", action="store_true",
                   help="ZMQ CURVE on tcp:// endpoints: encrypted, readable only with the public key kept beside "
                        f"the admin token file ({CURVE_PUBLIC_FILE}); token ids are sent")
    g.add_argument("--kv-events-insecure", action="store_true",
                   help="send token ids on a plain tcp:// endpoint: every host that reaches it reads every prompt")


@dataclass(frozen=True, slots=True)
class KvEventsSpec:
    """The ZMQ publisher the flags ask for, checked once (:meth:`from_args`)."""

    #: The PUB socket's endpoint (``tcp://`` or ``ipc://``).
    endpoint: str
    #: The replay ROUTER socket's endpoint; None: no replay.
    replay_endpoint: str | None
    #: The topic frame.
    topic: str
    #: CURVE on the sockets (tcp only).
    curve: bool
    #: Whether stored blocks carry their token ids.
    with_token_ids: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KvEventsSpec | None:
        """None without ``--kv-events-endpoint``.

        Raises:
            ValueError: another --kv-events flag without the endpoint; a transport other than
                tcp:// or ipc://; endpoints of two transports, or the same endpoint twice;
                --kv-events-curve or --kv-events-insecure on ipc://, or both at once; an ipc://
                socket whose folder is not this uid's with mode 0700, or an abstract one.
        """
        endpoint, replay = args.kv_events_endpoint, args.kv_events_replay_endpoint
        if not endpoint:
            used = [f for f, on in (("--kv-events-replay-endpoint", replay),
                                    ("--kv-events-topic", args.kv_events_topic),
                                    ("--kv-events-curve", args.kv_events_curve),
                                    ("--kv-events-insecure", args.kv_events_insecure)) if on]
            if used:
                verb = "needs" if len(used) == 1 else "need"
                raise ValueError(f"{', '.join(used)} {verb} --kv-events-endpoint (the KV events' PUB socket)")
            return None
        scheme = _scheme(endpoint, "--kv-events-endpoint")
        if replay is not None:
            if _scheme(replay, "--kv-events-replay-endpoint") != scheme:
                raise ValueError(f"--kv-events-replay-endpoint {replay} must use the transport of --kv-events-endpoint "
                                 f"({scheme}://): it sends the same events, so it needs the same protection")
            if replay == endpoint:
                raise ValueError(f"--kv-events-replay-endpoint must differ from --kv-events-endpoint ({endpoint})")
        if args.kv_events_curve and args.kv_events_insecure:
            raise ValueError("--kv-events-curve and --kv-events-insecure contradict each other: CURVE restricts who "
                             "reads the events, --kv-events-insecure says anyone may; give one")
        if scheme == "ipc":
            for flag in ("curve", "insecure"):
                if getattr(args, f"kv_events_{flag}"):
                    raise ValueError(f"--kv-events-{flag} is for tcp:// endpoints; an ipc:// socket is protected by "
                                     "its folder (this uid's, mode 0700) and carries token ids")
            for e in (endpoint, replay):
                if e is not None:
                    check_ipc_folder(e)
        return cls(endpoint, replay, args.kv_events_topic, args.kv_events_curve,
                   scheme == "ipc" or args.kv_events_curve or args.kv_events_insecure)


def _scheme(endpoint: str, flag: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        raise ValueError(f"{flag} must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    return scheme


def check_ipc_folder(endpoint: str) -> Path:
    """The folder of ``ipc://PATH``, checked: a real directory (not a symlink) of this uid with mode
    0700, so that only this uid reaches the socket. Never changes a folder's mode (it may be /tmp).

    Raises:
        ValueError: an abstract socket (``ipc://@name``: no permissions at all), a relative path, or
            a folder that is missing, not a directory, another uid's, or open to group or others.
    """
    path = endpoint.partition("://")[2]
    if path.startswith("@"):
        raise ValueError(f"{endpoint}: an abstract Unix socket has no permissions (any local process may read it); "
                         "give a path in a folder of this uid's with mode 0700")
    if not os.path.isabs(path):
        raise ValueError(f"{endpoint}: give an absolute path (ipc:///folder/name)")
    folder = Path(path).parent
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise ValueError(f"{endpoint}: the folder {folder} does not exist (mkdir -m 700 {folder})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{endpoint}: {folder} is not a directory (a symlink is not taken)")
    if st.st_uid != os.getuid():
        raise ValueError(f"{endpoint}: the folder {folder} is owned by uid {st.st_uid}, not this service's uid "
                         f"{os.getuid()}")
    if st.st_mode & 0o077:
        raise ValueError(f"{endpoint}: the folder {folder} has mode {oct(stat.S_IMODE(st.st_mode))}: others could "
                         f"reach the socket and read every prompt's token ids; use a folder of mode 0700 "
                         f"(chmod 700 {folder})")
    return folder


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The publisher's CURVE key pair (Z85 text, 40 characters each) and where it is kept."""

    public: bytes
    secret: bytes
    public_file: Path
    secret_file: Path


def load_curve_keys(folder: str | os.PathLike) -> CurveKeys:
    """The key pair in ``folder`` (the admin token file's), made there at the first start (0600 each).

    Raises:
        ValueError: a key file others may read (group or other bits), owned by another uid, or
            holding no key.
        OSError: the files cannot be made or read.
    """
    import zmq
    import zmq.auth

    folder = Path(folder)
    public_file, secret_file = folder / CURVE_PUBLIC_FILE, folder / CURVE_SECRET_FILE
    if not secret_file.exists():
        public, secret = zmq.curve_keypair()
        _write_certificate(public_file, public, None)
        _write_certificate(secret_file, public, secret)
    for f in (secret_file, public_file):
        st = os.lstat(f)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{f} must be a file of this uid readable by its owner only (chmod 600 {f}); "
                             "remove both kv-events.key files to make a new pair")
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret or zmq.auth.load_certificate(public_file)[0] != public:
        raise ValueError(f"{secret_file} and {public_file} are not one CURVE key pair; remove both to make a new one")
    return CurveKeys(public, secret, public_file, secret_file)


def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> None:
    """A ZMQ certificate file (the format of ``zmq.auth.create_certificates``), mode 0600, atomically."""
    lines = ["#   ZeroMQ CURVE certificate of pagedkv memory's KV events", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


__all__ = ["CURVE_PUBLIC_FILE", "CURVE_SECRET_FILE", "CurveKeys", "KvEventsSpec", "add_kv_events_args",
           "check_ipc_folder", "load_curve_keys"]
