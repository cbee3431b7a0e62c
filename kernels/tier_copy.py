"""Whole-block copies between two block-major tensors: the device pool and the host tier.

DESIGN.md, "Tiers and transfers": an offload copies device block b into host block h, a reload
host block h into device block b, whole blocks (every layer, K and V), before the step's own
writes. Both tensors have the same per-block layout ``[*, num_layers, 2, block_size,
num_kv_heads, head_dim]``; block ids are per tensor.

Pairs are sorted by destination and merged into runs where both source and destination ids
are consecutive, so a sequence's blocks (often allocated in order) move as one copy per run
(one ``cudaMemcpyAsync`` each for a device pool and a page-locked host tier, as vLLM's
``swap_blocks`` does per block). On CUDA the copies are ``non_blocking``: queued on the current
stream, so they run in order before the step's kernels queued after them; host memory must be
page-locked (``cudaHostRegister``, done by :mod:`compute_service.pool_map`) for them to be
asynchronous DMA. The caller synchronizes the stream before it relies on an offload's bytes
in host memory (the worker does so before it signs a receipt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.runtime import test_hooks


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` runs covering ``pairs`` (sorted by dst; a run is consecutive on both sides)."""
    runs: list[list[int]] = []
    for s, d in sorted(pairs, key=lambda p: p[1]):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def copy_blocks_between(src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """``dst[d] = src[s]`` for each pair ``(s, d)``: whole blocks from one tensor into another.

    Args:
        src: [src_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (the pool or the host
            tier), any device.
        dst: [dst_blocks, same per-block shape], same dtype, any device (a CPU tensor over
            page-locked memory for a DMA copy from / to a CUDA ``src``).
        pairs: (src block, dst block) ids, host ints; destinations distinct (then order among
            the pairs does not matter).

    With a test hook at ``tier.copy_block`` (:mod:`pagedkv.runtime.test_hooks`) the blocks go one by one,
    in destination order, the hook called before each: one that raises stops the copy there.

    Raises:
        ValueError: shapes or dtypes differ, an id out of range, a destination repeats (then
            nothing is copied).
    """
    if not pairs:
        return
    if src.dim() != 6 or tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.dtype != dst.dtype:
        raise ValueError(f"blocks must have one shape and dtype: src {tuple(src.shape)} {src.dtype}, "
                         f"dst {tuple(dst.shape)} {dst.dtype}")
    ns, nd = src.shape[0], dst.shape[0]
    if any(not (0 <= s < ns and 0 <= d < nd) for s, d in pairs):
        raise ValueError(f"block ids must lie in [0, {ns}) (src) and [0, {nd}) (dst), got {list(pairs)}")
    if len({d for _, d in pairs}) != len(pairs):
        raise ValueError(f"a dst block repeats in {list(pairs)}; copies would race")
    non_blocking = src.device.type == "cuda" or dst.device.type == "cuda"
    if test_hooks.active("tier.copy_block"):  # tests: a hook before each block (one may stop the copy there)
        for i, (s, d) in enumerate(sorted(pairs, key=lambda p: p[1])):
            test_hooks.call("tier.copy_block", src=src, dst=dst, src_block=s, dst_block=d, index=i, count=len(pairs))
            dst[d].copy_(src[s], non_blocking=non_blocking)
        return
    for s, d, n in block_runs(pairs):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)


__all__ = ["block_runs", "copy_blocks_between"]
