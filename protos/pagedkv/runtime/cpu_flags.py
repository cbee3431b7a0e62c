"""The host CPU's feature flags, and what they say about the dtypes it computes natively.

Shared by the dtype rule (:func:`pagedkv.config.default_dtype`, which the memory service applies
without torch) and the native kernels (`kernels.cpu.native_lib`, which pick their vector width).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

#: Flags of which one makes bfloat16 a native compute dtype: AVX-512 BF16's dot products
#: (``vdpbf16ps``) or AMX's bf16 tiles. vLLM's CPU backend keys its bf16 default on the same.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86-64 Linux; empty elsewhere), less
    those ``PAGEDKV_TEST_CPU_FLAGS`` leaves out when it is set (test only: a list of flags, of
    which only those the CPU has count, so a test can take instructions away, never add them)."""
    from pagedkv.config.envs import env  # here: pagedkv.config imports this module

    kept = env("PAGEDKV_TEST_CPU_FLAGS")
    flags = _host_flags()
    return flags if kept is None else flags & frozenset(kept.replace(",", " ").split())


@functools.cache
def _host_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
                          []))


def computes_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU (``flags``, default :func:`cpu_flags`) computes bfloat16 natively: it lists
    one of :data:`BF16_FLAGS`."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)
