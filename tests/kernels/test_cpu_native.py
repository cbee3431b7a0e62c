"""Native CPU kernels (kernels/cpu/csrc/paged_cpu.c) in fp32 and bf16, against the fp64 dense reference.

Decode over GQA ratios 1..32, head dims on the fast path (32, 64, 128) and off it (80), block
sizes 1, 16, 24, 32, context lengths at and around block boundaries and past a softmax chunk,
layer views `pool[:, layer, 0/1]` of a block-major pool with NaN in every slot outside the
context; bf16 rounding (to nearest even, NaN kept); the cache write as an exact copy. fp8
(e4m3) caches read by fp32 and bf16 queries with per-KV-head scales, against the reference over
the dequantized cache, with every byte decoded exactly, also by the portable decoder of hosts
without F16C.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re

import pytest
import torch
from helpers.kernel_reference import make_case, make_fp8_case, make_fp8_code_case, ref_attention, tolerance

import kernels
from kernels.cpu import native as cpu_native
from kernels.cpu import native_lib

pytestmark = [pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built"),
              pytest.mark.usefixtures("one_torch_thread")]

HEADS = [(8, 8), (4, 2), (9, 3), (28, 4), (16, 2), (32, 1)]  # GQA ratios 1, 2, 3, 7, 8, 32
DTYPES = [torch.bfloat16, torch.float32]


def lengths(block_size: int) -> list[int]:
    # Around block ends, the kernel's 8- and 16-position tiles and its 256-position softmax chunks.
    lens = {1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 7, 17, 255, 257, 300, 613}
    return sorted(n for n in lens if n >= 1)


def decode(case, out=None):
    """cpu_native.paged_decode over every sequence of a decode case; returns out."""
    n = case.query.shape[0]
    out = torch.full_like(case.query, math.nan) if out is None else out
    rows = torch.arange(n, dtype=torch.int64)
    cpu_native.paged_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, rows, rows,
        case.scale, out,
    )  # fmt: skip
    return out


def check(out, case, dtype, what):
    ref = ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
        case.seq_lens, case.scale,
    )  # fmt: skip
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}"
    assert not out.isnan().any(), f"{what}: NaN reached the output (a slot outside the context was read)"
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype), msg=lambda m: f"{what}: {m}")
    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 24, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_reference(heads, head_dim, block_size, dtype):
    lens = lengths(block_size)
    case = make_case(lens, [1] * len(lens), *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    assert not case.key_cache.is_contiguous()  # a layer slice of the block-major pool
    what = f"{dtype} heads={heads} d={head_dim} bs={block_size}"
    ref = check(decode(case), case, dtype, what)
    if dtype == torch.bfloat16:  # fp32 arithmetic, one rounding at the end: within half a bf16 ulp
        torch.testing.assert_close(
            decode(case).double(), ref, rtol=2**-8 * 1.05, atol=1e-5, msg=lambda m: f"{what} rounding: {m}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_path_runs_native_in_bf16(dtype, monkeypatch):
    # The planned call of the model reaches the native kernel (no gather fallback) for bf16 too.
    case = make_case([40, 41, 300, 8], [1, 1, 1, 1], 9, 3, 64, 16, dtype)
    plan = kernels.plan_attention(case.block_tables, case.query_start_loc, case.seq_lens, 16)
    assert plan.decode is not None
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = kernels.paged_attention(case.query, case.key_cache, case.value_cache, plan, case.scale)
    assert calls == [1], "the planned decode did not go to the native kernel"
    assert not plan.decode._groups, "the decode rows were gathered"
    check(out, case, dtype, f"planned {dtype}")


def test_memo_serves_every_layer_and_only_its_own_layout():
    # The model's layers share a step's metadata; with the plan's memo, a call whose layout matches
    # an earlier one sets only the addresses. Each layer (its own caches, query and out) must still
    # give its own attention, and a call of another layout must not take a kept entry.
    base = make_case([40, 300, 8], [1, 1, 1], 9, 3, 64, 16, torch.bfloat16, seed=5, num_layers=3)
    gen = torch.Generator().manual_seed(6)
    layers = [dataclasses.replace(base, layer=i, query=torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16))
              for i in range(3)]
    memo: dict = {}
    index = torch.arange(3, dtype=torch.int64)
    outs = []
    for case in layers * 2:
        out = torch.full_like(case.query, math.nan)
        cpu_native.paged_decode(case.query, case.key_cache, case.value_cache, base.block_tables, base.seq_lens,
                                index, index, case.scale, out, memo=memo)
        check(out, case, torch.bfloat16, f"memoized layer {case.layer}")
        outs.append(out)
    assert len(memo) == 1
    assert not torch.equal(outs[0], outs[1])  # the layers differ, so a stale address would show
    wide = torch.randn(3, 12, 64, generator=gen).to(torch.bfloat16)  # a strided query: another layout
    wide[:, :9] = layers[1].query
    out = torch.full_like(layers[1].query, math.nan)
    cpu_native.paged_decode(wide[:, :9], layers[1].key_cache, layers[1].value_cache, base.block_tables,
                            base.seq_lens, index, index, base.scale, out, memo=memo)
    assert torch.equal(out, outs[1])
    assert len(memo) == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_threads_and_strided_rows(threads):
    # Enough work for the OpenMP team; query rows strided (views into a fused QKV output).
    lens = [1000, 3, 517, 64, 65, 999, 2, 300]
    case = make_case(lens, [1] * len(lens), 12, 4, 64, 16, torch.bfloat16, seed=3)
    wide = torch.randn(len(lens), 20, 64).to(torch.bfloat16)
    wide[:, :12] = case.query
    case.query = wide[:, :12]
    out = torch.full((len(lens), 20, 64), math.nan, dtype=torch.bfloat16)[:, 4:16]
    torch.set_num_threads(threads)
    check(decode(case, out), case, torch.bfloat16, f"threads={threads}")


def test_bf16_output_rounds_to_nearest_even_and_keeps_nan():
    # Two positions with equal keys: the output is the exact fp32 mean of two values, a tie
    # halfway between two bf16 numbers that must round to the even one (truncation would not).
    case = make_case([2, 2, 1], [1, 1, 1], 2, 1, 32, 4, torch.bfloat16)
    kc, vc, bt = case.key_cache, case.value_cache, case.block_tables
    ulp = 2.0**-7
    pairs = [(1.0, 1.0 + ulp), (1.0 + ulp, 1.0 + 2 * ulp)]
    for s, (a, b) in enumerate(pairs):
        blk = int(bt[s, 0])
        kc[blk, :2] = 0.5
        vc[blk, 0], vc[blk, 1] = a, b
    case.query[2, 0] = math.nan  # a NaN query: NaN out, in bf16 too
    out = decode(case)
    want = [(torch.tensor(a) + torch.tensor(b)) / 2 for a, b in pairs]
    for s, w in enumerate(want):
        assert torch.equal(out[s], w.to(torch.bfloat16).expand_as(out[s])), (s, out[s, 0, :4])
    assert out[0, 0, 0].item() == 1.0 and out[1, 0, 0].item() == 1.0 + 2 * ulp
    assert out[2, 0].isnan().all() and not out[2, 1].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 24])
def test_cache_write_is_an_exact_copy(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim = 9, 3, 64
    pool = torch.full((num_blocks, 2, 2, block_size, heads, dim), math.nan, dtype=dtype)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    n = 2 * block_size + 1
    qkv = torch.randn(n, 15, dim, generator=gen).to(dtype)  # fused QKV rows: k, v are row-strided views
    key, value = qkv[:, 9:12], qkv[:, 12:15]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    before = pool.clone()
    cpu_native.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc[slots // block_size, slots % block_size], key)
    assert torch.equal(vc[slots // block_size, slots % block_size], value)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    rest = ~written.view(num_blocks, block_size)
    assert kc[rest].isnan().all() and vc[rest].isnan().all() and pool[:, 0].isnan().all()
    # Through kernels (the model's call): the same bytes.
    pool2 = before.clone()
    kernels.reshape_and_cache(key, value, pool2[:, 1, 0], pool2[:, 1, 1], slots)
    assert torch.equal(pool2.nan_to_num(), pool.nan_to_num()) and torch.equal(pool2.isnan(), pool.isnan())
    # A slot out of range writes nothing.
    bad = slots.clone()
    bad[-1] = num_blocks * block_size
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_native.reshape_and_cache(key, value, before[:, 1, 0], before[:, 1, 1], bad)
    assert before[:, 1].isnan().all()


def test_supports_and_errors():
    case = make_case([5, 40], [1, 1], 9, 3, 64, 8, torch.bfloat16)
    kc, vc = case.key_cache, case.value_cache
    assert cpu_native.supports(case.query, kc, vc)
    assert not cpu_native.supports(case.query.half(), kc.half(), vc.half())
    assert not cpu_native.supports(case.query.float(), kc, vc)  # one dtype per call
    with pytest.raises(ValueError, match="out must"):
        decode(case, torch.empty(case.query.shape, dtype=torch.float32))
    bad = case.block_tables.clone()
    bad[1, 1] = kc.shape[0]
    out = torch.full_like(case.query, math.nan)
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_native.paged_decode(case.query, kc, vc, bad, case.seq_lens, rows, rows, 1.0, out)
    assert out.isnan().all(), "an error must leave out unwritten"


def decode_fp8(case, out=None):
    """cpu_native.paged_decode over every sequence of an fp8 decode case; returns out."""
    n = case.query.shape[0]
    out = torch.full_like(case.query, math.nan) if out is None else out
    rows = torch.arange(n, dtype=torch.int64)
    cpu_native.paged_decode(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, rows, rows,
        case.scale, out, case.k_scale, case.v_scale,
    )  # fmt: skip
    return out


# fp32 queries over an fp8 cache against the reference over the dequantized cache, outputs over
# their head's magnitude: e4m3 widens exactly, the scales multiply in fp32 (tests/kernels/test_kernels_fp8.py).
FP8_FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_fp8_decode_matches_reference(heads, head_dim, block_size, dtype):
    lens = lengths(block_size)
    case = make_fp8_case(lens, [1] * len(lens), *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    out = decode_fp8(case)
    what = f"fp8 cache, {dtype} query, heads={heads} d={head_dim} bs={block_size}"
    assert out.dtype == dtype and not out.isnan().any(), what
    mag = case.head_magnitude()[None, :, None]
    tol = FP8_FP32_TOL if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(out.double() / mag, case.reference() / mag, **tol, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def portable_fp8_decoder(monkeypatch):
    """The library built without AVX-512 and F16C (x86 hosts that have them): fp8 bytes decoded by
    the integer arithmetic that hosts without F16C (and other architectures) run."""
    flags = native_lib.cpu_flags()
    if "f16c" not in flags or "avx2" not in flags:
        pytest.skip("the default build already is the portable one here (no F16C)")
    path = native_lib.build_library(cpu_native.PAGED_SOURCES, cpu_native.HEADERS,
                                    extra_flags=("-mno-avx512f", "-mno-f16c"),
                                    stem="paged_cpu_portable")  # fmt: skip
    lib = ctypes.CDLL(str(path))
    lib.paged_decode_packed.argtypes = [ctypes.c_void_p, ctypes.c_float]
    lib.paged_decode_packed.restype = ctypes.c_int
    monkeypatch.setattr(cpu_native.LIBRARY, "handle", lib)


@pytest.mark.parametrize("decoder", ["default", "portable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_fp8_every_code_decodes_exactly(head_dim, dtype, decoder, request):
    # One position per context: out = e4m3 value x v_scale, rounded once; NaN codes stay NaN.
    if decoder == "portable":
        request.getfixturevalue("portable_fp8_decoder")
    case = make_fp8_code_case(head_dim, dtype)
    out = decode_fp8(case)
    want = case.code_outputs()
    assert torch.equal(out.isnan(), want.isnan()), f"{decoder}: NaN codes not read as NaN"
    assert torch.equal(out.nan_to_num(), want.nan_to_num()), f"{decoder}: an e4m3 code decoded inexactly"
    if decoder == "portable":  # and a whole decode over many binades on that build
        lens = lengths(16)
        case = make_fp8_case(lens, [1] * len(lens), 9, 3, head_dim, 16, dtype, seed=5)
        mag = case.head_magnitude()[None, :, None]
        tol = FP8_FP32_TOL if dtype == torch.float32 else tolerance(dtype)
        torch.testing.assert_close(decode_fp8(case).double() / mag, case.reference() / mag, **tol)


def test_the_build_key_covers_every_header_the_sources_include():
    # The cached library is keyed by its sources' and headers' bytes: a header the sources include
    # (directly or through another header) but HEADERS leaves out would not rebuild it when edited.
    included, todo = set(), list(cpu_native.SOURCES)
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), re.MULTILINE):
            if name not in included:
                included.add(name)
                todo.append(cpu_native.SOURCE.with_name(name))
    assert included == {h.name for h in cpu_native.HEADERS}, f"included {sorted(included)}"
