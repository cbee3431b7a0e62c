"""Triton kernels on CPU under TRITON_INTERPRET=1, against the dense fp64 reference.

The interpreter must be chosen before triton is imported, so this module sets the variable at
import time; if triton was already imported in this process without it, the module is skipped
(run it alone: `pytest tests/kernels/test_kernels_interpret.py`). Launches cost ~0.1-1 s each, so the
grid is covered pairwise (every pair of factor values appears in some case), not in full.

fp8 (e4m3) caches: decode (one split and several) and prefill over the cases of
tests/kernels/test_kernels_fp8.py (per-KV-head scales orders of magnitude apart, fp32 and fp16 queries),
every e4m3 byte read exactly, and the cache write storing `kernels.quantize_fp8`'s bytes.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from helpers.kernel_reference import (
    e4m3,
    make_case,
    make_fp8_case,
    make_fp8_code_case,
    place_fp8_edges,
    ref_attention,
    run_int64_case,
    tolerance,
)

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton")

import kernels  # noqa: E402 - imports triton, which reads TRITON_INTERPRET once, at import

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        not INTERPRET,
        reason="triton was imported before TRITON_INTERPRET=1 could be set; "
        "run `pytest tests/kernels/test_kernels_interpret.py` on its own",
    ),
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Many small ops: one intra-op thread is several times faster on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


HEADS = [(9, 3), (8, 8), (32, 1), (28, 4)]
HEAD_DIMS = [64, 80, 128]
BLOCK_SIZES = [1, 8, 16, 32, 24]
DTYPES = [torch.float32, torch.float16]  # the interpreter mishandles bf16


def pairwise_cases() -> list[tuple]:
    """20 cases covering every pair of (heads, block_size, head_dim, dtype, split-KV) values."""
    cases = []
    for i in range(len(HEADS) * len(BLOCK_SIZES)):
        a, b = i % len(HEADS), i // len(HEADS)
        split = (a // 2 + b) % 2 == 1
        cases.append((HEADS[a], BLOCK_SIZES[b], HEAD_DIMS[(a + b) % 3], DTYPES[(a + b) % 2], split))
    return cases


def case_id(c: tuple) -> str:
    (hq, hkv), bs, hd, dt, split = c
    return f"{hq}q{hkv}kv-bs{bs}-d{hd}-{str(dt)[6:]}" + ("-split" if split else "")


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype}, want {dtype}"
    assert not out.isnan().any(), f"{what}: NaN reached the output"
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype), msg=lambda m: f"{what}: {m}")


def plan_and_attend(case, **kw) -> tuple[kernels.AttentionPlan, torch.Tensor]:
    """The model's call sequence on the Triton backend: one plan, then the attention op."""
    plan = kernels.plan_attention(
        case.block_tables, case.query_start_loc, case.seq_lens, case.key_cache.shape[1],
        backend="triton", **kw,
    )  # fmt: skip
    return plan, kernels.paged_attention(case.query, case.key_cache, case.value_cache, plan, case.scale)


@pytest.mark.parametrize("params", pairwise_cases(), ids=case_id)
def test_decode_triton(params):
    heads, bs, hd, dtype, split = params
    # Short lengths at block boundaries; a longer one (split-KV forced when `split`, else the
    # plan's policy by occupancy: 2 ranges at 257 tokens, 1 at 70).
    lens = [n for n in (1, bs - 1, bs, bs + 1, 2 * bs + 3) if n >= 1]
    lens.append(257 if bs > 1 else 70)
    case = make_case(lens, [1] * len(lens), *heads, hd, bs, dtype, seed=bs)
    plan, out = plan_and_attend(case, num_splits=5 if split else None, num_kv_heads=heads[1])
    policy = kernels.plan.default_num_splits(len(lens), heads[1], max(lens))
    assert plan.kernel == "triton_decode" and plan.num_splits == (5 if split else policy)
    assert policy == (2 if max(lens) == 257 else 1)
    ref = ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, case.scale,
    )  # fmt: skip
    check(out, ref, dtype, f"triton decode lens={lens} split={split}")


