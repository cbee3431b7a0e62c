"""Native CPU kernels (fp32 and bf16, and fp8 caches): paged decode attention and the KV cache
write, in small C files built on first use with the host's compiler (into one library with the fused
elementwise ops of `kernels.cpu.fused`, csrc/fused_cpu.c).

The torch path's decode gathers every sequence's context rows out of the pool into a dense
buffer and runs a dense attention on the copy: the context crosses memory three times. The C
kernel in `csrc/paged_cpu.c` (its fast and generic paths in `csrc/decode_*_cpu.c`) reads each
sequence's blocks in place, once, for all query heads of its GQA groups at once (PagedAttention,
Kwon et al., SOSP 2023, §4.1; vLLM's CPU backend has its own C++ kernels for the same reason).
It runs on torch's OpenMP threads when torch's runtime is the one loaded (small batches on one).
`reshape_and_cache` (`csrc/cache_write_cpu.c`) writes a step's new rows with one call per layer
instead of a handful of torch ops.

The build is `cc -O3 -fopenmp` plus `-mavx512f -mavx512bw -mavx512vl -mavx512dq` (16-wide
vectors) where /proc/cpuinfo lists them and `-mavx2 -mfma` (and `-mf16c`) where it lists those, cached under
`$PAGEDKV_HOME/kernels/` by a hash of the source, flags and compiler, and loaded with ctypes.
Without a C compiler, when the build fails, or with `PAGEDKV_NATIVE_CPU=0`, the torch path runs
instead (`available()` is False); nothing else changes. fp32 and bf16 are native, one dtype per
call (query, caches, new rows and output alike); bf16 is computed in fp32 (widening is exact,
results round to nearest even), as vLLM's CPU attention does. The decode kernel also reads fp8
(float8_e4m3fn) caches with an fp32 or bf16 query: each byte is widened exactly (through fp16's
conversion instruction, F16C / AVX-512F, or integer arithmetic without it) and the layer's
per-KV-head scales (`kernels.fp8`) multiply the head's scaled query and its output; the fp8
cache write is the torch path's (`kernels.reshape_and_cache`).
"""

from __future__ import annotations

import array
import contextlib
import ctypes

import torch

from kernels.cpu.native_lib import CSRC, NativeLibrary

SOURCE = CSRC / "paged_cpu.c"
#: The C files of the decode attention (entry, fast path in two halves compiled at once, generic
#: path) and the cache write.
PAGED_SOURCES = (SOURCE, *(SOURCE.with_name(f"{n}.c") for n in (
    "decode_fast_cpu", "decode_fast_fp8_cpu", "decode_generic_cpu", "cache_write_cpu")))
#: Every C file of the library: attention and cache writes, then the fused elementwise ops
#: (`kernels.cpu.fused`).
SOURCES = (*PAGED_SOURCES, SOURCE.with_name("fused_cpu.c"))
#: Headers the sources include (part of the build's cache key).
HEADERS = tuple(SOURCE.with_name(f"{n}.h") for n in ("simd_cpu", "decode_cpu", "decode_fast_cpu", "fp8_cpu"))
ENV_SWITCH = "PAGEDKV_NATIVE_CPU"

#: The library (`kernels.cpu.native_lib`), built and loaded on first use.
LIBRARY = NativeLibrary("the native CPU kernels are not available", "paged_cpu", SOURCES, HEADERS, switch=ENV_SWITCH)
# Integer arguments go packed in one int64 array: converting 25 ctypes arguments costs more than a
# batch-1 layer's attention.
LIBRARY.declare("paged_decode_packed", [ctypes.c_void_p, ctypes.c_float])
LIBRARY.declare("reshape_and_cache_packed", [ctypes.c_void_p])
_forced: bool | None = None  # set by `use_native`


def __getattr__(name: str):
    # `unavailable_reason`: why the native kernels are not in use (None while they are, or before the first try).
    if name == "unavailable_reason":
        return LIBRARY.unavailable_reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available() -> bool:
    """True when the native kernels are built and loaded (builds them on the first call)."""
    if _forced is False:
        return False
    return LIBRARY.available()


@contextlib.contextmanager
def use_native(enabled: bool):
    """Force the native kernels off (False) or back to their default (True) inside the block (tests,
    benchmarks). Plans built inside the block keep the choice they were built with."""
    global _forced
    before, _forced = _forced, None if enabled else False
    try:
        yield
    finally:
        _forced = before


