"""Launch configurations of the attention kernels: a short list chosen here, searched on the GPU.

Each kernel has a few candidates (context positions per loop iteration ``TILE``, warps, software
pipeline stages). On a GPU, ``triton.autotune`` times every candidate the first time it sees a key
(head_dim, GQA group, block size, dtype class, and a bucket of the context a program walks) and
keeps the fastest for that key. Everywhere else (the interpreter) the first candidate runs. The
list is chosen here, not searched here. tests/kernels/test_triton_aot.py compiles every
candidate for sm_90, so none can fail on the GPU for want of registers or shared memory.

Why these candidates:
- ``TILE`` 32 is the proven default. 64 and 128 halve or quarter the loop's trips and the per-tile
  online-softmax rescale, for long contexts.
- Two or three stages let the pipeliner (``num_stages``) overlap one tile's K/V loads with the
  previous tile's dots. The tile's block ids are loaded a stage ahead for that (``paged.attend_context``).
- fp32 (``IEEE``) prefill tiles stay at 32 columns and 32 rows, to keep the fp32 accumulators in
  registers.
"""

from __future__ import annotations

import triton

#: Decode: one (sequence, KV head, split) program over its context range.
DECODE = (
    triton.Config({"TILE": 32}, num_warps=4, num_stages=2),
    triton.Config({"TILE": 64}, num_warps=4, num_stages=3),
    triton.Config({"TILE": 64}, num_warps=8, num_stages=3),
    triton.Config({"TILE": 128}, num_warps=8, num_stages=2),
)
#: Prefill: one program of BLOCK_M (token, query head) rows over its causal context.
PREFILL = (
    triton.Config({"TILE": 32}, num_warps=4, num_stages=2),
    triton.Config({"TILE": 64}, num_warps=4, num_stages=2),
    triton.Config({"TILE": 64}, num_warps=8, num_stages=3),
)
#: The autotune key: what changes the best candidate (``LEN_BUCKET`` is a run-time argument the
#: kernels do not read, :func:`len_bucket` of the context a program walks).
KEY = ["HEAD_DIM", "GROUP", "BLOCK_SIZE", "IEEE", "FP8", "LEN_BUCKET"]
#: Rows per prefill program by dtype class: 16-bit inputs, fp32 (IEEE) inputs.
PREFILL_BLOCK_M = {False: 64, True: 32}


def len_bucket(tokens: int) -> int:
    """The context bucket of the autotune key: 256, 2048 or 16384 (short, medium, long)."""
    return 256 if tokens <= 256 else 2048 if tokens <= 2048 else 16384


def default(configs: tuple) -> dict:
    """The first candidate as launch keyword arguments (its constants, warps and stages)."""
    c = configs[0]
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def tuned(kernel, configs: tuple):
    """``kernel`` under ``triton.autotune`` over ``configs`` with :data:`KEY` (built once per kernel)."""
    cached = _TUNED.get(id(kernel))
    if cached is None:
        cached = _TUNED[id(kernel)] = triton.autotune(configs=list(configs), key=KEY)(kernel)
    return cached


_TUNED: dict[int, object] = {}
