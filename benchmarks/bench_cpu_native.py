"""Native CPU decode kernel vs the torch gather + SDPA path, and the per-call cost of the native ops.

At SmolLM2-135M's layer shape (9 q heads, 3 KV heads, head_dim 64, block size 16), batch
1/8/32/64 x context 128/300/1000, fp32 and bf16 (query, pool and output of one dtype). Each call
is what the model runs per layer: `kernels.paged_attention(query, key_cache, value_cache, plan, scale)` with the
step's plan built once (under `kernels.cpu.native.use_native(True)` or `(False)`), reading layer
views `pool[:, layer, 0/1]` of a block-major pool of `--layers` layers, cycled call by call so that
one layer's blocks are not hot in L1/L2 from the previous call. Variants alternate call by call;
the figure is the median per call in ms. A second table gives a batch-1 call's total cost in us
(the direct `cpu_native.paged_decode` and `cpu_native.reshape_and_cache` calls, and the model's
path through `kernels`).

Usage: `python benchmarks/bench_cpu_native.py [--quick] [--out PATH]`.
Prints tables and writes JSON (default benchmarks/results/bench_cpu_native.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import kernels
from kernels.cpu import native as cpu_native

HQ, HK, D, BS = 9, 3, 64, 16
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_cpu_native.json"


def make_batch(batch: int, ctx: int, dtype: torch.dtype, layers: int):
    """Scattered block tables over a block-major pool [blocks, layers, 2, BS, HK, D]."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-ctx // BS)
    num_blocks = batch * per_seq + 1
    pool = torch.randn(num_blocks, layers, 2, BS, HK, D, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    return pool, tables, seq_lens, qsl, query


def time_variants(fns: dict, reps: int) -> dict:
    """Median seconds per call of each fn, the variants alternating call by call."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def layer_call(pool, query, tables, qsl, seq_lens, plan):
    """The model's attention call of one layer, a different layer of the pool each time."""
    layers, layer = pool.shape[1], [0]

    def call():
        layer[0] = (layer[0] + 1) % layers
        kc, vc = pool[:, layer[0], 0], pool[:, layer[0], 1]
        kernels.paged_attention(query, kc, vc, plan, D**-0.5)

    return call


def decode_table(batches, contexts, dtypes, layers: int, budget_s: float) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for batch in batches:
            for ctx in contexts:
                pool, tables, seq_lens, qsl, query = make_batch(batch, ctx, dtype, layers)
                fns = {}
                for name, native in (("native", True), ("torch", False)):
                    with cpu_native.use_native(native):
                        plan = kernels.plan_attention(tables, qsl, seq_lens, BS)
                    fns[name] = layer_call(pool, query, tables, qsl, seq_lens, plan)
                t0 = time.perf_counter()
                fns["torch"]()
                one = time.perf_counter() - t0
                reps = int(max(5, min(200, budget_s / max(one, 1e-5) / 2)))
                med = time_variants(fns, reps)
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch,
                    "ctx": ctx,
                    "reps": reps,
                    "native_ms": med["native"] * 1e3,
                    "torch_ms": med["torch"] * 1e3,
                }
                row["speedup"] = row["torch_ms"] / row["native_ms"]
                rows.append(row)
                print(
                    f"{row['dtype']:>8} {batch:>5} {ctx:>5} {row['native_ms']:>10.3f} {row['torch_ms']:>10.3f}"
                    f" {row['speedup']:>7.2f}x",
                    flush=True,
                )
    return rows


def overhead_table(dtypes, reps: int) -> list[dict]:
    """Batch 1, context 300: a whole call's cost in us, direct and through `kernels`."""
    rows = []
    for dtype in dtypes:
        fns = batch1_calls(dtype)
        med = time_variants(fns, reps)
        for name, s in med.items():
            rows.append({"dtype": str(dtype).removeprefix("torch."), "call": name, "us": s * 1e6})
            print(f"{rows[-1]['dtype']:>8} {name:<34} {s * 1e6:>9.1f}", flush=True)
    return rows


def batch1_calls(dtype) -> dict:
    """One layer's native calls of a batch-1 decode step at context 300, direct and via kernels."""
    pool, tables, seq_lens, qsl, query = make_batch(1, 300, dtype, 1)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    with cpu_native.use_native(True):
        plan = kernels.plan_attention(tables, qsl, seq_lens, BS)
    out = torch.empty_like(query)
    seq_index = torch.zeros(1, dtype=torch.int64)
    k_new, v_new = torch.randn(1, HK, D).to(dtype), torch.randn(1, HK, D).to(dtype)
    slot = torch.tensor([int(tables[0, -1]) * BS + 299 % BS], dtype=torch.int64)
    fns = {
        "paged_decode": lambda: cpu_native.paged_decode(
            query, kc, vc, tables, seq_lens, seq_index, seq_index, D**-0.5, out
        ),
        "reshape_and_cache": lambda: cpu_native.reshape_and_cache(k_new, v_new, kc, vc, slot),
        "kernels.paged_attention": lambda: kernels.paged_attention(query, kc, vc, plan, D**-0.5),
        "kernels.reshape_and_cache": lambda: kernels.reshape_and_cache(k_new, v_new, kc, vc, slot),
    }
    if not cpu_native.supports(query, kc, vc):  # no native kernel for this dtype: direct calls fail
        del fns["paged_decode"], fns["reshape_and_cache"]
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 32, context 300 only")
    ap.add_argument("--layers", type=int, default=4, help="layers of the pool, cycled call by call")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per configuration")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if not cpu_native.available():
        raise SystemExit(f"native kernels unavailable: {cpu_native.unavailable_reason}")
    batches, contexts = ([1, 32], [300]) if args.quick else ([1, 8, 32, 64], [128, 300, 1000])
    dtypes = [torch.bfloat16, torch.float32]
    print(f"threads={torch.get_num_threads()} layers={args.layers}  (ms per call, median)")
    print(f"{'dtype':>8} {'batch':>5} {'ctx':>5} {'native_ms':>10} {'torch_ms':>10} {'speedup':>8}")
    decode = decode_table(batches, contexts, dtypes, args.layers, args.budget)
    print("\nbatch 1, context 300: one call (us, median)")
    overhead = overhead_table(dtypes, 2000)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "layers": args.layers,
                "shape": {"hq": HQ, "hk": HK, "head_dim": D, "block_size": BS},
                "decode": decode,
                "overhead": overhead,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
