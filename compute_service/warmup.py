"""Compile a GPU worker's Triton kernels before it says SERVING.

Triton compiles a kernel at its first launch with a new set of compile-time constants, which
takes seconds per variant. Without a warm-up, the first requests a worker serves pay for that,
and so does the first request after every restart. :func:`warm_kernels` launches each kernel that
the worker's steps will launch once, on scratch tensors of the pool's layout and dtype:
- the cache write;
- decode attention with one range and split (the split count is a run-time argument, so these two
  cover every count);
- prefill attention;
- the block copy;
- the sampler's draws.

With ``TRITON_CACHE_DIR`` on a volume (compose, Kubernetes), a restarted worker loads them from
disk instead. The attention kernels are autotuned per context bucket (kernels.triton.tuning): the
warm-up tunes the shortest, and a longer bucket is tuned at its first launch.

The scratch tensors are the worker's own: the mapped pool is never touched.
"""

from __future__ import annotations

import time

import torch

import kernels
from kernels import draws


def warm_kernels(num_q_heads: int, pool: torch.Tensor, kv_scales=None, backend: str = "triton") -> dict[str, float]:
    """Launch every Triton kernel a step over ``pool`` runs, on scratch tensors of its layout.

    Args:
        num_q_heads: the model's query heads.
        pool: the mapped pool, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            (read for its layout, dtype and device only).
        kv_scales: an fp8 pool's per-layer (k_scale, v_scale); the first layer's are used.
        backend: "triton" (a GPU, or the interpreter in tests).

    Returns:
        seconds per kernel family, in launch order.
    """
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    device = pool.device
    query_dtype = torch.bfloat16 if pool.dtype == kernels.FP8_DTYPE else pool.dtype
    scratch = torch.zeros(4, *pool.shape[1:], dtype=pool.dtype, device=device)  # 4 blocks of the pool's layout
    key_cache, value_cache = scratch[:, 0, 0], scratch[:, 0, 1]
    ks, vs = kv_scales[0] if kv_scales else (None, None)
    seconds: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[name] = time.perf_counter() - t

    seq_len = 2 * block_size + 1  # three blocks: several tiles when blocks are small
    kv = torch.zeros(seq_len, num_kv_heads, head_dim, dtype=query_dtype, device=device)
    slots = torch.arange(seq_len, dtype=torch.int64, device=device)
    timed("cache write", lambda: kernels.reshape_and_cache(kv, kv, key_cache, value_cache, slots, k_scale=ks,
                                                           v_scale=vs, backend=backend))
    tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    q1 = torch.zeros(1, num_q_heads, head_dim, dtype=query_dtype, device=device)
    for name, splits in (("decode", 1), ("decode, split", 2)):
        plan = kernels.plan_attention(tables, one, lens, block_size, backend=backend, num_splits=splits,
                                      host_query_start_loc=one.cpu(), host_seq_lens=lens.cpu())
        timed(name, lambda p=plan: kernels.paged_attention(q1, key_cache, value_cache, p, 0.125, k_scale=ks,
                                                           v_scale=vs))
    qsl = torch.tensor([0, seq_len], dtype=torch.int32, device=device)
    qp = torch.zeros(seq_len, num_q_heads, head_dim, dtype=query_dtype, device=device)
    plan = kernels.plan_attention(tables, qsl, lens, block_size, backend=backend, host_query_start_loc=qsl.cpu(),
                                  host_seq_lens=lens.cpu())
    timed("prefill", lambda: kernels.paged_attention(qp, key_cache, value_cache, plan, 0.125, k_scale=ks, v_scale=vs))
    pairs = torch.tensor([[0, 3]], dtype=torch.int64, device=device)
    timed("block copy", lambda: kernels.copy_blocks(scratch, pairs, backend=backend))
    timed("sampler draws", lambda: draws.uniforms([1, 2], device))
    return seconds


__all__ = ["warm_kernels"]
