"""GPU check of the Triton paged kernels: compile, compare with the dense reference, bandwidth.

Runs from source: `PYTHONPATH=. python scripts/gpu_check_kernels.py [--quick] [--jobs N]`.
Needs one CUDA device, torch and triton (tested for torch 2.11 + triton 3.6). Three parts:

1. correctness, fp16 and bf16, the full grid: (num_q_heads, num_kv_heads) in (9,3) (8,8) (32,1)
   (28,4) x head_dim 64/80/128 x block_size 1/8/16/32/24, each a batch of context lengths at
   and around block boundaries plus 257 and a long one (decode with the default split policy
   and with forced split-KV), and a mixed prefill batch; the reference is the fp64 dense one of
   tests/kernel_reference.py computed on the CPU. Cases are spread over `--jobs` worker
   processes because compiling ~400 kernel variants dominates the time.
2. cache ops and int64 offsets: reshape_and_cache / copy_blocks round trips and attention
   through blocks past element 2**31 of a 4 GiB pool.
3. the decode bandwidth table of benchmarks/bench_kernels.py (GB/s vs HBM peak vs dense SDPA).

`run(report)` is the entry point for a wider check script: `report(name, ok, detail)` is
called once per check; it returns True when every check passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

HEADS = [(9, 3), (8, 8), (32, 1), (28, 4)]
HEAD_DIMS = [64, 80, 128]
BLOCK_SIZES = [1, 8, 16, 32, 24]
DTYPES = ["float16", "bfloat16"]
LONG = 5000  # long enough for the default split policy to split

Report = Callable[[str, bool, str], None]


def grid(quick: bool) -> list[tuple]:
    cases = list(itertools.product(HEADS, HEAD_DIMS, BLOCK_SIZES, DTYPES))
    if quick:  # every pair of values still covered: heads x block_size x one head_dim/dtype
        cases = [
            (h, HEAD_DIMS[(i + j) % 3], b, DTYPES[(i + j) % 2])
            for (i, h), (j, b) in itertools.product(enumerate(HEADS), enumerate(BLOCK_SIZES))
        ]
    return cases


def check_case(params: tuple) -> list[tuple[str, bool, str]]:
    """Run one grid case on the GPU; return (name, ok, detail) per check. Runs in a worker."""
    from kernel_reference import make_case, ref_attention, tolerance

    import kernels

    heads, head_dim, bs, dtype_name = params
    dtype = getattr(torch, dtype_name)
    tol = tolerance(dtype)
    name = f"{heads[0]}q{heads[1]}kv d{head_dim} bs{bs} {dtype_name}"
    results = []

    def compare(what, out, ref):
        out = out.double().cpu()
        ok = not out.isnan().any() and torch.allclose(out, ref, **tol)
        err = (out - ref).abs().nan_to_num(float("inf")).max().item()
        results.append((f"{what} {name}", bool(ok), f"max_abs_err={err:.3g}"))

    lens = [n for n in (1, bs - 1, bs, bs + 1, 2 * bs + 3, 257, LONG) if n >= 1]
    case = make_case(lens, [1] * len(lens), *heads, head_dim, bs, dtype, seed=bs)
    ref = ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, case.scale,
    )  # fmt: skip
    pool = case.pool.cuda()
    kc, vc = pool[:, case.layer, 0], pool[:, case.layer, 1]
    args = (case.query.cuda(), kc, vc, case.block_tables.cuda(), case.seq_lens.cuda())
    for num_splits in (None, 7):
        out = kernels.paged_decode_attention(*args, case.scale, num_splits=num_splits)
        compare(f"decode splits={num_splits}", out, ref)

    b = bs
    batch = [(3 * b + 4, b + 1), (300, 300), (1, 1), (b, 1), (2 * b + 3, 1), (2 * b, b)]
    case = make_case([s for s, _ in batch], [n for _, n in batch], *heads, head_dim, bs, dtype)
    ref = ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, case.scale,
    )  # fmt: skip
    pool = case.pool.cuda()
    out = kernels.paged_prefill_attention(
        case.query.cuda(), pool[:, case.layer, 0], pool[:, case.layer, 1],
        case.block_tables.cuda(), case.query_start_loc.cuda(), case.seq_lens.cuda(), case.scale,
    )  # fmt: skip
    compare("prefill", out, ref)
    torch.cuda.synchronize()
    return results


def check_cache_ops(report: Report) -> None:
    from kernel_reference import run_int64_case

    import kernels

    for dtype, bs in itertools.product((torch.float16, torch.bfloat16), (1, 16, 24)):
        pool = torch.randn(12, 2, 2, bs, 3, 80, device="cuda").to(dtype)
        before = pool.clone()
        slots = torch.randperm(12 * bs, device="cuda")[:9]
        key = torch.randn(9, 3, 80, device="cuda")  # fp32, cast on write
        value = torch.randn(9, 3, 80, device="cuda")
        kernels.reshape_and_cache(key, value, pool[:, 1, 0], pool[:, 1, 1], slots)
        blocks, offs = slots // bs, slots % bs
        ok = torch.equal(pool[blocks, 1, 0, offs], key.to(dtype)) and torch.equal(
            pool[blocks, 1, 1, offs], value.to(dtype)
        )
        pool[blocks, 1, :, offs] = before[blocks, 1, :, offs]
        ok = ok and torch.equal(pool, before)
        report(f"reshape_and_cache bs{bs} {dtype}", ok, "")

        pairs = torch.tensor([[1, 7], [4, 2], [1, 9]], device="cuda")
        before = pool.clone()
        kernels.copy_blocks(pool, pairs)
        ok = all(torch.equal(pool[d], before[s]) for s, d in pairs.tolist())
        rest = [i for i in range(12) if i not in (7, 2, 9)]
        report(f"copy_blocks bs{bs} {dtype}", ok and torch.equal(pool[rest], before[rest]), "")

    pool = torch.empty((1 << 20) + 64, 1, 2, 16, 1, 64, dtype=torch.float16, device="cuda")
    try:
        run_int64_case(pool, backend="triton")
        report("int64 offsets (4 GiB pool)", True, "")
    except AssertionError as e:
        report("int64 offsets (4 GiB pool)", False, str(e)[:300])
    del pool
    torch.cuda.empty_cache()


def bandwidth_table(report: Report, quick: bool) -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "benchmarks" / "bench_kernels.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench_cuda(quick)
    bench.print_table(rows)
    for r in rows:
        report(
            f"bandwidth {r['shape']} b{r['batch']} ctx{r['context']}",
            r["max_abs_diff"] < 5e-2,
            f"{r['paged_gbs']:.0f} GB/s, {r['paged_over_dense']:.2f}x dense SDPA time",
        )


def run(report: Report | None = None, quick: bool = False, jobs: int = 8) -> bool:
    """Run every check; `report(name, ok, detail)` sees each result. True if all passed."""
    failures = []

    def _report(name: str, ok: bool, detail: str) -> None:
        if not ok:
            failures.append(name)
        (report or _print)(name, ok, detail)

    if not torch.cuda.is_available():
        _report("cuda device", False, "no CUDA device visible")
        return False
    t0 = time.time()
    cases = grid(quick)
    if jobs > 1:
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
            for results in ex.map(check_case, cases):
                for r in results:
                    _report(*r)
    else:
        for c in cases:
            for r in check_case(c):
                _report(*r)
    print(f"# grid: {len(cases)} cases in {time.time() - t0:.0f} s", flush=True)
    check_cache_ops(_report)
    bandwidth_table(_report, quick=True)
    print(f"# {len(failures)} failed: {failures[:20]}" if failures else "# all passed")
    return not failures


def _print(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pairwise grid instead of the full one")
    ap.add_argument("--jobs", type=int, default=8, help="worker processes for the grid")
    args = ap.parse_args(argv)
    return 0 if run(quick=args.quick, jobs=args.jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
