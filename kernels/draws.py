"""Counter-based random draws for sampling: one uniform per sampled row, the same on any device.

DESIGN.md: the draw for output position t of a sequence depends only on (seed + sample index, t).
The worker turns that pair into a 64-bit key (`compute_service.sampling.draw_seed`), and the key
into one uniform number with Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011): counter (0, 0, 0, 0), key (key's low 32 bits, high 32 bits), the first of the
four outputs. That is Triton's ``tl.randint(key, 0)``, so the GPU computes it in a kernel
(`kernels.triton.draws`) and the CPU in numpy here, bit for bit the same.

The float transform is stated and exact: ``u = ((r >> 9) + 0.5) * 2**-23`` for the 32-bit output
``r``, a float32 in [2**-24, 1 - 2**-24] on a grid of 2**23 points, computed without rounding
anywhere (an integer below 2**23 plus one half has 24 significant bits, and the product is by a
power of two), so every device gives the same bits. The sampler then picks the token whose
cumulative probability first exceeds ``u`` times the total (inverse-transform sampling).
"""

from __future__ import annotations

import numpy as np
import torch

#: Philox4x32's multipliers and key increments (Random123; Triton's ``philox_impl``).
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_M32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray],
               rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32-``rounds`` of uint32 arrays: ``counter`` (c0, c1, c2, c3), ``key`` (k0, k1), all
    broadcastable; returns the four uint32 outputs."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    a, b = np.uint64(ROUND_A), np.uint64(ROUND_B)
    for _ in range(rounds):
        pa, pb = a * c0, b * c2  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & _M32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & _M32
        k0, k1 = (k0 + np.uint64(KEY_A)) & _M32, (k1 + np.uint64(KEY_B)) & _M32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def random_uint32(keys: np.ndarray) -> np.ndarray:
    """``tl.randint(key, 0)`` of each 64-bit key: uint64 [S] -> uint32 [S]."""
    keys = np.asarray(keys, dtype=np.uint64)
    zero = np.zeros_like(keys)
    return philox4x32((zero, zero, zero, zero), (keys & _M32, keys >> np.uint64(32)))[0]


def to_uniform(r: np.ndarray) -> np.ndarray:
    """The stated transform: uint32 -> float32 ``((r >> 9) + 0.5) * 2**-23``, in (0, 1), exact."""
    return ((np.asarray(r, dtype=np.uint32) >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) \
        * np.float32(2.0**-23)


def uniforms(keys: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """One uniform per key, float32 [S] on ``device``: computed there by the Triton kernel on a
    GPU, here otherwise; the same bits either way."""
    device = torch.device(device)
    k = np.array(keys, dtype=np.uint64)
    if device.type == "cuda":
        from kernels.triton.draws import uniforms as triton_uniforms

        return triton_uniforms(torch.from_numpy(k.view(np.int64)).to(device))
    return torch.from_numpy(to_uniform(random_uint32(k))).to(device)


__all__ = ["philox4x32", "random_uint32", "to_uniform", "uniforms"]
