"""GPU check of the Triton paged kernels: compile, compare with the dense reference, bandwidth.

Runs from source: `PYTHONPATH=. python scripts/gpu_check_kernels.py [--quick] [--jobs N]`.
Needs one CUDA device, torch and triton (tested for torch 2.11 + triton 3.6). Three parts:

1. correctness, fp16 and bf16, the full grid: (num_q_heads, num_kv_heads) in (9,3) (8,8) (32,1)
   (28,4) x head_dim 64/80/128 x block_size 1/8/16/32/24, each a decode-only batch of context
   lengths at and around block boundaries plus 257 and a long one (the plan's split policy, and
   forced split-KV), and a mixed batch; every call is the model's (`plan_attention` from host
   lengths, then `paged_attention`), and the plan must pick the decode kernel for the decode
   batch and the prefill kernel for the mixed one. The reference is the fp64 dense one of
   tests/kernel_reference.py computed on the CPU. Cases are spread over `--jobs` worker
   processes because compiling ~400 kernel variants dominates the time.
2. cache ops and int64 offsets: reshape_and_cache / copy_blocks round trips and attention
   through blocks past element 2**31 of a 4 GiB pool.
3. the attention table of benchmarks/bench_kernels.py: decode at a Llama-3-8B-like layer (block
   size 16, 32, 64) as % of HBM peak and vs dense SDPA (goals: >= 80%, within 10%; reported,
   not failed), the prefill kernel on the same batch, and a mixed batch.

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

    def attend(case, want_kernel: str, what: str, **kw) -> None:
        """The model's calls on the GPU copy of `case`, compared with the CPU fp64 reference."""
        ref = ref_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables,
            case.query_start_loc, case.seq_lens, case.scale,
        )  # fmt: skip
        pool = case.pool.cuda()
        plan = kernels.plan_attention(
            case.block_tables.cuda(), case.query_start_loc.cuda(), case.seq_lens.cuda(), bs,
            host_query_start_loc=case.query_start_loc, host_seq_lens=case.seq_lens,
            num_kv_heads=heads[1], **kw,
        )  # fmt: skip
        if plan.kernel != want_kernel:
            results.append((f"{what} {name}", False, f"plan picked {plan.kernel}, want {want_kernel}"))
            return
        out = kernels.paged_attention(
            case.query.cuda(), pool[:, case.layer, 0], pool[:, case.layer, 1], plan, case.scale
        )
        out = out.double().cpu()
        ok = not out.isnan().any() and torch.allclose(out, ref, **tol)
        err = (out - ref).abs().nan_to_num(float("inf")).max().item()
        results.append((f"{what} {name}", bool(ok), f"{plan.kernel} splits={plan.num_splits} max_abs_err={err:.3g}"))

    lens = [n for n in (1, bs - 1, bs, bs + 1, 2 * bs + 3, 257, LONG) if n >= 1]
    case = make_case(lens, [1] * len(lens), *heads, head_dim, bs, dtype, seed=bs)
    for num_splits in (None, 7):
        attend(case, "triton_decode", f"decode splits={num_splits or 'policy'}", num_splits=num_splits)

    b = bs
    batch = [(3 * b + 4, b + 1), (300, 300), (1, 1), (b, 1), (2 * b + 3, 1), (2 * b, b)]
    case = make_case([s for s, _ in batch], [n for _, n in batch], *heads, head_dim, bs, dtype)
    attend(case, "triton_prefill", "mixed")
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
    sys.modules["bench_kernels"] = bench  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    rows = bench.bench_cuda(quick)
    bench.print_table(rows)
    report_rows(report, rows)


def report_rows(report: Report, rows: list[dict]) -> None:
    """One check per row of `bench_kernels.bench_cuda`: the plan's kernel and the paged result
    against dense SDPA; speed against the goals is in the detail, not a failure."""
    for r in rows:
        name = f"attention {r['batch']} {r['shape']} b{r['seqs']} ctx{r['context']} bs{r['block_size']}"
        want = "triton_decode" if r["batch"] == "decode" else "triton_prefill"
        detail = f"{r['kernel']}, {r['paged_ms']:.3f} ms/layer, {r['paged_gbs']:.0f} GB/s"
        if r.get("frac_of_hbm_peak") is not None:
            detail += f" = {100 * r['frac_of_hbm_peak']:.0f}% of HBM peak"
        if r["batch"] == "decode":
            goal = (r.get("frac_of_hbm_peak") or 0) >= 0.8 and r["paged_over_dense"] <= 1.1
            detail += (
                f", {r['paged_over_dense']:.2f}x dense SDPA time, prefill kernel {r['prefill_kernel_ms']:.3f} ms"
                f"; goal (>= 80% of peak, <= 1.1x dense) {'met' if goal else 'not met'}"
            )
        ok = r["kernel"] == want and r.get("max_abs_diff", 0.0) < 5e-2
        report(name, ok, detail)


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
