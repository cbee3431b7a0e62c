"""kernels.cpu.packed_linear: projections on the native kernels over oneDNN's packed weight.

Each kernel this CPU runs is tested (AMX, AVX-512 BF16, AVX2 fp32); one it cannot run is skipped
with the flag it lacks. References: an fp64 product of the same values (within the dtype's
rounding of the fp32 sums), oneDNN's own matmul on the same packed weight (bit-identical up to 32
rows on AMX), `kernels.fused_ops.silu_mul` of the product for the fused SwiGLU epilogue
(bit-identical), and the rows alone against the rows in a batch (bit-identical). The kernel choice
is checked on fake CPU flag sets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute_service.model.linear import Linear
from kernels import fused_ops
from kernels.cpu import native_lib
from kernels.cpu import packed_linear as pl

ROOT = Path(__file__).resolve().parents[2]


def _kernel_param(name: str):
    missing = [f for f in pl.KERNELS[name].flags if f not in native_lib.cpu_flags()]
    reason = f"the CPU lacks {', '.join(missing)} (the {name} kernel)" if missing else None
    if reason is None and not pl.LIBRARY.available():
        reason = f"the library did not build: {pl.LIBRARY.unavailable_reason}"
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""), id=name)


KERNEL_PARAMS = [_kernel_param(name) for name in pl.KERNELS]


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _packed(kernel: str, n: int, k: int, seed: int = 0):
    w = _weight(n, k, pl.KERNELS[kernel].dtype, seed)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    pw = pl.packed_weight(w, packed, kernel)
    assert pw is not None and pw.kernel == kernel
    return w, packed, pw


def _ulp(dtype: torch.dtype) -> float:
    return 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (64, 64)])
@pytest.mark.parametrize("m", [1, 2, 5, 15, 16, 17, 32, 33, 64, 200])
def test_close_to_fp64_at_every_batch(kernel, n, k, m):
    w, packed, pw = _packed(kernel, n, k)
    x = _rows(m, k, w.dtype)
    got = pl.linear(x, pw, n)
    assert got.shape == (m, n) and got.dtype == w.dtype
    exact = x.double() @ w.double().t()
    # fp32 sums of the products, one rounding: within the dtype's rounding of the exact value
    # (plus the fp32 sum's own error, relative to the sum of |products|).
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2.0**-24
    assert torch.all((got.double() - exact).abs() <= exact.abs() * _ulp(w.dtype) + bound + 1e-30)
    if kernel == "amx" and m <= 32:
        assert torch.equal(got, _onednn(x, packed))  # oneDNN's own sums, in the same order


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_a_row_is_the_same_alone_and_in_a_batch_at_any_thread_count(kernel):
    n, k = 576, 576
    w, _, pw = _packed(kernel, n, k)
    wide = _rows(70, 3 * k, w.dtype)
    x = wide[:, k: 2 * k]  # rows 3k apart
    want = pl.linear(x.contiguous(), pw, n)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(pl.linear(x, pw, n), want)
            for m in (1, 3, 17, 40):
                assert torch.equal(pl.linear(x[:m], pw, n), want[:m])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 100])
def test_fused_silu_mul_is_the_product_then_silu_mul(kernel, m):
    n, k = 3072, 576  # SwiGLU's [gate | up] rows, as SmolLM2's
    w, _, pw = _packed(kernel, n, k)
    x = _rows(m, k, w.dtype) * 4  # gates well into silu's curve, both signs
    got = pl.linear(x, pw, n, silu_mul=True)
    assert got.shape == (m, n // 2) and got.dtype == w.dtype
    assert torch.equal(got, fused_ops.silu_mul(pl.linear(x, pw, n)))
    # and against fp64 silu(g) * u of the exact products: within the roundings of g, u and the
    # result (relative to each row's largest value: silu amplifies g's rounding where g << 0)
    gu = x.double() @ w.double().t()
    g, u = gu[:, : n // 2], gu[:, n // 2:]
    exact = g * torch.sigmoid(g) * u
    row_max = exact.abs().amax(dim=1, keepdim=True)
    tol = 2.0**-7 if w.dtype == torch.bfloat16 else 2.0**-18
    assert torch.all((got.double() - exact).abs() <= exact.abs() * tol + row_max * tol / 2)


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_linear_module_takes_the_native_kernel(kernel, monkeypatch):
    dtype = pl.KERNELS[kernel].dtype
    monkeypatch.setitem(pl._chosen, dtype, (kernel, None))
    w = _weight(3072, 576, dtype)
    layer = Linear(w, packed=True)
    assert layer.native is not None and layer.native.kernel == kernel and layer.fuses_silu_mul()
    x = _rows(9, 576, dtype)
    assert torch.equal(layer(x), pl.linear(x, layer.native, 3072))
    assert torch.equal(layer(x, silu_mul=True), fused_ops.silu_mul(layer(x)))
    bias = _weight(3072, 1, dtype, seed=3).flatten()
    with_bias = Linear(w, packed=True, bias=bias)
    assert not with_bias.fuses_silu_mul()
    assert torch.equal(with_bias(x), pl.linear(x, with_bias.native, 3072).add_(bias))
    assert torch.equal(with_bias(x, silu_mul=True), fused_ops.silu_mul(with_bias(x)))


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_fused_silu_mul_refuses_halves_that_are_not_whole_blocks(kernel):
    dtype = pl.KERNELS[kernel].dtype
    x = _rows(5, 64, dtype)
    refused = 0
    for n in (96, 192):  # halves of 48 and 96: not whole blocks of 32 (96) or of 64 (both)
        w = _weight(n, 64, dtype)
        pw = pl.packed_weight(w, torch.ops.mkldnn._reorder_linear_weight(w), kernel)
        if pw is not None and (n // 2) % pw.block:
            with pytest.raises(RuntimeError, match=f"multiple of {2 * pw.block}"):
                pl.linear(x, pw, n, silu_mul=True)
            layer = Linear(w, packed=True)  # the module falls back to the product, then silu_mul
            assert torch.equal(layer(x, silu_mul=True), fused_ops.silu_mul(layer(x)))
            refused += 1
    assert refused


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_weights_the_kernel_cannot_read_stay_with_onednn(kernel):
    dtype = pl.KERNELS[kernel].dtype
    w = _weight(64, 576, dtype)
    other = torch.ops.mkldnn._reorder_linear_weight(_weight(64, 576, dtype, seed=5))
    assert pl.packed_weight(w, other, kernel) is None  # bytes not this weight's blocking
    wrong = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    w2 = w.to(wrong)
    assert pl.packed_weight(w2, torch.ops.mkldnn._reorder_linear_weight(w2), kernel) is None  # another dtype
    assert pl.packed_weight(w, w, kernel) is None  # not a oneDNN tensor


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("bad", ["empty", "dtype", "column stride", "3-d"])
def test_bad_rows_raise_before_anything_runs(kernel, bad):
    w, _, pw = _packed(kernel, 64, 64)
    other = torch.float32 if w.dtype == torch.bfloat16 else torch.bfloat16
    x = {
        "empty": _rows(0, 64, w.dtype),
        "dtype": _rows(4, 64, other),
        "column stride": _rows(4, 128, w.dtype)[:, ::2],
        "3-d": _rows(4, 64, w.dtype).view(2, 2, 64),
    }[bad]
    with pytest.raises(ValueError, match="must be a cpu"):
        pl.linear(x, pw, 64)


AMX = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN4 = AMX - {"amx_bf16", "amx_tile"}
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags,bf16,fp32", [
    (AMX, "amx", "avx2"),
    (ZEN4, "avx512_bf16", "avx2"),
    (AVX2, None, "avx2"),
    (frozenset(), None, None),
])
def test_the_cpu_flags_choose_the_kernel(flags, bf16, fp32):
    assert pl.select_kernel(torch.bfloat16, flags)[0] == bf16
    assert pl.select_kernel(torch.float32, flags)[0] == fp32
    assert pl.select_kernel(torch.float16, flags) == (None, "no native projection kernel for float16")


def test_a_kernel_the_cpu_cannot_run_names_the_missing_flags():
    assert pl.select_kernel(torch.bfloat16, AVX2) == (
        None, "the CPU lacks amx_bf16, amx_tile, avx512_bf16 (amx); avx512_bf16, avx512f, avx512bw (avx512_bf16)")
    assert pl.select_kernel(torch.bfloat16, ZEN4, "amx") == (None, "the CPU lacks amx_bf16, amx_tile (amx)")
    assert pl.select_kernel(torch.bfloat16, AMX, "avx512_bf16") == ("avx512_bf16", None)
    assert pl.select_kernel(torch.float32, AMX, "amx") == (None, "the amx kernel computes bfloat16")
    assert pl.select_kernel(torch.float32, AMX, "off") == (None, f"disabled by {pl.ENV_SWITCH}=off")
    assert pl.select_kernel(torch.float32, AMX, "sse")[1].startswith(f"{pl.ENV_SWITCH}=sse names no kernel")


def _paths_in_a_process(env: dict) -> list[str]:
    """What a fresh process under `env` reports: the bf16 and fp32 projection paths
    (`packed_linear.describe`) and the library's vector flags (`native_lib._arch_flags`)."""
    return subprocess.run(
        [sys.executable, "-c",
         "import torch; from kernels.cpu import packed_linear as pl, native_lib; "
         "print(pl.describe(torch.bfloat16)); print(pl.describe(torch.float32)); print(native_lib._arch_flags())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout.splitlines()


def test_the_switch_turns_the_kernels_off_in_a_process():
    out = _paths_in_a_process({**os.environ, pl.ENV_SWITCH: "off"})
    assert out[:2] == [f"onednn (disabled by {pl.ENV_SWITCH}=off)"] * 2


def test_an_avx2_only_cpu_runs_the_avx2_path_end_to_end():
    """With every flag but AVX2's taken away (PAGEDKV_TEST_CPU_FLAGS), the library builds 8 wide,
    bf16 has no kernel, and fp32 runs the avx2 kernel: this file's avx2 cases and the model's fused
    fp32 decode layers (bit-identical to its per-op path) pass in that process, none skipped."""
    env = {**os.environ, "PAGEDKV_TEST_CPU_FLAGS": "avx2 fma f16c"}
    out = _paths_in_a_process(env)
    assert out[0].startswith("onednn (the CPU lacks amx_bf16, amx_tile, avx512_bf16 (amx); avx512_bf16, avx512f")
    assert out[1:] == ["avx2", "['-mavx2', '-mfma', '-mf16c']"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/kernels/test_packed_linear.py", "tests/compute_service/test_fused_decode.py",
         "-k", "(avx2 and not avx2_only) or (per_op_bits and float32)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = run.stdout[-2000:]
    assert run.returncode == 0, tail
    assert "skipped" not in tail and " passed" in tail, tail
