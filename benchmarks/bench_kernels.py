"""Paged decode attention against dense SDPA over the same tokens.

CPU: the torch path (`backend="torch"`, the CPU production path) vs
`torch.nn.functional.scaled_dot_product_attention` on a contiguous copy of the same keys and
values, at SmolLM2-135M's layer shape (9 q heads, 3 KV heads, head_dim 64, fp32), batch
1/16/64 x context 128/1k/4k. `paged_ms` is one layer's call with the step's plan reused (as the
model runs it), `plan_ms` the once-per-step `plan_attention`, `unplanned_ms` a call that plans
for itself. Medians after a warm-up. CUDA: achieved GB/s of the Triton decode kernel (K and V bytes read
/ time) vs HBM peak and vs dense SDPA, at a Llama-3-8B-like layer (32/8/128, bf16, batch 64,
context 4096) and at SmolLM2's shape.

Usage: `python benchmarks/bench_kernels.py [--quick] [--out PATH]`. Prints a table and writes
JSON (default benchmarks/results/bench_kernels.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels

HBM_PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # GB/s, vendor figures
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_kernels.json"


def make_decode_batch(batch, ctx, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """Scattered paged cache (one layer of a 2-layer block-major pool) plus its dense copy."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    pool = torch.randn(num_blocks, 1, 2, block_size, num_kv_heads, head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    # Pretend the pool has 2 layers (strided views) without paying for the second one.
    pool = pool.expand(num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = pool[:, 1, 0], pool[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    # Dense copy: [batch, num_kv_heads, ctx, head_dim]
    idx = tables.long()
    k_dense = key_cache[idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = value_cache[idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return query, key_cache, value_cache, tables, seq_lens, k_dense, v_dense


def dense_sdpa(query, k_dense, v_dense, scale):
    # query: [B, Hq, D] -> [B, Hq, 1, D]; k/v: [B, Hk, T, D]
    return F.scaled_dot_product_attention(
        query.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True
    ).squeeze(2)


def time_cpu(fn, reps: int) -> float:
    """Median seconds of `reps` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def time_cuda(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_cpu(quick: bool) -> list[dict]:
    rows = []
    batches = [1, 16] if quick else [1, 16, 64]
    contexts = [128, 1024] if quick else [128, 1024, 4096]
    hq, hkv, dim = 9, 3, 64
    for batch in batches:
        for ctx in contexts:
            q, kc, vc, bt, sl, kd, vd = make_decode_batch(
                batch, ctx, hq, hkv, dim, 16, torch.float32, "cpu"
            )
            scale = dim**-0.5
            # Fewer repetitions for the big cases: their medians settle quickly.
            reps = (5 if quick else 21) if batch * ctx <= 16384 else (3 if quick else 7)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            make_plan = partial(kernels.plan_attention, bt, qsl, sl, 16, backend="torch")
            plan = make_plan()
            paged = partial(
                kernels.paged_decode_attention, q, kc, vc, bt, sl, scale, plan=plan,
                backend="torch",
            )  # fmt: skip
            unplanned = partial(
                kernels.paged_decode_attention, q, kc, vc, bt, sl, scale, backend="torch"
            )
            dense = partial(dense_sdpa, q, kd, vd, scale)
            t_paged, t_dense = time_cpu(paged, reps), time_cpu(dense, reps)
            t_plan, t_unplanned = time_cpu(make_plan, reps), time_cpu(unplanned, reps)
            err = (paged() - dense()).abs().max().item()
            rows.append(
                {
                    "device": "cpu",
                    "shape": "smollm2 9/3/64 fp32",
                    "batch": batch,
                    "context": ctx,
                    "paged_ms": t_paged * 1e3,
                    "dense_sdpa_ms": t_dense * 1e3,
                    "paged_over_dense": t_paged / t_dense,
                    "plan_ms": t_plan * 1e3,
                    "unplanned_ms": t_unplanned * 1e3,
                    "max_abs_diff": err,
                }
            )
    return rows


def bench_cuda(quick: bool) -> list[dict]:
    rows = []
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_PEAK_GBS.items() if k in name), None)
    shapes = [("llama3-8b 32/8/128 bf16", 32, 8, 128), ("smollm2 9/3/64 bf16", 9, 3, 64)]
    cases = [(64, 4096)] if quick else [(64, 4096), (1, 4096), (1, 32768), (16, 1024)]
    for label, hq, hkv, dim in shapes:
        for batch, ctx in cases:
            q, kc, vc, bt, sl, kd, vd = make_decode_batch(
                batch, ctx, hq, hkv, dim, 16, torch.bfloat16, "cuda"
            )
            scale = dim**-0.5
            paged = partial(
                kernels.paged_decode_attention, q, kc, vc, bt, sl, scale,
                max_seq_len=ctx, backend="triton",
            )  # fmt: skip
            dense = partial(dense_sdpa, q, kd, vd, scale)
            t_paged, t_dense = time_cuda(paged), time_cuda(dense)
            err = (paged().float() - dense().float()).abs().max().item()
            kv_bytes = 2 * batch * ctx * hkv * dim * kd.element_size()
            gbs = kv_bytes / t_paged / 1e9
            rows.append(
                {
                    "device": name,
                    "shape": label,
                    "batch": batch,
                    "context": ctx,
                    "paged_ms": t_paged * 1e3,
                    "dense_sdpa_ms": t_dense * 1e3,
                    "paged_gbs": gbs,
                    "dense_gbs": kv_bytes / t_dense / 1e9,
                    "frac_of_hbm_peak": (gbs / peak) if peak else None,
                    "paged_over_dense": t_paged / t_dense,
                    "max_abs_diff": err,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [c for c in rows[0] if c != "device"]
    print(" | ".join(f"{c:>16}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:>16.4g}" if isinstance(v, float) else f"{v!s:>16}")
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rows = bench_cuda(args.quick) if use_cuda else bench_cpu(args.quick)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