# dtype -> the kernels' dtype code (bf16 tensors are passed as their 16-bit patterns, fp8 as bytes).
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_FP8_CODE = 2


def supports(rows: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether these tensors can go to the native kernels: CPU, one dtype (fp32 or bf16) for all
    three, or fp32 / bf16 rows over fp8 (float8_e4m3fn) caches (decode attention only: the cache
    write takes one dtype); `rows` (queries, or new keys / values) [n, heads, head_dim] with each
    row's heads dense (rows may be strided); both caches with the same strides and head_dim
    contiguous."""
    dtype = rows.dtype
    cache = key_cache.dtype if key_cache.dtype == torch.float8_e4m3fn else dtype
    if dtype not in _DTYPE_CODE or cache != key_cache.dtype or cache != value_cache.dtype or not rows.is_cpu:
        return False
    (_, heads, dim), rs, ks = rows.shape, rows.stride(), key_cache.stride()
    return (
        rs[2] == 1
        and (rs[1] == dim or heads == 1)
        and ks[3] == 1
        and (ks[2] == dim or key_cache.shape[2] == 1)
        and ks == value_cache.stride()
        and key_cache.shape[3] == dim
    )


def paged_decode(
    query: torch.Tensor,  # [rows, num_q_heads, head_dim] fp32 or bf16
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], query's dtype or fp8
    value_cache: torch.Tensor,  # same shape, dtype and strides as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32 contiguous, cached + new tokens (>= 1)
    seq_index: torch.Tensor,  # [n] int64 contiguous, sequence of each decode row
    q_index: torch.Tensor,  # [n] int64 contiguous, query row of each decode row
    scale: float,
    out: torch.Tensor,  # [rows, num_q_heads, head_dim] query's dtype (row stride free), rows q_index written
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    memo: dict | None = None,  # the caller's per-step dict: checked arguments kept between layers
) -> None:
    """Decode attention of rows `q_index` (sequence `seq_index`) over the paged cache, into `out`.

    fp32 or bf16, one dtype for query, caches and out, or fp8 (float8_e4m3fn) caches read as
    `byte * k_scale[kv_head]` / `byte * v_scale[kv_head]` (`kernels.fp8`) with an fp32 or bf16
    query and out; scores, softmax and sums in fp32, a bf16 output rounded to nearest even.
    Callers check shapes and lengths first (`kernels.plan_attention` does): seq_lens within the
    block tables, supports() true for the query, out laid out as the query. The kernel itself
    checks every block it reads is inside the cache, before it writes anything.

    `memo`: a dict that lives as long as the metadata tensors (the step's plan keeps one). Every
    layer of a step passes the same metadata with tensors of the same shapes, strides and dtypes,
    only at other addresses; with a memo, a call whose layout matches an earlier one's skips the
    checks and the packing, and sets only the addresses (a batch-1 layer's attention is a few
    microseconds of arithmetic, so the Python around it counted).

    Raises:
        RuntimeError: the native kernels are not available.
        ValueError: tensors of the wrong dtype or layout; fp8 caches without [num_kv_heads] fp32
            contiguous CPU scales, or scales for other caches; a block table names a block
            outside [0, num_blocks); a seq_len needs more blocks than its table row holds.
        MemoryError: a thread could not allocate its score buffer.
    """
    lib = LIBRARY.handle or LIBRARY.require()
    key = None
    if memo is not None:
        key = ("paged_decode", query.dtype, query.shape, query.stride(), out.shape, out.dtype, out.stride(),
               key_cache.dtype, key_cache.shape, key_cache.stride(), value_cache.stride(), k_scale is None,
               v_scale is None, id(block_tables), id(seq_lens), id(seq_index), id(q_index))
        args = memo.get(key)
        if args is not None:
            args[0], args[1] = query.data_ptr(), key_cache.data_ptr()
            args[2], args[3] = value_cache.data_ptr(), out.data_ptr()
            args[23] = torch.get_num_threads()
            if k_scale is not None:  # fp8: another layer's scales
                _check_fp8_scales(k_scale, v_scale, key_cache)
                args[26], args[27] = k_scale.data_ptr(), v_scale.data_ptr()
            _decode_rc(lib.paged_decode_packed(args.buffer_info()[0], scale), query, key_cache, block_tables)
            return
    fp8 = _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, seq_index, q_index, out,
                             k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    args = array.array(
        "q",
        (
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), seq_index.data_ptr(), q_index.data_ptr(),
            seq_index.shape[0], query.shape[1], num_kv_heads, head_dim, block_size, block_tables.stride(0),
            query.stride(0), out.stride(0), num_blocks, *key_cache.stride()[:3], *value_cache.stride()[:3],
            torch.get_num_threads(), _DTYPE_CODE[query.dtype], _FP8_CODE if fp8 else _DTYPE_CODE[query.dtype],
            k_scale.data_ptr() if fp8 else 0, v_scale.data_ptr() if fp8 else 0,
        ),
    )  # fmt: skip
    _decode_rc(lib.paged_decode_packed(args.buffer_info()[0], scale), query, key_cache, block_tables)
    if memo is not None:
        memo[key] = args


def _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, seq_index, q_index, out, k_scale,
                       v_scale) -> bool:
    """`paged_decode`'s dtype and layout checks (see its Raises); returns whether the caches are fp8."""
    if out.shape != query.shape or out.dtype != query.dtype or not supports(out, key_cache, value_cache):
        raise ValueError("out must be shaped and typed as the query (fp32 or bf16, as the caches), heads dense")
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:
        _check_fp8_scales(k_scale, v_scale, key_cache)
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale and v_scale are for fp8 caches only")
    index = (block_tables, seq_lens, seq_index, q_index)
    if not (block_tables.dtype == seq_lens.dtype == torch.int32 and seq_index.dtype == q_index.dtype == torch.int64
            and all(t.is_contiguous() and t.is_cpu for t in index)):
        raise ValueError("block_tables and seq_lens must be int32, seq_index and q_index int64, all contiguous on cpu")
    return fp8


def _check_fp8_scales(k_scale, v_scale, key_cache: torch.Tensor) -> None:
    """Raise ValueError unless both scales are [num_kv_heads] float32, contiguous, on the CPU."""
    if not all(
        s is not None and s.dtype == torch.float32 and s.is_cpu and s.is_contiguous()
        and s.shape == (key_cache.shape[2],) for s in (k_scale, v_scale)
    ):  # fmt: skip
        raise ValueError("fp8 caches need k_scale and v_scale: [num_kv_heads] float32, contiguous, on cpu")


def _decode_rc(rc: int, query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Raise for the decode kernel's return code `rc` (0: nothing)."""
    if rc == 0:
        return
    if rc == 2:
        raise ValueError(f"a block table names a block outside the cache [0, {key_cache.shape[0]})")
    if rc == 3:
        raise ValueError(f"a seq_len needs more blocks than a block table row holds ({block_tables.shape[1]})")
    if rc == 4:
        raise ValueError(f"no native kernel for a {query.dtype} query over {key_cache.dtype} caches")
    raise MemoryError("the CPU decode kernel could not allocate its score buffers")


def reshape_and_cache(
    key: torch.Tensor,  # [n, num_kv_heads, head_dim] fp32 or bf16, each row's heads dense
    value: torch.Tensor,  # like key
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], key's dtype
    value_cache: torch.Tensor,  # same shape, dtype and strides as key_cache
    slot_mapping: torch.Tensor,  # [n] int64 contiguous, block * block_size + offset
) -> None:
    """Write each token's key and value rows into its slot: a copy, exact in either dtype (the
    caller checked shapes and supports() for the key).

    Raises:
        RuntimeError: the native kernels are not available.
        ValueError: value rows of another dtype or layout; a slot outside
            [0, num_blocks * block_size); nothing is written then.
    """
    lib = LIBRARY.handle or LIBRARY.require()
    if (
        not supports(value, key_cache, value_cache)
        or key.dtype != value.dtype
        or key.dtype != key_cache.dtype
        or not slot_mapping.is_contiguous()
    ):
        raise ValueError(
            "key, value and the caches must have one dtype (fp32 or bf16; an fp8 cache is written by "
            "kernels.reshape_and_cache), value heads dense; slot_mapping contiguous"
        )
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    kc, vc = key_cache.stride(), value_cache.stride()
    args = array.array(
        "q",
        (
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            slot_mapping.data_ptr(), slot_mapping.shape[0], num_kv_heads, head_dim, block_size, num_blocks,
            key.stride(0), value.stride(0), kc[0], kc[1], vc[0], vc[1], key.element_size(),
        ),
    )  # fmt: skip
    rc = lib.reshape_and_cache_packed(args.buffer_info()[0])
    if rc:
        raise ValueError(
            f"slot_mapping values must lie in [0, {num_blocks * block_size}) "
            f"({num_blocks} blocks x {block_size} tokens)"
        )
