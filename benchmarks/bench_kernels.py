"""Paged attention as the model calls it (`plan_attention` once per step, `paged_attention` per
layer), at decode-only and mixed batches, against dense SDPA over the same tokens.

Each row is one batch: `plan_ms` is the once-per-step `plan_attention` (host time), `paged_ms` one
layer's `paged_attention` with that plan, `step_ms` = plan + `layers` x paged (the attention of a
whole step), `kernel` the kernel the plan picked. Decode rows also time dense
`scaled_dot_product_attention` on a contiguous copy of the same keys and values (`dense_ms`,
`paged_over_dense`). Medians after a warm-up.

CPU: SmolLM2-135M's layer (9 q heads, 3 KV heads, head_dim 64, 30 layers), fp32 (and bf16 with
`--dtype bfloat16|both`, an fp32 query over an fp8 e4m3 cache with per-KV-head scales with
`--dtype fp8`, all three with `--dtype all`), decode batch 1/16/64 x context 128/1k/4k, and mixed
batches (decode tokens plus one 256-token prefill chunk). An fp8 row's dense SDPA reads a
dequantized fp32 copy.

CUDA: a Llama-3-8B-like layer (32 q heads, 8 KV heads, head_dim 128, 32 layers, bf16), decode at
batch 64 x context 4096 with block size 16 (32 and 64 beside it): achieved bandwidth (K and V
bytes read / time) as a fraction of the device's HBM peak (`HBM_PEAK_GBS`), eager (``paged_ms``)
and replayed from a CUDA graph (``graph_ms``, ``graph_gbs``: the split count read on the device,
as a decode step's graph runs it), paged vs dense (goal:
>= 80% of peak, within 10% of dense), and `prefill_kernel_ms`, the prefill kernel on the same
decode batch (what a plan-less op ran). Mixed: the same batch plus one 512-token chunk (prefill
kernel). Also SmolLM2's shape.

Usage: `python benchmarks/bench_kernels.py [--quick] [--device auto|cpu|cuda] [--out PATH]`.
Prints a table and writes JSON (default benchmarks/results/bench_kernels.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels.plan import split_size

HBM_PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # GB/s, vendor figures
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_kernels.json"


@dataclass
class Batch:
    """One step's attention inputs over a scattered paged cache (one layer of a block-major pool)."""

    query: torch.Tensor  # [total_q, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32, on the device
    query_start_loc: torch.Tensor  # [S + 1] int32, on the device
    seq_lens: torch.Tensor  # [S] int32, on the device
    host_query_start_loc: torch.Tensor  # the same on the CPU
    host_seq_lens: torch.Tensor
    kv_bytes: int  # K and V bytes the step's attention must read (each context position once)
    k_scale: torch.Tensor | None = None  # [Hkv] fp32: fp8 caches only
    v_scale: torch.Tensor | None = None

    def plan(self, **kw) -> kernels.AttentionPlan:
        """The model's once-per-step call."""
        return kernels.plan_attention(
            self.block_tables, self.query_start_loc, self.seq_lens, self.key_cache.shape[1],
            host_query_start_loc=self.host_query_start_loc, host_seq_lens=self.host_seq_lens,
            num_kv_heads=self.key_cache.shape[2], **kw,
        )  # fmt: skip

    def dense_kv(self, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [seqs, Hkv, ctx, D] copies of the first `seqs` sequences' K and V (equal
        lengths)."""
        ctx = int(self.host_seq_lens[0])
        idx = self.block_tables[:seqs].long()
        k = self.key_cache[idx].flatten(1, 2)[:, :ctx]  # [seqs, ctx, Hkv, D]
        v = self.value_cache[idx].flatten(1, 2)[:, :ctx]
        if self.k_scale is not None:  # fp8: dense SDPA reads the values in the query's dtype
            k = kernels.dequantize_fp8(k, self.k_scale, self.query.dtype)
            v = kernels.dequantize_fp8(v, self.v_scale, self.query.dtype)
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def make_batch(
    q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, cache_dtype=None
) -> Batch:
    """Random K/V in shuffled blocks; the pool is viewed as layer 1 of two (strided views). The
    cache has the query's `dtype` unless `cache_dtype` is float8_e4m3fn (per-KV-head scales)."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    pool = torch.randn(num_blocks, 1, 2, block_size, num_kv_heads, head_dim, generator=gen, device=device)
    scales = {}
    if cache_dtype == kernels.FP8_DTYPE:
        # per KV head: the largest |value| maps to 448
        scale = (pool.abs().amax(dim=(0, 1, 2, 3, 5)) / kernels.FP8_MAX).float()
        scales = {"k_scale": scale, "v_scale": scale.clone()}
        pool = kernels.quantize_fp8(pool, scale)
    pool = pool.to(cache_dtype or dtype).expand(num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[start : start + nb].to(torch.int32)
        start += nb
    host_qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    host_lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * pool.element_size()
    return Batch(
        query, pool[:, 1, 0], pool[:, 1, 1], tables, host_qsl.to(device), host_lens.to(device),
        host_qsl, host_lens, kv_bytes, **scales,
    )  # fmt: skip


def dense_sdpa(query, k_dense, v_dense, scale):
    # query: [B, Hq, D] -> [B, Hq, 1, D]; k/v: [B, Hk, T, D]
    return F.scaled_dot_product_attention(query.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True).squeeze(2)


def time_host(fn, reps: int) -> float:
    """Median seconds of `reps` calls after two warm-up calls (host clock)."""
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


def measure(batch: Batch, layers: int, reps: int, cuda: bool, decode: bool) -> dict:
    """Time the model's calls on `batch` (and dense SDPA for a decode batch); one row."""
    scale = batch.query.shape[2] ** -0.5
    plan = batch.plan()
    kv_scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    attend = lambda: kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, scale, **kv_scales)
    timer = time_cuda if cuda else time_host
    t_plan, t_paged = time_host(batch.plan, reps), timer(attend, reps)
    row = {
        "kernel": plan.kernel,
        "splits": plan.num_splits,
        "plan_ms": t_plan * 1e3,
        "paged_ms": t_paged * 1e3,
        "step_ms": (t_plan + layers * t_paged) * 1e3,
        "paged_gbs": batch.kv_bytes / t_paged / 1e9,
    }
    if decode and cuda:
        t_graph = graph_seconds(batch, scale, reps)
        row |= {"graph_ms": t_graph * 1e3, "graph_gbs": batch.kv_bytes / t_graph / 1e9}
    if decode:
        kd, vd = batch.dense_kv(batch.query.shape[0])
        dense = lambda: dense_sdpa(batch.query, kd, vd, scale)
        t_dense = timer(dense, reps)
        err = (attend().float() - dense().float()).abs().max().item()
        row |= {"dense_ms": t_dense * 1e3, "paged_over_dense": t_paged / t_dense, "max_abs_diff": err}
        del kd, vd
    return row


