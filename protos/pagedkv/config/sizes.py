"""Byte sizes as flags give them (``--kv-cache-memory 1GiB``), and the default addresses."""

from __future__ import annotations

import os
import re

#: Where every service binds unless told otherwise (plaintext: loopback only, :mod:`pagedkv.runtime.tls`).
DEFAULT_HOST = "127.0.0.1"
#: ``pagedkv memory``'s port.
MEMORY_PORT = 50051
#: ``pagedkv compute``'s port (worker i of ``pagedkv up`` takes ``COMPUTE_PORT + i``).
COMPUTE_PORT = 50052
#: ``pagedkv serve``'s HTTP port.
SERVE_PORT = 8000
#: The memory service's address when none is given.
DEFAULT_MEMORY = f"{DEFAULT_HOST}:{MEMORY_PORT}"
#: A worker's address when none is given.
DEFAULT_WORKER = f"{DEFAULT_HOST}:{COMPUTE_PORT}"
#: ``pagedkv serve``'s URL when none is given (``pagedkv top``).
DEFAULT_SERVE_URL = f"http://{DEFAULT_HOST}:{SERVE_PORT}"

#: CPU pool size when neither ``--num-blocks`` nor ``--kv-cache-memory`` is given (a GPU pool's is
#: ``--gpu-memory-utilization``'s: :mod:`pagedkv.config.gpu_sizing`).
DEFAULT_CPU_KV_MEMORY = "1GiB"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """Parse a memory size such as ``"1GiB"``, ``"512MiB"``, ``"2e9"`` or ``"1.5 GB"`` to bytes.

    Raises:
        ValueError: not a positive size with a known unit.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r}; use e.g. 1GiB, 512MiB, 2GB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def host_cache_bytes(text: str | None) -> int:
    """Bytes of ``--host-cache-memory`` (0, "0B", "0GiB" or empty: no host tier).

    Raises:
        ValueError: a size that does not parse, or more than this machine's memory (the tier is a
            sparse memfd: a size past RAM would start, then fail once it fills).
    """
    text = (text or "0").strip()
    if re.fullmatch(r"0+(\.0*)?\s*[A-Za-z]*", text):
        return 0
    n = parse_bytes(text)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if n > ram:
        raise ValueError(f"--host-cache-memory {text} ({n} bytes) is more than this machine's memory ({ram} bytes); "
                         "give a host tier that fits in RAM beside the pool and the workers")
    return n
