"""kernels.cpu.amx: bf16 projections on AMX tiles over oneDNN's packed weight.

References: oneDNN's own matmul on the same packed weight (bit-identical up to 32 rows), an
fp64 product of the same bf16 values (within bf16 rounding of the fp32 sums, above 32 rows), and
`kernels.fused_ops.silu_mul` of the product for the fused SwiGLU epilogue (bit-identical).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute_service.model.linear import Linear
from kernels.cpu import amx as cpu_amx
from kernels.cpu import native_lib

ROOT = Path(__file__).resolve().parents[2]
needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason=f"no AMX kernel here: {cpu_amx.unavailable_reason}")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (32, 32), (3072, 576)])
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32])
def test_bit_identical_to_onednn_up_to_32_rows(n, k, m):
    w = _weight(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    address = cpu_amx.weight_address(w, packed)
    assert address is not None
    x = _rows(m, k)
    got = cpu_amx.linear(x, address, n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, _onednn(x, packed))


@needs_amx
@pytest.mark.parametrize("m", [33, 48, 63, 64, 65, 200, 512])
def test_close_to_fp64_above_32_rows(m):
    n, k = 960, 576
    w = _weight(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = _rows(m, k)
    got = cpu_amx.linear(x, cpu_amx.weight_address(w, packed), n).double()
    exact = x.double() @ w.double().t()
    # fp32 sums of bf16 products, one rounding to bf16: within one bf16 ulp of the exact value.
    assert torch.all((got - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6)


@needs_amx
def test_strided_rows_and_threads():
    n, k = 576, 576
    w = _weight(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    address = cpu_amx.weight_address(w, packed)
    wide = _rows(24, 3 * k)
    x = wide[:, k : 2 * k]  # rows 3k apart
    want = _onednn(x.contiguous(), packed)
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(cpu_amx.linear(x, address, n), want)
        finally:
            torch.set_num_threads(before)


@needs_amx
def test_linear_module_takes_the_amx_path_at_every_batch():
    w = _weight(960, 576)
    layer = Linear(w, packed=True)
    assert layer.amx_address is not None
    rows = _rows(300, 576)
    for m in (1, 32, 64, 65, 200, 300):
        x = rows[:m]
        got = layer(x)
        want = _onednn(x, layer.packed)
        if m <= 32:
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2.0**-7
        # a row's result does not depend on the other rows of the call (batch invariance)
        assert torch.equal(got, layer(rows[:300])[:m])


@needs_amx
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 33, 64, 100, 257])
def test_fused_silu_mul_is_the_product_then_silu_mul(m):
    from kernels import fused_ops

    n, k = 3072, 576  # SwiGLU's [gate | up] rows, as SmolLM2's
    w = _weight(n, k)
    layer = Linear(w, packed=True)
    x = _rows(m, k) * 4  # gates well into silu's curve, both signs
    got = layer(x, silu_mul=True)
    assert got.shape == (m, n // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got, fused_ops.silu_mul(layer(x)))
    # and against fp64 silu(g) * u of the exact products: within the bf16 roundings of g, u and the
    # result (relative to each row's largest value: silu amplifies g's rounding where g << 0)
    gu = x.double() @ w.double().t()
    g, u = gu[:, : n // 2], gu[:, n // 2 :]
    exact = g * torch.sigmoid(g) * u
    row_max = exact.abs().amax(dim=1, keepdim=True)
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2.0**-7 + row_max * 2.0**-8)


@needs_amx
def test_fused_silu_mul_falls_back_with_a_bias_or_odd_blocks():
    from kernels import fused_ops

    x = _rows(5, 64)
    for n, bias in ((96, None), (128, torch.randn(128).to(torch.bfloat16))):  # 96: halves not whole blocks
        layer = Linear(_weight(n, 64), packed=True, bias=bias)
        assert layer.amx_address is not None
        assert torch.equal(layer(x, silu_mul=True), fused_ops.silu_mul(layer(x)))
    layer = Linear(_weight(96, 64), packed=True)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu_amx.linear(x, layer.amx_address, 96, silu_mul=True)


@needs_amx
def test_weights_the_kernel_cannot_read_stay_with_onednn():
    w = _weight(48, 576)  # 48 outputs: not whole 32-output blocks
    assert cpu_amx.weight_address(w, torch.ops.mkldnn._reorder_linear_weight(w)) is None
    w32 = _weight(64, 576)
    other = torch.ops.mkldnn._reorder_linear_weight(_weight(64, 576, seed=5))
    assert cpu_amx.weight_address(w32, other) is None  # bytes not this weight's blocking
    f32 = w32.float()
    assert cpu_amx.weight_address(f32, torch.ops.mkldnn._reorder_linear_weight(f32)) is None
    assert Linear(w, packed=True).amx_address is None


@needs_amx
@pytest.mark.parametrize("bad", ["empty", "fp32", "column stride", "3-d"])
def test_bad_rows_raise_before_anything_runs(bad):
    w = _weight(64, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    address = cpu_amx.weight_address(w, packed)
    x = {
        "empty": _rows(0, 64),
        "fp32": _rows(4, 64).float(),
        "column stride": _rows(4, 128)[:, ::2],
        "3-d": _rows(4, 64).view(2, 2, 64),
    }[bad]
    with pytest.raises(ValueError, match="cpu bfloat16"):
        cpu_amx.linear(x, address, 64)


def test_switch_and_missing_cpu_flags_give_a_reason(monkeypatch):
    env = {**os.environ, cpu_amx.ENV_SWITCH: "0"}
    out = subprocess.run(
        [sys.executable, "-c",
         "from kernels.cpu import amx as cpu_amx; print(cpu_amx.available(), cpu_amx.unavailable_reason)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()
    assert out == f"False disabled by {cpu_amx.ENV_SWITCH}=0"
    monkeypatch.setattr(cpu_amx.LIBRARY, "unavailable_reason", cpu_amx.unavailable_reason)
    monkeypatch.setattr(cpu_amx.LIBRARY, "_tried", False)
    monkeypatch.setattr(cpu_amx.LIBRARY, "handle", None)
    monkeypatch.setattr(native_lib, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not cpu_amx.available()
    assert cpu_amx.unavailable_reason == "the CPU lacks amx_bf16, amx_tile"
    assert cpu_amx.weight_address(_weight(32, 32), torch.ops.mkldnn._reorder_linear_weight(_weight(32, 32))) is None
