"""GPU check of the Triton paged kernels: compile, compare with the dense reference, bandwidth.

Runs from source: `PYTHONPATH=. python scripts/gpu_check_kernels.py [--quick] [--jobs N]`.
Needs one CUDA device, torch and triton (tested for torch 2.11 + triton 3.6). Three parts:

1. correctness, fp16 and bf16, the full grid: (num_q_heads, num_kv_heads) in (9,3) (8,8) (32,1)
   (28,4) x head_dim 64/80/128 x block_size 1/8/16/32/24, each a decode-only batch of context
   lengths at and around block boundaries plus 257 and a long one (the plan's split policy, and
   forced split-KV), and a mixed batch; every call is the model's (`plan_attention` from host
   lengths, then `paged_attention`), and the plan must pick the decode kernel for the decode
   batch and the prefill kernel for the mixed one. The reference is the fp64 dense one of
   tests/helpers/kernel_reference.py computed on the CPU. fp8 (e4m3) caches: the same batches, every
   pair of (heads, block_size) values with head_dim 48/64/80/128 and bf16/fp16 queries, per-KV-head
   scales orders of magnitude apart (`make_fp8_case`), against the reference over the
   dequantized cache (outputs over their head's magnitude; needs compute capability >= 8.9,
   skipped below). Cases are spread over `--jobs` worker processes because compiling ~400
   kernel variants dominates the time.
2. cache ops, int64 offsets and the sampler's draws (the Triton kernel's bits against the CPU
   path's): reshape_and_cache / copy_blocks round trips (fp8: the stored
   bytes are `kernels.quantize_fp8`'s, saturation and rounding edges included) and attention
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
FP8_HEAD_DIMS = [64, 48, 128, 80]
# fp8 caches against the reference over the unquantized values, over the head's magnitude:
# e4m3's relative half-ulp (tests/kernels/test_kernels_fp8.py); reported in the detail, not failed.
FP8_UNQUANTIZED_BOUND = 2.0**-4

Report = Callable[[str, bool, str], None]


def grid(quick: bool, fp8: bool = True) -> list[tuple]:
    """(heads, head_dim, block_size, query dtype, cache) cases; cache "same" (the query's dtype)
    or "fp8" (float8_e4m3fn with per-KV-head scales, pairwise in either mode)."""
    cases = [(*c, "same") for c in itertools.product(HEADS, HEAD_DIMS, BLOCK_SIZES, DTYPES)]
    if quick:  # every pair of values still covered: heads x block_size x one head_dim/dtype
        cases = [
            (h, HEAD_DIMS[(i + j) % 3], b, DTYPES[(i + j) % 2], "same")
            for (i, h), (j, b) in itertools.product(enumerate(HEADS), enumerate(BLOCK_SIZES))
        ]
    if fp8:
        cases += [
            (h, FP8_HEAD_DIMS[(i + j) % 4], b, DTYPES[(i + j // 2) % 2], "fp8")
            for (i, h), (j, b) in itertools.product(enumerate(HEADS), enumerate(BLOCK_SIZES))
        ]
    return cases


def check_case(params: tuple) -> list[tuple[str, bool, str]]:
    """Run one grid case on the GPU; return (name, ok, detail) per check. Runs in a worker."""
    from kernel_reference import make_case, make_fp8_case, ref_attention, tolerance

    import kernels

    heads, head_dim, bs, dtype_name, cache = params
    dtype = getattr(torch, dtype_name)
    tol = tolerance(dtype)
    fp8 = cache == "fp8"
    name = f"{heads[0]}q{heads[1]}kv d{head_dim} bs{bs} {dtype_name}" + (" fp8 cache" if fp8 else "")
    results = []

    def build(seq_lens, q_lens, **kw):
        if fp8:
            return make_fp8_case(seq_lens, q_lens, *heads, head_dim, bs, dtype, **kw)
        return make_case(seq_lens, q_lens, *heads, head_dim, bs, dtype, **kw)

    def attend(case, want_kernel: str, what: str, **kw) -> None:
        """The model's calls on the GPU copy of `case`, compared with the CPU fp64 reference
        (fp8: over the dequantized cache, outputs over their head's magnitude)."""
        if fp8:
            ref, mag = case.reference(), case.head_magnitude()[None, :, None]
            scales = {"k_scale": case.k_scale.cuda(), "v_scale": case.v_scale.cuda()}
        else:
            ref = ref_attention(
                case.query, case.key_cache, case.value_cache, case.block_tables,
                case.query_start_loc, case.seq_lens, case.scale,
            )  # fmt: skip
            mag, scales = 1.0, {}
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
            case.query.cuda(), pool[:, case.layer, 0], pool[:, case.layer, 1], plan, case.scale, **scales
        )
        out = out.double().cpu()
        ok = not out.isnan().any() and torch.allclose(out / mag, ref / mag, **tol)
        err = ((out - ref) / mag).abs().nan_to_num(float("inf")).max().item()
        detail = f"{plan.kernel} splits={plan.num_splits} max_abs_err={err:.3g}"
        if fp8:
            unq = ((out - case.reference(dequantized=False)) / mag).abs().nan_to_num(float("inf")).max().item()
            detail += (f" (of the head's magnitude); vs unquantized {unq:.3g} "
                       f"(bound {FP8_UNQUANTIZED_BOUND:.3g}: {'met' if unq <= FP8_UNQUANTIZED_BOUND else 'not met'})")
        results.append((f"{what} {name}", bool(ok), detail))

    lens = [n for n in (1, bs - 1, bs, bs + 1, 2 * bs + 3, 257, LONG) if n >= 1]
    case = build(lens, [1] * len(lens), seed=bs)
    for num_splits in (None, 7):
        attend(case, "triton_decode", f"decode splits={num_splits or 'policy'}", num_splits=num_splits)

    b = bs
    batch = [(3 * b + 4, b + 1), (300, 300), (1, 1), (b, 1), (2 * b + 3, 1), (2 * b, b)]
    case = build([s for s, _ in batch], [n for _, n in batch])
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

    if fp8_supported():
        check_fp8_cache_ops(report)
    else:
        report("fp8 cache ops", True, "skipped: float8e4nv needs compute capability >= 8.9")

    pool = torch.empty((1 << 20) + 64, 1, 2, 16, 1, 64, dtype=torch.float16, device="cuda")
    try:
        run_int64_case(pool, backend="triton")
        report("int64 offsets (4 GiB pool)", True, "")
    except AssertionError as e:
        report("int64 offsets (4 GiB pool)", False, str(e)[:300])
    del pool
    torch.cuda.empty_cache()


def check_draws(report: Report) -> None:
    """The sampler's Philox uniforms computed by the Triton kernel on the GPU have the CPU path's bits."""
    import numpy as np

    from kernels import draws

    keys = [*range(4096), 2**63, 2**64 - 1]
    gpu = draws.uniforms(keys, "cuda").cpu().numpy()
    cpu = draws.uniforms(keys, "cpu").numpy()
    same = np.array_equal(gpu.view(np.uint32), cpu.view(np.uint32))
    report("sampler draws: the GPU's bits equal the CPU's", same,
           f"{len(keys)} keys, {int((gpu != cpu).sum())} differ")


def fp8_supported() -> bool:
    """Whether Triton can load float8e4nv on this GPU (compute capability >= 8.9)."""
    return torch.cuda.get_device_capability() >= (8, 9)


def check_fp8_cache_ops(report: Report) -> None:
    """fp8 writes store `kernels.quantize_fp8`'s bytes (computed on the CPU, the definition),
    edges included; fp8 block copies move bytes."""
    import kernels

    heads, dim = 3, 80
    k_scale, v_scale = torch.tensor([1e-3, 10.0, 0.5]), torch.tensor([40.0, 2e-4, 1.0])
    edges = torch.tensor([448.0, 449.0, 464.0, 1e6, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30,
                          2.0**-10, 3 * 2.0**-10, 2.0**-9, 1.0625, 1.1875, -2.0**-10, 2.0**-6])  # fmt: skip
    for key_dtype, bs in itertools.product((torch.float32, torch.bfloat16, torch.float16), (1, 16, 24)):
        gen = torch.Generator().manual_seed(bs)
        key = torch.randn(9, heads, dim, generator=gen) * 100
        value = torch.randn(9, heads, dim, generator=gen) * torch.exp2(-12 * torch.rand(9, heads, dim, generator=gen))
        value[0, :, : edges.numel()] = edges * v_scale[:, None]
        key[1, :, : edges.numel()] = -edges * k_scale[:, None]
        key, value = key.to(key_dtype), value.to(key_dtype)
        pool = torch.randint(0, 256, (12, 2, 2, bs, heads, dim), dtype=torch.uint8, device="cuda")
        pool = pool.view(torch.float8_e4m3fn)
        before = pool.view(torch.uint8).clone()
        slots = torch.randperm(12 * bs, generator=gen)[:9]
        kernels.reshape_and_cache(
            key.cuda(), value.cuda(), pool[:, 1, 0], pool[:, 1, 1], slots.cuda(),
            k_scale=k_scale.cuda(), v_scale=v_scale.cuda(),
        )  # fmt: skip
        blocks, offs = slots // bs, slots % bs
        got = pool.view(torch.uint8).cpu()
        ok = torch.equal(got[blocks, 1, 0, offs], kernels.quantize_fp8(key, k_scale).view(torch.uint8)) and torch.equal(
            got[blocks, 1, 1, offs], kernels.quantize_fp8(value, v_scale).view(torch.uint8)
        )
        got[blocks, 1, :, offs] = before.cpu()[blocks, 1, :, offs]
        report(f"reshape_and_cache fp8 bs{bs} {key_dtype} rows", ok and torch.equal(got, before.cpu()), "")

        pairs = torch.tensor([[1, 7], [4, 2], [1, 9]], device="cuda")
        before = pool.view(torch.uint8).clone()
        kernels.copy_blocks(pool, pairs)
        after = pool.view(torch.uint8)
        ok = all(torch.equal(after[d], before[s]) for s, d in pairs.tolist())
        rest = [i for i in range(12) if i not in (7, 2, 9)]
        report(f"copy_blocks fp8 bs{bs}", ok and torch.equal(after[rest], before[rest]), "")


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
    cases = grid(quick, fp8=fp8_supported())
    if not fp8_supported():
        _report("fp8 attention grid", True, "skipped: float8e4nv needs compute capability >= 8.9")
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
    check_draws(_report)
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
