"""The memory-bandwidth bound of single-stream decode, measured on the machine it runs on.

A decode step at batch 1 reads every weight once (the tied embedding once, as the LM head) and
each layer's K and V of the sequence's context; it computes little, so its speed is bounded by
how fast memory delivers those bytes:

    bound (tokens/s) = bandwidth (bytes/s) / bytes read per token

``copy_bandwidth`` measures the bandwidth the way STREAM's copy does (a[:] = b over buffers much
larger than the caches; bytes read + bytes written per second, best of several passes) and
``read_bandwidth`` as a decode uses memory, reading only (a sum over such a buffer); both on torch's
threads, the same threads a worker computes on. The bound takes the larger of the two (the
stricter bound). ``decode_bytes`` counts the bytes per token from the model's config. `bench_peers`
prints them and pagedkv's single-stream tok/s as a share of the bound (the goal: >= 60%).
"""

from __future__ import annotations

import time

import torch

#: The size of each copy buffer: far beyond the last-level cache of the CPUs measured.
COPY_BYTES = 512 << 20


def copy_bandwidth(nbytes: int = COPY_BYTES, passes: int = 7) -> float:
    """Bytes per second of ``dst.copy_(src)`` over two ``nbytes`` buffers (read + written bytes,
    as STREAM's copy counts them), the best of ``passes`` after one warm-up pass."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = COPY_BYTES, passes: int = 7) -> float:
    """Bytes per second read by ``src.sum()`` over an ``nbytes`` buffer, the best of ``passes``
    after one warm-up pass."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_bytes(config, dtype_bytes: int, context: int) -> int:
    """Bytes a batch-1 decode step reads for one token at ``context`` cached tokens: every
    projection's weight, the norms, the LM head (the tied embedding counted once), and each layer's
    K and V rows of the context. ``config``: a ``compute_service.weights.source.ModelConfig``."""
    d, inter, dh = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = d * (config.num_q_heads + 2 * config.num_kv_heads) * dh + config.num_q_heads * dh * d
    per_layer += 3 * d * inter + 2 * d  # gate, up, down; two norms
    weights = config.num_layers * per_layer + d + config.vocab_size * d  # final norm, LM head
    kv = config.num_layers * 2 * config.num_kv_heads * dh * context
    return (weights + kv) * dtype_bytes


def bound(config, dtype: str, context: int) -> dict:
    """The bound for ``dtype`` ("float32" or "bfloat16") at ``context``, measured now: bytes per
    token, the copy and read bandwidths (bytes/s), and the tokens/s the larger allows."""
    per_token = decode_bytes(config, 2 if dtype == "bfloat16" else 4, context)
    copy, read = copy_bandwidth(), read_bandwidth()
    return {"dtype": dtype, "context": context, "bytes_per_token": per_token, "copy_bandwidth": copy,
            "read_bandwidth": read, "bound_tok_s": max(copy, read) / per_token}
