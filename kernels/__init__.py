"""Paged KV-cache kernels: attention that reads keys and values through a block table.

PagedAttention (Kwon et al., SOSP 2023, §4.1). Triton kernels on CUDA; the same ops as vectorized
torch on CPU, where fp32 decode attention and cache writes go to small native C kernels when the
host can build them (`kernels.cpu_native`). Every op takes `backend=None|"triton"|"torch"`; None picks Triton for CUDA tensors.
Triton is imported only when a Triton op runs. `plan_attention` does a step's host work once
(grouping, gather indices, checks) for every layer's attention call (FlashInfer's plan/run).

Cache views are one layer of the block-major pool
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`:
`key_cache = pool[:, layer, 0]`, `value_cache = pool[:, layer, 1]`.
"""

from kernels.cache_ops import copy_blocks, reshape_and_cache
from kernels.decode import paged_decode_attention
from kernels.plan import AttentionPlan, plan_attention
from kernels.prefill import paged_prefill_attention

__all__ = [
    "AttentionPlan",
    "copy_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_attention",
    "reshape_and_cache",
]
