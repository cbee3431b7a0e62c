"""Whose prefix-cache entries a request may share: a secret of the user's, kept in a private file.

The memory service shares cached blocks between requests whose (model, cache salt) are equal, and
on loopback every local process may talk to it. A request with an empty salt would share (and so
reveal, through prefix-cache hits and KV-event hashes) its prompt with every other local process.
So a :class:`~client.api.Client`, and ``pagedkv serve``'s tenant namespaces, salt their requests
with a secret of the user's: 32 random bytes in ``$PAGEDKV_HOME/cache-salt-secret`` (mode 0600,
made on first use; the same uid is the trust line already). Processes of one user share their
cache; another user's can neither hit nor confirm their prompts. Several users share a cache
only on purpose, by giving each the same namespace (``Client(cache_namespace=...)``) or the same
secret file (``pagedkv serve --cache-salt-secret-file``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from pagedkv.runtime.paths import pagedkv_home
from pagedkv.runtime.transfer import read_private_hex

#: Bytes of a secret.
SECRET_BYTES = 32
#: Hex digits of a namespace (128 bits).
NAMESPACE_CHARS = 32


def secret_path() -> Path:
    """The user's secret file: ``$PAGEDKV_HOME/cache-salt-secret``."""
    return pagedkv_home() / "cache-salt-secret"


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    """The secret in ``path`` (default :func:`secret_path`), made on first use (0600, atomically).

    Raises:
        ValueError: the file may be read by other users (group or other permission bits: a salt
            others can read protects nothing), or does not hold 32 bytes in hex.
        OSError: it cannot be read or made.
    """
    p = Path(path) if path is not None else secret_path()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(SECRET_BYTES).hex() + "\n")
    return read_private_hex(p, SECRET_BYTES, "cache-salt secret", "remove it to make a new one")


def namespace(secret: bytes, label: str) -> str:
    """The cache namespace of ``label`` under ``secret``: HMAC-SHA256 in :data:`NAMESPACE_CHARS` hex
    digits (never containing ':', so a salt's namespace ends at its first ':')."""
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:NAMESPACE_CHARS]


def salted(ns: str, salt: str | None) -> str:
    """The salt a request carries: namespace ``ns`` joined with its own ``salt``, which can only
    narrow sharing (``ns`` empty: the salt alone)."""
    if not ns:
        return salt or ""
    return f"{ns}:{salt}" if salt else ns


__all__ = ["load_secret", "namespace", "salted", "secret_path"]
