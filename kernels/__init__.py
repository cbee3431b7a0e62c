"""Paged KV-cache kernels: attention that reads keys and values through a block table.

PagedAttention (Kwon et al., SOSP 2023, §4.1). Triton kernels on CUDA; the same ops as vectorized
torch on CPU, where decode attention and cache writes go to small native C kernels when the host
can build them (`kernels.cpu.native`). Triton is imported only when a Triton kernel runs.

Attention is planned once per step and run per layer (FlashInfer's plan/run):
`plan_attention(block_tables, query_start_loc, seq_lens, block_size, host_query_start_loc=...,
host_seq_lens=...)` checks the metadata on the host and picks the kernel (split-KV decode for a
decode-only batch on Triton, the prefill kernel for any other Triton batch, native/torch on
CPU); `paged_attention(query, key_cache, value_cache, plan, scale)` runs it.
`reshape_and_cache` and `copy_blocks` take `backend=None|"triton"|"torch"`; None picks Triton
for CUDA tensors. `copy_blocks_between(src, dst, pairs)` moves whole blocks between the pool
and the host tier (offloads, reloads).

fp8 KV cache (`kernels.fp8`, vLLM's `--kv-cache-dtype fp8`): a float8_e4m3fn pool holds
`quantize_fp8(x, scale)` = x / scale saturated to ±448, with static per-layer, per-KV-head
scales ([num_kv_heads] float32) that the caller passes to each op as `k_scale=` / `v_scale=`
(`reshape_and_cache` quantizes, `paged_attention` dequantizes inside every kernel, from the rows
it reads; block copies move bytes). Queries and new rows stay fp32/fp16/bf16.

Cache views are one layer of the block-major pool
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`:
`key_cache = pool[:, layer, 0]`, `value_cache = pool[:, layer, 1]`.
"""

from kernels.attention import paged_attention
from kernels.cache_ops import copy_blocks, reshape_and_cache
from kernels.fp8 import FP8_DTYPE, FP8_MAX, check_kv_scales, dequantize_fp8, quantize_fp8
from kernels.plan import AttentionPlan, plan_attention
from kernels.tier_copy import copy_blocks_between

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "AttentionPlan",
    "check_kv_scales",
    "copy_blocks",
    "copy_blocks_between",
    "dequantize_fp8",
    "paged_attention",
    "plan_attention",
    "quantize_fp8",
    "reshape_and_cache",
]