def graph_seconds(batch: Batch, scale: float, reps: int) -> float:
    """One layer's decode attention replayed from a CUDA graph, as a decode step's graph runs it
    (`compute_service.model.decode_graphs`): the split count and size read from a device tensor,
    the grid's splits those of the eager plan."""
    plan = batch.plan()
    splits = plan.splits_for(batch.key_cache.shape[2])
    plan.split_args = torch.tensor([splits, split_size(plan.max_seq_len, splits)], dtype=torch.int32,
                                   device=batch.query.device)
    kv_scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    attend = lambda: kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, scale, **kv_scales)
    attend()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    return time_cuda(graph.replay, reps)


def prefill_kernel_seconds(batch: Batch) -> float:
    """The Triton prefill kernel on a decode batch (what the model ran before plans chose the
    kernel), launched directly with the plan's metadata."""
    from kernels.triton import prefill as triton_prefill

    plan, scale = batch.plan(), batch.query.shape[2] ** -0.5
    args = (batch.query, batch.key_cache, batch.value_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens)
    return time_cuda(lambda: triton_prefill.paged_prefill_attention(*args, scale))


# --dtype choice -> (query dtype, cache dtype or None for the query's) per CPU table.
CPU_DTYPES = {
    "float32": [(torch.float32, None)],
    "bfloat16": [(torch.bfloat16, None)],
    "fp8": [(torch.float32, torch.float8_e4m3fn)],
    "both": [(torch.float32, None), (torch.bfloat16, None)],
    "all": [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)],
}


