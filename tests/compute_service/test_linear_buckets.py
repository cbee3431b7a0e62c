"""`Linear` runs oneDNN at a bounded set of row counts: right values at every count, bounded memory.

oneDNN keeps a primitive per (row count, weight shape) it has run; a worker whose steps take any
token count grew by ~0.6 GB and kept it (docs/benchmarks.md, "Worker memory under load").
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from compute_service.model.linear import EXACT_ROWS, MAX_ROWS, Linear, bucket_rows, packed_linear_wanted

pytestmark = pytest.mark.skipif(not packed_linear_wanted(torch.device("cpu"), torch.float32),
                                reason="no oneDNN packed matmul in this torch build")


def test_bucket_rows_bounds_the_padding_and_the_sizes():
    for rows in range(1, 4 * MAX_ROWS):
        b = bucket_rows(rows)
        assert rows <= b <= rows * 1.125
        assert b == rows or rows > EXACT_ROWS
    assert len({bucket_rows(r) for r in range(1, 513)}) == 56
    assert len({bucket_rows(r) for r in range(1, MAX_ROWS + 1)}) == 64
    assert [bucket_rows(r) for r in (16, 17, 19, 33, 100, 511, 513, 1000)] == [16, 18, 20, 36, 104, 512, 576, 1024]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_padded_rows_give_the_fp64_product_at_every_row_count(bias, silu_mul):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    b = torch.randn(64, generator=g) if bias else None
    lin = Linear(w, packed=True, bias=b)
    assert lin.packed is not None
    x = torch.randn(MAX_ROWS + 37, 48, generator=g)
    for rows in [*range(1, 70), 100, 257, MAX_ROWS, MAX_ROWS + 37]:  # the last in two slices
        ref = F.linear(x[:rows].double(), w.double(), None if b is None else b.double())
        if silu_mul:
            gate, up = ref.chunk(2, dim=-1)
            ref = F.silu(gate) * up
        y = lin(x[:rows], silu_mul=silu_mul)
        assert y.shape == ref.shape and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)  # fp32 sums of 48 products


def test_512_row_counts_keep_the_memory_of_a_bounded_set_of_primitives():
    """Bytes malloc holds (glibc's mallinfo2) after one call of a fresh weight shape give one
    primitive's cost; row counts 2..512 then add 55 more with the buckets (511 without): the test
    allows 80, for what the allocator keeps beside them."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    mallinfo2.restype = MallInfo2
    lin = Linear(torch.randn(152, 88), packed=True)  # a shape no other test runs
    x = torch.randn(512, 88)
    before = mallinfo2().uordblks
    lin(x[:1])
    one = mallinfo2().uordblks - before
    assert one > 0
    for rows in range(2, 513):
        lin(x[:rows])
    grown = mallinfo2().uordblks - before - one
    assert grown < 80 * one, (grown, one)
