"""fp8 (e4m3) KV caches on the CPU paths, against the dense fp64 reference (Triton: in
tests/kernels/test_kernels_interpret.py).

Every attention path the model can take on the CPU (the native decode kernel for decode rows,
the planned gather + SDPA path, the chunked general path) over batches that mix prompts,
chunked prefill and decode rows, GQA, head_dim 64 (the native kernel's fast path) and 48 (its
generic path), block sizes 16 and 5, fp32 and bf16 queries, and per-KV-head scales four to five
orders of magnitude apart (`kernel_reference.make_fp8_case`). Each output is compared twice,
per query head over its KV head's largest |value|:

- with the reference over the dequantized cache (`fp8 * scale`, what the kernels are asked to
  compute): fp32 within `FP32_TOL`, bf16 within the bf16 tolerance;
- with the reference over the values before quantization: within `UNQUANTIZED_BOUND`.

The cache write stores `kernels.quantize_fp8`'s bytes exactly (saturation, signed zeros,
subnormals, NaN), scales are checked before anything is written or read, and block copies move
fp8 bytes unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.kernel_reference import (
    E4M3_MAX,
    e4m3,
    make_case,
    make_fp8_case,
    make_fp8_code_case,
    place_fp8_edges,
    tolerance,
)

import kernels
from kernels import torch_impl, torch_planned
from kernels.cpu import native as cpu_native
from kernels.fp8 import FP8_DTYPE, WIDENED_UNIT, widen_to_fp16

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# fp32 queries against the reference over the dequantized cache, outputs over their head's
# magnitude: the e4m3 values widen exactly and the scales are applied in fp32, so only fp32
# rounding of the scores, softmax and sums is left (measured <= 6.4e-8 over this file's grid;
# bf16 queries <= 2.6e-3, within the bf16 tolerance).
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# Against the reference over the unquantized values, over the head's magnitude: e4m3 keeps 3
# mantissa bits, so each stored value is off by at most 2^-4 of itself (half an ulp), and a
# softmax-weighted mean of values by at most 2^-4 of the head's largest; a one-token context
# (its output is its one value) can come close. The keys' rounding moves the weights by much less
# with scores of O(1), as make_fp8_case's are (measured <= 3.5e-2 over this file's grid for the
# exact fp64 attention over the fp8 cache itself, <= 3.7e-2 for the kernels with bf16 queries).
UNQUANTIZED_BOUND = 2.0**-4

HEADS = [(6, 2), (9, 3)]  # GQA 3 over two KV heads; SmolLM2's 9 / 3 (every magnitude of the case)
HEAD_DIMS = [64, 48]  # native kernel: fast path (whole vectors) and generic path
BLOCK_SIZES = [16, 5]
QUERY_DTYPES = [torch.float32, torch.bfloat16]


def mixed_batch(b: int) -> list[tuple[int, int]]:
    """(seq_len, new tokens): a chunk after a cached prefix, a whole prompt, decode rows at and
    around block boundaries and past the native kernel's 256-position softmax chunk, a chunk
    ending on a block boundary, a sequence without new tokens."""
    return [(3 * b + 4, b + 1), (37, 37), (1, 1), (b, 1), (2 * b + 3, 1), (300, 1), (2 * b, b), (90, 0)]


@pytest.fixture(params=["native", "gather", "chunked"])
def path(request, monkeypatch):
    """The CPU attention paths: decode rows on the native kernel (the rest gathered), everything
    gathered into padded SDPA batches, everything on the chunked general path (small budgets:
    many context chunks and query tiles)."""
    if request.param == "native" and not cpu_native.available():
        pytest.skip(f"native CPU decode kernel unavailable: {cpu_native.unavailable_reason}")
    if request.param == "chunked":
        monkeypatch.setattr(torch_planned, "PLANNED_MAX_GATHER_ELEMS", 0)
        monkeypatch.setattr(torch_impl, "GATHER_BUDGET_ELEMS", 1 << 12)
        monkeypatch.setattr(torch_impl, "MIN_KV_CHUNK", 8)
        monkeypatch.setattr(torch_impl, "Q_TILE", 16)
    with cpu_native.use_native(request.param == "native"):
        yield request.param


def attend(case, **kw) -> torch.Tensor:
    """The model's calls: one plan, then the attention op with the layer's scales."""
    plan = kernels.plan_attention(case.block_tables, case.query_start_loc, case.seq_lens, case.key_cache.shape[1])
    kw = {"k_scale": case.k_scale, "v_scale": case.v_scale, **kw}
    return kernels.paged_attention(case.query, case.key_cache, case.value_cache, plan, case.scale, **kw)


def spy_native(monkeypatch) -> list[torch.dtype]:
    """Cache dtypes of the native decode kernel's calls, as they happen."""
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda q, k, *a,
                        **kw: calls.append(k.dtype) or real(q, k, *a, **kw))
    return calls


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_attention_over_fp8_cache(heads, head_dim, block_size, query_dtype, path, monkeypatch):
    batch = mixed_batch(block_size)
    case = make_fp8_case([s for s, _ in batch], [n for _, n in batch], *heads, head_dim, block_size, query_dtype,
                         seed=block_size + head_dim)  # fmt: skip
    assert case.k_scale.max() / case.k_scale.min() > 1e3 and case.v_scale.max() / case.v_scale.min() > 1e4
    calls = spy_native(monkeypatch)
    out = attend(case)
    assert calls == ([FP8_DTYPE] if path == "native" else []), "decode rows took the wrong path"
    what = f"{path} {query_dtype} heads={heads} d={head_dim} bs={block_size}"
    assert out.dtype == query_dtype, f"{what}: output dtype {out.dtype}"
    assert not out.isnan().any(), f"{what}: NaN reached the output (a slot outside the context was read)"
    mag = case.head_magnitude()[None, :, None]  # [1, Hq, 1]
    tol = FP32_TOL if query_dtype == torch.float32 else tolerance(query_dtype)
    torch.testing.assert_close(out.double() / mag, case.reference() / mag, **tol, msg=lambda m: f"{what}: {m}")
    err = ((out.double() - case.reference(dequantized=False)) / mag).abs().max().item()
    assert err <= UNQUANTIZED_BOUND, f"{what}: {err:.3g} of the head's magnitude off the unquantized reference"


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_e4m3_code_reads_exactly(head_dim, query_dtype, path):
    # One position: softmax weight exactly 1, so out = e4m3 value x v_scale, rounded once (fp32
    # product, then the query's dtype): every byte decodes exactly, NaN as NaN, on every path.
    case = make_fp8_code_case(head_dim, query_dtype)
    out = attend(case)
    want = case.code_outputs()
    assert torch.equal(out.isnan(), want.isnan()), f"{path}: NaN codes not read as NaN"
    assert torch.equal(out.nan_to_num(), want.nan_to_num()), f"{path}: an e4m3 code decoded inexactly"


