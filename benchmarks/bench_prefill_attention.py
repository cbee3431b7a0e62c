"""CPU prefill / mixed-batch attention: `kernels.paged_attention` alone, checkout by checkout.

One layer's attention call of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64,
block size 16) on batches the serving benchmark's trace produces, in a block-major pool of 30
layers with scattered blocks:

- "mixed": two prompt chunks of 200 tokens (no cached prefix) and 312 tokens (after a 128-token
  cached prefix) plus 30 decode rows of contexts 280..338 (one step under a 512-token budget,
  chunked prefill mixed with decodes);
- "prefill 2x256": two whole 256-token prompts;
- "prefill 3 varied": three whole prompts of 231, 250 and 274 tokens.

A *variant* is a checkout (a folder, default this one) and a dtype; each runs in a process of its
own with that checkout first on `sys.path`, the variants take turns case by case, and the table
gives the median microseconds of one `paged_attention` call (the plan is built once per case,
as a model step does, and its time is listed apart).

    python benchmarks/bench_prefill_attention.py --variant "main bf16=../other-checkout:bfloat16" \\
        --variant "new bf16=.:bfloat16"

``--variant LABEL=FOLDER:DTYPE``. Prints one table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HQ, HK, D, BLOCK, LAYERS = 9, 3, 64, 16, 30
# (seq_len, new tokens) per sequence
CASES = {
    "mixed": [(200, 200), (440, 312)] + [(280 + 2 * i, 1) for i in range(30)],
    "prefill 2x256": [(256, 256), (256, 256)],
    "prefill 3 varied": [(231, 231), (250, 250), (274, 274)],
}


def child(dtype_name: str, threads: int) -> None:
    """In a variant's checkout: build the cases, then per stdin line `CASE REPS` print timings."""
    import torch

    import kernels

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for name, batch in CASES.items():
        per = [-(-s // BLOCK) for s, _ in batch]
        num_blocks = sum(per) + 8
        pool = torch.randn(num_blocks, LAYERS, 2, BLOCK, HK, D, generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros(len(batch), max(per), dtype=torch.int32)
        used = 0
        for i, n in enumerate(per):
            tables[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        q_lens = torch.tensor([q for _, q in batch])
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        qsl[1:] = q_lens.cumsum(0)
        lens = torch.tensor([s for s, _ in batch], dtype=torch.int32)
        query = torch.randn(int(q_lens.sum()), HQ, D, generator=gen).to(dtype)
        runs[name] = (pool, tables, qsl, lens, query)

    def run(name: str) -> tuple[float, float]:
        pool, tables, qsl, lens, query = runs[name]
        t0 = time.perf_counter()
        plan = kernels.plan_attention(tables, qsl, lens, BLOCK)
        t1 = time.perf_counter()
        for layer in range(LAYERS):
            kernels.paged_attention(query, pool[:, layer, 0], pool[:, layer, 1], plan, D**-0.5)
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / LAYERS

    for name in runs:
        run(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, reps = line.rsplit(" ", 1)
        print(json.dumps({"times": [run(name) for _ in range(int(reps))]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="LABEL=FOLDER:DTYPE")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="steps (of every layer) per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.threads)
    specs = args.variant or ["this bf16=.:bfloat16", "this fp32=.:float32"]
    procs = []
    for spec in specs:
        label, rest = spec.split("=", 1)
        folder, dtype = rest.rsplit(":", 1)
        tree = (ROOT if folder == "." else Path(folder)).resolve()
        env = {"PYTHONPATH": f"{tree / 'protos'}:{tree}", "PATH": "/usr/bin:/bin"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", dtype, "--threads", str(args.threads)]
        p = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(p.stdout.readline())
        procs.append((label, p))
    times = {(label, case): [] for label, _ in procs for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            for label, p in procs:
                p.stdin.write(f"{case} {args.reps}\n")
                p.stdin.flush()
                times[label, case] += json.loads(p.stdout.readline())["times"]
    for _, p in procs:
        p.stdin.close()
        p.wait()
    print(f"{'variant':<16} {'case':<18} {'plan us':>9} {'attention us/layer':>19}")
    for (label, case), ts in times.items():
        plan_us = statistics.median(t for t, _ in ts) * 1e6
        call_us = statistics.median(c for _, c in ts) * 1e6
        print(f"{label:<16} {case:<18} {plan_us:>9.0f} {call_us:>19.0f}")


if __name__ == "__main__":
    main()
