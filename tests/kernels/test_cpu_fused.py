"""Native fused elementwise kernels (kernels/cpu/csrc/fused_cpu.c) in fp32 and bf16, against fp64.

RMSNorm and the residual add fused with it (the new residual bit-exact as torch's add in the
dtype), silu(gate) * up and in-place RoPE: bf16 results within one bf16 ulp of an fp64 reference
computed from the same inputs, fp32 within a few fp32 ulps; widths on the vector path and off it
(scalar tails), strided rows, a call large enough to split its rows over threads (bitwise equal
to one thread), NaN kept per row, errors before any write; and the model's forward on the native
path against its torch path (`kernels.fused_ops` switched by `cpu_native.use_native`).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import fused_ops
from kernels.cpu import fused as cpu_fused
from kernels.cpu import native as cpu_native

pytestmark = [pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built"),
              pytest.mark.usefixtures("one_torch_thread")]

DTYPES = [torch.bfloat16, torch.float32]
WIDTHS = [576, 1, 15, 16, 33, 100]  # SmolLM2's hidden size, then tails around the vector width
EPS = 1e-5


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers at |ref| (fp64), subnormals included."""
    mag = ref.abs().clamp_min(torch.finfo(dtype).smallest_normal)
    mantissa_bits = {torch.bfloat16: 7, torch.float32: 23}[dtype]
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa_bits)


def assert_ulps(out: torch.Tensor, ref: torch.Tensor, max_ulps: float, what: str) -> None:
    err = (out.double() - ref).abs() / ulp(ref, out.dtype)
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= max_ulps, f"{what}: {worst:.2f} {out.dtype} ulps from the fp64 reference (max {max_ulps})"


MAX_ULPS = {torch.bfloat16: 1.0, torch.float32: 8.0}


def rms_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x, w = x.double(), w.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rows(n: int, d: int, dtype: torch.dtype, seed: int, pad: int = 0) -> torch.Tensor:
    """[n, d] random rows (mean 0.5, spread 2), strided by `pad` extra columns when pad > 0."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, d + pad, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    return t[:, pad:] if pad else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("n", [1, 7])
def test_rms_norm_matches_fp64(dtype, d, n):
    x, w = rows(n, d, dtype, 1, pad=3), rows(1, d, dtype, 2)[0]
    out = cpu_fused.rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == (n, d)
    assert_ulps(out, rms_ref(x, w), MAX_ULPS[dtype], f"rms_norm d={d}")
    if dtype == torch.float32:  # and the torch op the fallback path runs
        torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (d,), w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", WIDTHS)
def test_add_rms_norm_updates_the_residual_exactly(dtype, d):
    x, residual, w = rows(5, d, dtype, 3, pad=2), rows(5, d, dtype, 4, pad=5), rows(1, d, dtype, 5)[0]
    want_residual = residual + x  # torch's add in the dtype: fp32 sum, one rounding
    out = torch.full((5, d), math.nan, dtype=dtype)
    assert cpu_fused.add_rms_norm(x, residual, w, EPS, out=out) is out
    assert torch.equal(residual, want_residual), "the new residual must be torch's add, bit for bit"
    assert_ulps(out, rms_ref(want_residual, w), MAX_ULPS[dtype], f"add_rms_norm d={d}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_keeps_nan_to_its_row_and_rounds_like_torch(dtype):
    x, w = rows(3, 64, dtype, 6), torch.ones(64, dtype=dtype)
    x[1, 5] = math.nan
    out = cpu_fused.rms_norm(x, w, EPS)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    zeros = cpu_fused.rms_norm(torch.zeros(2, 64, dtype=dtype), w, EPS)  # 0 / sqrt(eps): 0, not NaN
    assert torch.equal(zeros, torch.zeros_like(zeros))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 1, 15, 16, 33])
def test_silu_mul_matches_fp64(dtype, inter):
    gate_up = rows(6, 2 * inter, dtype, 7, pad=4) * 3  # gates in about [-20, 20]: both sigmoid branches
    out = cpu_fused.silu_mul(gate_up)
    assert out.shape == (6, inter) and out.dtype == dtype
    assert_ulps(out, silu_mul_ref(gate_up), MAX_ULPS[dtype], f"silu_mul inter={inter}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_extremes(dtype):
    # Far below the exp range silu is -0 * up (no overflow to NaN); far above it is gate * up; NaN stays.
    gate = torch.tensor([-100.0, -88.0, 100.0, 0.0, math.nan, 3.0] * 3, dtype=dtype)
    up = torch.full_like(gate, 2.0)
    out = cpu_fused.silu_mul(torch.cat([gate, up])[None])[0]
    assert out[4].isnan() and not out[[0, 1, 2, 3, 5]].isnan().any()
    assert float(out[0]) == 0.0 and float(out[2]) == 200.0 and float(out[3]) == 0.0


def rope_case(dtype: torch.dtype, t: int, heads: int, dh: int, seed: int):
    """A [t, heads + 2, dh] projection output (the last two heads stand for v), cos and signed sin
    [t, 1, dh] in the dtype, as the model builds them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, heads + 2, dh, generator=g, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2).double() / dh))
    freqs = positions[:, None].double() * inv[None]
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None]
    return qkv, freqs.cos().to(dtype), fused_ops.signed_sin(freqs.sin()).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dh", [64, 32, 2, 18, 130])