@pytest.mark.parametrize("key_dtype", QUERY_DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_reshape_and_cache_stores_quantize_fp8_bytes(block_size, key_dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, n = 12, 3, 48, 9
    k_scale = torch.tensor([1e-3, 10.0, 0.5])  # per KV head, orders of magnitude apart
    v_scale = torch.tensor([40.0, 2e-4, 1.0])
    pool = torch.full((num_blocks, 2, 2, block_size, heads, dim), math.nan, dtype=FP8_DTYPE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(torch.int64)
    # Row-strided keys (a fused QKV output's view), values over many binades; the first rows
    # hold the edges: saturation, infinities, NaN, signed zeros, subnormals and their ties.
    key = (torch.randn(n, heads + 2, dim, generator=gen) * 100)[:, 1 : heads + 1]
    value = torch.randn(n, heads, dim, generator=gen) * torch.exp2(-12 * torch.rand(n, heads, dim, generator=gen))
    place_fp8_edges(key, value, k_scale, v_scale)
    key, value = key.to(key_dtype), value.to(key_dtype)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    before = pool.view(torch.uint8).clone()
    bad = slots.clone()
    bad[4] = num_blocks * block_size
    with pytest.raises(ValueError, match="slot_mapping values"):
        kernels.reshape_and_cache(key, value, kc, vc, bad, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(pool.view(torch.uint8), before), "a rejected write changed the cache"
    kernels.reshape_and_cache(key, value, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    blocks, offs = slots // block_size, slots % block_size
    for name, rows, s, cache in (("key", key, k_scale, kc), ("value", value, v_scale, vc)):
        got = cache[blocks, offs].view(torch.uint8)
        assert torch.equal(got, kernels.quantize_fp8(rows, s).view(torch.uint8)), f"{name}s are not quantize_fp8's"
        assert torch.equal(got, e4m3(rows, s).view(torch.uint8)), f"{name}s differ from the e4m3 definition"
    if key_dtype == torch.float32:  # the edges as written (a 16-bit cast moves some first)
        edge_bytes = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x00, 0x80, 0x00, 0x80, 0x00, 0x02, 0x01, 0x38, 0x3A,
                      0x80,
                      0x08]  # fmt: skip
        assert vc[blocks[0], offs[0], :, :18].view(torch.uint8).tolist() == [edge_bytes] * heads
    after = pool.view(torch.uint8).clone()
    after[blocks, 1, :, offs] = before[blocks, 1, :, offs]
    assert torch.equal(after, before), "a write landed outside its slot"


def test_quantize_fp8_rounds_to_nearest_even_and_saturates():
    one = torch.ones(1)
    x = torch.tensor([448.0, 449.0, 1e9, math.inf, -math.inf, math.nan, -0.0, 1e-30,
                      2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, -1.0625, 2.0**-6 - 2.0**-10])  # fmt: skip
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x80, 0x00,
            0x00, 0x02, 0x38, 0x3A, 0xB8, 0x08]  # fmt: skip
    got = kernels.quantize_fp8(x[:, None, None], one).view(torch.uint8).flatten().tolist()
    assert got == want, [hex(b) for b in got]
    # Every finite code survives dequantize -> quantize; each scale acts on its own head.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(2, 2, 64)
    scale = torch.tensor([2.0**-20, 3.0])
    back = kernels.quantize_fp8(kernels.dequantize_fp8(codes, scale), scale)
    finite = (codes.view(torch.uint8) & 0x7F) != 0x7F
    assert torch.equal(back.view(torch.uint8)[finite], codes.view(torch.uint8)[finite])
    assert kernels.dequantize_fp8(codes, scale, torch.bfloat16).dtype == torch.bfloat16
    # The torch paths' fast widening: every byte exactly, times 2^-8, NaN and signs kept.
    wide = widen_to_fp16(codes.view(torch.uint8)).float() / WIDENED_UNIT
    exact = codes.float()
    assert torch.equal(wide.isnan(), exact.isnan()) and torch.equal(wide.nan_to_num(), exact.nan_to_num())
    assert torch.equal(wide.signbit(), exact.signbit())
    assert kernels.FP8_MAX == torch.finfo(kernels.FP8_DTYPE).max == E4M3_MAX


def test_copy_blocks_move_fp8_bytes():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (10, 3, 2, 5, 2, 16), dtype=torch.uint8, generator=gen).view(FP8_DTYPE)
    before = pool.view(torch.uint8).clone()
    kernels.copy_blocks(pool, torch.tensor([[1, 7], [4, 2], [1, 9]]), backend="torch")
    got = pool.view(torch.uint8)
    assert torch.equal(got[[7, 2, 9]], before[[1, 4, 1]]), "copy-on-write did not copy the bytes"
    rest = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(got[rest], before[rest]), "a block outside dst changed"
    # The host tier: whole blocks between two fp8 tensors (offload, reload).
    host = torch.zeros(4, *pool.shape[1:], dtype=FP8_DTYPE)
    kernels.copy_blocks_between(pool, host, [(3, 0), (4, 1), (8, 3)])
    assert torch.equal(host.view(torch.uint8)[[0, 1, 3]], got[[3, 4, 8]])
    kernels.copy_blocks_between(host, pool, [(0, 5)])
    assert torch.equal(pool.view(torch.uint8)[5], got[3])


def test_scales_are_checked_before_anything_runs():
    case = make_fp8_case([5, 9], [1, 2], 6, 2, 64, 4, torch.float32)
    kc, vc, ks, vs = case.key_cache, case.value_cache, case.k_scale, case.v_scale
    plan = kernels.plan_attention(case.block_tables, case.query_start_loc, case.seq_lens, 4)
    bad = {
        "needs k_scale": {"v_scale": vs},
        "needs v_scale": {"k_scale": ks},
        r"must be \[num_kv_heads\] = \[2\]": {"k_scale": case.scales[:, 0], "v_scale": vs},  # [num_layers, H]
        "v_scale must be float32": {"k_scale": ks, "v_scale": vs.double()},
        "on the cache's device": {"k_scale": ks, "v_scale": torch.ones(2, device="meta")},
        "k_scale must be contiguous": {"k_scale": torch.ones(2, 2)[:, 0], "v_scale": vs},
    }
    key = torch.randn(2, 2, 64)
    slots = torch.tensor([0, 1])
    before = case.pool.view(torch.uint8).clone()
    for match, kw in bad.items():
        with pytest.raises(ValueError, match=match):
            kernels.paged_attention(case.query, kc, vc, plan, case.scale, **kw)
        with pytest.raises(ValueError, match=match):
            kernels.reshape_and_cache(key, key, kc, vc, slots, **kw)
    with pytest.raises(ValueError, match="fp8 is a cache format"):
        kernels.paged_attention(case.query.to(FP8_DTYPE), kc, vc, plan, case.scale, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="an fp8 cache quantizes them"):
        kernels.reshape_and_cache(key.to(FP8_DTYPE), key, kc, vc, slots, k_scale=ks, v_scale=vs)
    assert torch.equal(case.pool.view(torch.uint8), before), "a refused call wrote the cache"
    # Scales for a cache that is not fp8.
    dense = make_case([5, 9], [1, 2], 6, 2, 64, 4, torch.float32)
    dense_before = dense.pool.clone()
    with pytest.raises(ValueError, match="fp8 .* caches only"):
        kernels.paged_attention(dense.query, dense.key_cache, dense.value_cache, plan, dense.scale, k_scale=ks,
                                v_scale=vs)
    with pytest.raises(ValueError, match="fp8 .* caches only"):
        kernels.reshape_and_cache(key, key, dense.key_cache, dense.value_cache, slots, k_scale=ks)
    assert torch.equal(dense.pool.isnan(), dense_before.isnan())
    assert torch.equal(dense.pool.nan_to_num(), dense_before.nan_to_num()), "a refused call wrote the cache"
    # The native kernel refuses fp8 caches without scales, and fp8 writes (the torch path's).
    if cpu_native.available():
        out = torch.empty_like(case.query[:1])
        rows = torch.zeros(1, dtype=torch.int64)
        with pytest.raises(ValueError, match="need k_scale and v_scale"):
            cpu_native.paged_decode(case.query[:1], kc, vc, case.block_tables, case.seq_lens, rows, rows, 1.0, out)
        with pytest.raises(ValueError, match="one dtype"):
            cpu_native.reshape_and_cache(key, key, kc, vc, slots)
        assert torch.equal(case.pool.view(torch.uint8), before)


def test_bf16_query_over_fp8_runs_sdpa_in_bf16():
    # e4m3 is exact in bf16: a bf16 query keeps torch's bf16 CPU flash attention.
    assert torch_planned.sdpa_dtype(torch.bfloat16, FP8_DTYPE) == torch.bfloat16
    assert torch_planned.sdpa_dtype(torch.float32, FP8_DTYPE) == torch.float32