@pytest.mark.parametrize("params", pairwise_cases(), ids=case_id)
def test_prefill_mixed_batch_triton(params):
    heads, bs, hd, dtype, _ = params
    # Cached prefix + new chunk; a prompt without prefix; decode tokens.
    batch = [(2 * bs + 5, bs + 2), (min(3 * bs + 1, 70), min(3 * bs + 1, 70)), (1, 1), (bs + 1, 1)]
    case = make_case(
        [s for s, _ in batch], [n for _, n in batch], *heads, hd, bs, dtype, seed=bs + 7
    )
    plan, out = plan_and_attend(case)
    assert plan.kernel == "triton_prefill"
    ref = ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, case.scale,
    )  # fmt: skip
    check(out, ref, dtype, f"triton prefill batch={batch}")


@pytest.mark.parametrize("split", [False, True], ids=["one-range", "split"])
def test_head_dim_below_dot_minimum_triton(split):
    """head_dim 8 with fp16 queries: the kernels compute on 16 columns (tl.dot's minimum for 16-bit
    inputs, kernels.triton.paged.dim_pad) and mask the 8 padding ones on every load and store."""
    lens = [1, 7, 9, 40]
    case = make_case(lens, [1] * len(lens), 4, 2, 8, 8, torch.float16, seed=3)
    plan, out = plan_and_attend(case, num_splits=3 if split else None, num_kv_heads=2)
    assert plan.kernel == "triton_decode"
    ref = ref_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
                        case.seq_lens, case.scale)
    check(out, ref, torch.float16, f"triton decode head_dim 8 split={split}")
    batch = [(20, 6), (9, 9), (5, 1)]
    case = make_case([s for s, _ in batch], [n for _, n in batch], 4, 2, 8, 8, torch.float16, seed=4)
    plan, out = plan_and_attend(case)
    assert plan.kernel == "triton_prefill"
    ref = ref_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
                        case.seq_lens, case.scale)
    check(out, ref, torch.float16, f"triton prefill head_dim 8 batch={batch}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 24])
def test_reshape_and_cache_triton(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    pool = torch.full((6, 2, 2, block_size, 3, 80), math.nan, dtype=dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:5].to(torch.int64)
    key = torch.randn(5, 3, 80, generator=gen).to(dtype)
    value = torch.randn(5, 3, 80, generator=gen).to(dtype)
    before = pool.clone()
    kernels.reshape_and_cache(key, value, pool[:, 1, 0], pool[:, 1, 1], slots, backend="triton")
    blocks, offs = slots // block_size, slots % block_size
    assert torch.equal(pool[blocks, 1, 0, offs], key), "keys not in their slots"
    assert torch.equal(pool[blocks, 1, 1, offs], value), "values not in their slots"
    pool[blocks, 1, :, offs] = before[blocks, 1, :, offs]
    assert torch.equal(pool.isnan(), before.isnan()), "a write landed outside its slot"


def test_copy_blocks_triton():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 3, 2, 24, 2, 64, generator=gen).half()
    before = pool.clone()
    pairs = torch.tensor([[1, 7], [4, 2], [1, 9]], dtype=torch.int64)
    kernels.copy_blocks(pool, pairs, backend="triton")
    for src, dst in pairs.tolist():
        assert torch.equal(pool[dst], before[src]), f"block {dst} is not a copy of {src}"
    untouched = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(pool[untouched], before[untouched]), "a block outside dst changed"


def test_int64_offsets_triton():
    # Blocks past element 2**31 of a 4 GiB pool that is never touched outside a few blocks.
    pool = torch.empty((1 << 20) + 64, 1, 2, 16, 1, 64, dtype=torch.float16)
    run_int64_case(pool, backend="triton")


def test_triton_refuses_mixed_dtypes():
    case = make_case([5], [1], 8, 8, 64, 8, torch.float32)
    case.query = case.query.half()
    with pytest.raises(ValueError, match="one dtype"):
        plan_and_attend(case)


# (heads, head_dim, block_size, query dtype, decode splits): small shapes, the interpreter is slow.
FP8_CASES = [
    ((6, 2), 64, 16, torch.float32, 1),
    ((6, 2), 48, 5, torch.float16, 3),
    ((9, 3), 48, 16, torch.float32, 4),
    ((8, 8), 64, 5, torch.float16, 1),
]
# As tests/kernels/test_kernels_fp8.py: fp32 queries within FP8_FP32_TOL of the reference over the
# dequantized cache, outputs over their head's magnitude (fp16: its tolerance), and within
# e4m3's relative half-ulp 2^-4 of the reference over the unquantized values.
FP8_FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
UNQUANTIZED_BOUND = 2.0**-4


def fp8_case_id(c: tuple) -> str:
    (hq, hkv), hd, bs, dt, splits = c
    return f"{hq}q{hkv}kv-d{hd}-bs{bs}-{str(dt)[6:]}-splits{splits}"


def attend_fp8(case, **kw) -> tuple[kernels.AttentionPlan, torch.Tensor]:
    plan = kernels.plan_attention(
        case.block_tables, case.query_start_loc, case.seq_lens, case.key_cache.shape[1], backend="triton", **kw
    )
    out = kernels.paged_attention(
        case.query, case.key_cache, case.value_cache, plan, case.scale, k_scale=case.k_scale, v_scale=case.v_scale
    )
    return plan, out


def check_fp8(out: torch.Tensor, case, what: str) -> None:
    assert out.dtype == case.query.dtype and not out.isnan().any(), what
    mag = case.head_magnitude()[None, :, None]
    tol = FP8_FP32_TOL if out.dtype == torch.float32 else tolerance(out.dtype)
    torch.testing.assert_close(out.double() / mag, case.reference() / mag, **tol, msg=lambda m: f"{what}: {m}")
    err = ((out.double() - case.reference(dequantized=False)) / mag).abs().max().item()
    assert err <= UNQUANTIZED_BOUND, f"{what}: {err:.3g} of the head's magnitude off the unquantized reference"


@pytest.mark.parametrize("params", FP8_CASES, ids=fp8_case_id)
def test_fp8_decode_triton(params):
    heads, hd, bs, dtype, splits = params
    lens = [n for n in (1, bs - 1, bs, bs + 1, 2 * bs + 3, 70) if n >= 1]
    case = make_fp8_case(lens, [1] * len(lens), *heads, hd, bs, dtype, seed=bs + hd)
    plan, out = attend_fp8(case, num_splits=splits)
    assert plan.kernel == "triton_decode" and plan.num_splits == splits
    check_fp8(out, case, f"fp8 triton decode {fp8_case_id(params)}")


@pytest.mark.parametrize("params", FP8_CASES, ids=fp8_case_id)
def test_fp8_prefill_triton(params):
    heads, hd, bs, dtype, _ = params
    # A chunk after a cached prefix, a whole prompt, decode rows, a sequence without new tokens.
    batch = [(2 * bs + 5, bs + 2), (min(3 * bs + 1, 40), min(3 * bs + 1, 40)), (1, 1), (bs + 1, 1), (9, 0)]
    case = make_fp8_case([s for s, _ in batch], [n for _, n in batch], *heads, hd, bs, dtype, seed=bs + hd + 1)
    plan, out = attend_fp8(case)
    assert plan.kernel == "triton_prefill"
    check_fp8(out, case, f"fp8 triton prefill {fp8_case_id(params)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_every_code_triton(dtype):
    # One position per context: out = e4m3 value x v_scale, rounded once, on both kernels.
    from kernels.triton import prefill as triton_prefill

    case = make_fp8_code_case(48, dtype)
    want = case.code_outputs()
    _, decoded = attend_fp8(case)
    prefilled = triton_prefill.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.query_start_loc, case.seq_lens,
        case.scale, case.k_scale, case.v_scale,
    )  # fmt: skip
    for name, out in (("decode", decoded), ("prefill", prefilled)):
        finite = ~want.isnan()  # NaN codes: the interpreter widens 0x7F as 480, a GPU as NaN
        assert torch.equal(out[finite], want[finite]), f"{name}: an e4m3 code decoded inexactly"


@pytest.mark.parametrize("key_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 5])
def test_fp8_reshape_and_cache_triton(block_size, key_dtype):
    # The in-kernel quantization stores quantize_fp8's bytes: saturation, infinities, NaN, signed
    # zeros, subnormals and ties to even, with per-head scales orders of magnitude apart.
    gen = torch.Generator().manual_seed(block_size)
    heads, dim, n = 3, 48, 6
    k_scale, v_scale = torch.tensor([1e-3, 10.0, 0.5]), torch.tensor([40.0, 2e-4, 1.0])
    pool = torch.full((6, 2, 2, block_size, heads, dim), math.nan, dtype=torch.float8_e4m3fn)
    slots = torch.randperm(6 * block_size, generator=gen)[:n].to(torch.int64)
    key = torch.randn(n, heads, dim, generator=gen) * 100
    value = torch.randn(n, heads, dim, generator=gen) * torch.exp2(-12 * torch.rand(n, heads, dim, generator=gen))
    place_fp8_edges(key, value, k_scale, v_scale)
    key, value = key.to(key_dtype), value.to(key_dtype)
    before = pool.view(torch.uint8).clone()
    kernels.reshape_and_cache(key, value, pool[:, 1, 0], pool[:, 1, 1], slots, k_scale=k_scale, v_scale=v_scale,
                              backend="triton")  # fmt: skip
    blocks, offs = slots // block_size, slots % block_size
    for name, rows, s, kv in (("key", key, k_scale, 0), ("value", value, v_scale, 1)):
        got = pool[blocks, 1, kv, offs].view(torch.uint8)
        assert torch.equal(got, kernels.quantize_fp8(rows, s).view(torch.uint8)), f"{name}s are not quantize_fp8's"
        assert torch.equal(got, e4m3(rows, s).view(torch.uint8)), f"{name}s differ from the e4m3 definition"
    after = pool.view(torch.uint8).clone()
    after[blocks, 1, :, offs] = before[blocks, 1, :, offs]
    assert torch.equal(after, before), "a write landed outside its slot"


def test_fp8_copy_blocks_triton():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (10, 3, 2, 5, 2, 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    before = pool.view(torch.uint8).clone()
    kernels.copy_blocks(pool, torch.tensor([[1, 7], [4, 2], [1, 9]]), backend="triton")
    got = pool.view(torch.uint8)
    assert torch.equal(got[[7, 2, 9]], before[[1, 4, 1]]), "copy-on-write did not copy the bytes"
    rest = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(got[rest], before[rest]), "a block outside dst changed"



def test_sampler_draws_triton_equal_numpy_bit_for_bit():
    """kernels.triton.draws (Philox via tl.randint, the stated float transform) gives the bits of
    kernels.draws' numpy path for every key, high bit set or not, over several programs."""
    import numpy as np

    from kernels import draws
    from kernels.triton.draws import uniforms

    gen = np.random.default_rng(7)
    keys = np.concatenate([gen.integers(0, 2**63, 300, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                           np.array([0, 1, 2**32 - 1, 2**32, 2**64 - 1], dtype=np.uint64)])
    got = uniforms(torch.from_numpy(keys.view(np.int64)))
    want = draws.to_uniform(draws.random_uint32(keys))
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.float16, kernels.FP8_DTYPE], ids=["fp16", "fp8"])
def test_worker_warmup_launches_every_triton_kernel(dtype):
    """compute_service.warmup on a pool's layout (under the interpreter): every kernel a GPU step
    runs is launched once on scratch tensors, and the pool itself is not touched."""
    from compute_service.warmup import warm_kernels

    pool = torch.full((6, 2, 2, 4, 2, 16), 1.5).to(dtype)
    before = pool.clone()
    scales = [(torch.ones(2), torch.ones(2))] * 2 if dtype == kernels.FP8_DTYPE else None
    seconds = warm_kernels(4, pool, scales)
    assert list(seconds) == ["cache write", "decode", "decode, split", "prefill", "block copy", "sampler draws"]
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))