def test_rope_in_place_matches_fp64(dtype, dh):
    qkv, cos, sin = rope_case(dtype, 9, 12, dh, seed=dh)
    before = qkv.clone()
    x = qkv[:, :12]  # queries and keys: row-strided
    assert cpu_fused.rope_(x, cos, sin) is x
    xd, c, s = before[:, :12].double(), cos.double(), sin.double()
    ref = xd * c + xd.roll(dh // 2, -1) * s
    assert torch.equal(qkv[:, 12:], before[:, 12:]), "the value heads must be left alone"
    if dtype == torch.bfloat16:  # products of bf16 numbers are exact in fp32: one rounding
        assert_ulps(qkv[:, :12], ref, 1.0, f"rope dh={dh}")
    else:  # a sum of two products may cancel: error relative to the terms, not the result
        bound = 4 * 2.0**-24 * ((xd * c).abs() + (xd.roll(dh // 2, -1) * s).abs())
        assert ((qkv[:, :12].double() - ref).abs() <= bound).all(), f"rope dh={dh}"
        # and the torch op the fallback path runs (which rounds between its ops in bf16)
        torch.testing.assert_close(qkv[:, :12], fused_ops.apply_rope(before[:, :12], cos, sin))


def test_large_calls_split_rows_over_threads_bitwise():
    """Calls past the parallel threshold give the same bits on 2 threads as on 1."""
    x, res, w = rows(300, 576, torch.bfloat16, 8), rows(300, 576, torch.bfloat16, 9), rows(1, 576, torch.bfloat16, 1)[0]
    gate_up = rows(64, 3072, torch.bfloat16, 10)
    qkv, cos, sin = rope_case(torch.bfloat16, 256, 12, 64, seed=11)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        r, q = res.clone(), qkv.clone()
        out = cpu_fused.add_rms_norm(x, r, w, EPS)
        cpu_fused.rope_(q[:, :12], cos, sin)
        results.append((out, r, cpu_fused.silu_mul(gate_up), q))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_bad_input_raises_before_writing():
    x, res, w = rows(4, 64, torch.float32, 1), rows(4, 64, torch.float32, 2), torch.ones(64)
    keep = res.clone()
    bad = [
        lambda: cpu_fused.add_rms_norm(x, res.bfloat16(), w, EPS),  # dtypes differ
        lambda: cpu_fused.add_rms_norm(x, res[:3], w, EPS),  # shapes differ
        lambda: cpu_fused.add_rms_norm(x, res, w[:63], EPS),  # weight width
        lambda: cpu_fused.add_rms_norm(x, res, w, EPS, out=torch.empty(64, 4).t()),  # last axis strided
        lambda: cpu_fused.rms_norm(x.half(), w.half(), EPS),  # fp16: not native
        lambda: cpu_fused.silu_mul(torch.ones(2, 7)),  # odd width
        lambda: cpu_fused.silu_mul(torch.ones(2, 8), out=torch.empty(2, 4, dtype=torch.bfloat16)),
        lambda: cpu_fused.rope_(torch.ones(2, 3, 7), torch.ones(2, 1, 7), torch.ones(2, 1, 7)),  # odd head_dim
        lambda: cpu_fused.rope_(torch.ones(2, 3, 8), torch.ones(3, 1, 8), torch.ones(2, 1, 8)),  # cos rows
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
        assert torch.equal(res, keep), f"case {i} wrote the residual"


def test_fused_ops_torch_path_has_the_same_semantics():
    """kernels.fused_ops with the native kernels off (torch ops) matches the native path: the
    residual updated in place alike, outputs within fp32 rounding."""
    x, res, w = rows(3, 576, torch.float32, 1), rows(3, 576, torch.float32, 2), rows(1, 576, torch.float32, 3)[0]
    qkv, cos, sin = rope_case(torch.float32, 3, 12, 64, seed=4)
    got = {}
    for native in (True, False):
        with cpu_native.use_native(native):
            r = res.clone()
            out = fused_ops.add_rms_norm(x, r, w, EPS)
            got[native] = (
                out,
                r,
                fused_ops.rms_norm(x, w, EPS),
                fused_ops.silu_mul(x),
                fused_ops.rope(qkv.clone()[:, :12], cos, sin),
            )
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_native_path_matches_torch_path(dtype):
    """A small random Llama (GQA 4:2, head_dim 16), prefill then decode, on the native fused ops and
    on the torch ops: the same logits within the dtype's rounding."""
    from helpers.model_fixtures import PagedCache
    from helpers.random_llama import random_llama

    model = random_llama(dtype)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for native in (True, False):
        with cpu_native.use_native(native):
            cache = PagedCache(model, num_blocks=16, block_size=4, seed=1)
            cache.pool = cache.pool.to(dtype)
            steps = [cache.step({0: ids[:20], 1: ids[:7]})] + [cache.step({0: [t], 1: [t]}) for t in ids[20:]]
            logits[native] = torch.stack([s[q] for s in steps for q in (0, 1)]).float()
    atol = 1e-5 if dtype == torch.float32 else 0.05 * float(logits[False].abs().max())
    torch.testing.assert_close(logits[True], logits[False], atol=atol, rtol=0)