def bench_cpu(quick: bool, dtypes: list[tuple[torch.dtype, torch.dtype | None]]) -> list[dict]:
    rows = []
    hq, hkv, dim, layers = 9, 3, 64, 30
    batches = [1, 16] if quick else [1, 16, 64]
    contexts = [128, 1024] if quick else [128, 1024, 4096]
    for dtype, cache_dtype in dtypes:
        label = str(dtype)[6:] + (" q, fp8 cache" if cache_dtype is not None else "")
        for b in batches:
            for ctx in contexts:
                # Fewer repetitions for the big cases: their medians settle quickly.
                reps = (5 if quick else 21) if b * ctx <= 16384 else (3 if quick else 7)
                for mixed in (False, True):
                    if mixed and b == 1:
                        continue
                    # Mixed: b - 1 decode tokens plus one 256-token chunk after a cached prefix.
                    q_lens = [1] * (b - 1) + [256 if mixed else 1]
                    lens = [max(ctx, q) for q in q_lens]
                    batch = make_batch(q_lens, lens, hq, hkv, dim, 16, dtype, "cpu", cache_dtype)
                    row = measure(batch, layers, reps, cuda=False, decode=not mixed)
                    rows.append({"device": "cpu", "shape": f"smollm2 9/3/64 {label}",
                                 "batch": "mixed" if mixed else "decode", "seqs": b, "context": ctx,
                                 "block_size": 16, **row})  # fmt: skip
    return rows


def bench_cuda(quick: bool) -> list[dict]:
    rows = []
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_PEAK_GBS.items() if k in name), None)
    llama, smol = ("llama3-8b 32/8/128 bf16", 32, 8, 128, 32), ("smollm2 9/3/64 bf16", 9, 3, 64, 30)
    # (shape, seqs, context, block size, mixed)
    cases = [(llama, 64, 4096, bs, False) for bs in (32, 64)]
    cases += [(llama, 64, 4096, 16, True)]
    # The decode bandwidth grid: batch 1/8/64 x context 1k/4k/16k, both shapes, block size 16 (eager).
    cases += [(shape, b, ctx, 16, False) for shape in (smol, llama) for b in (1, 8, 64) for ctx in (1024, 4096, 16384)]
    if not quick:
        cases += [(llama, 1, 4096, 16, False), (llama, 1, 32768, 16, False), (llama, 16, 1024, 16, False)]
        cases += [(smol, 16, 1024, 16, True)]
    for (label, hq, hkv, dim, layers), b, ctx, bs, mixed in cases:
        q_lens = [1] * b + ([512] if mixed else [])
        lens = [ctx] * len(q_lens)
        batch = make_batch(q_lens, lens, hq, hkv, dim, bs, torch.bfloat16, "cuda")
        row = measure(batch, layers, 20, cuda=True, decode=not mixed)
        row["frac_of_hbm_peak"] = row["paged_gbs"] / peak if peak else None
        if not mixed:
            row["prefill_kernel_ms"] = prefill_kernel_seconds(batch) * 1e3
        rows.append({"device": name, "shape": label, "batch": "mixed" if mixed else "decode", "seqs": b,
                     "context": ctx, "block_size": bs, **row})  # fmt: skip
        del batch
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r if c != "device"))
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{'' if v is None else v!s:>14}")
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=list(CPU_DTYPES), default="float32",
                    help="CPU dtype(s): fp8 is an fp32 query over an fp8 cache; all: float32, bfloat16, fp8")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rows = bench_cuda(args.quick) if use_cuda else bench_cpu(args.quick, CPU_DTYPES[args.dtype])
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
