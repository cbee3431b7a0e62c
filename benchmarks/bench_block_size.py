"""The page-size tradeoff, the cost side: what a block size costs per decode step, and what it
gives back in prefix reuse, on our own pool and kernels (the memory side, utilization per block
size, is ``bench_memory.py``; this script reads its result when there is one, both traces).

Block sizes 1, 8, 16, 24, 32, 64 tokens. For each:

- ``attention``: one decode step's paged attention over SmolLM2-135M's 30 layers (9 q heads, 3 KV
  heads, head_dim 64, fp32) at batch 32 x context 512: ``plan_attention`` once plus 30
  ``paged_attention`` calls (``bench_kernels.measure``), on the native CPU kernel (the default)
  and on the torch path (``PAGEDKV_NATIVE_CPU=0``, in a child process); median of repetitions.
- ``step``: a real stack (memory service + worker, SmolLM2 fp32, a pool sized for the batch) and
  an engine decoding 32 requests of 480 prompt tokens; per decode step that runs the full batch
  (``bench_overhead.measure``): the step's wall time, the model's forward, the memory service's
  time (every call the engine made), the Step message's bytes (block tables grow as blocks shrink)
  and output tokens/s at batch 32.
- ``prefix reuse``: on the same stack, a request with a 300-token prefix runs, then one with the
  same prefix and another tail: the prompt tokens the second found cached (only whole blocks are
  shared, so a block size that does not divide the prefix leaves its last partial block behind).
- ``throughput under one KV budget``: end to end, both sides at once. ``bench_throughput.py``'s
  trace (32 requests, ShareGPT-like lengths x 0.25, all at t = 0, greedy, ignore_eos) and its
  budget (16 requests of the trace's mean final length, in tokens: the same memory at every block
  size, so ``--num-blocks`` = budget // block size), pagedkv's own policy, prefix caching off:
  output tokens/s, the mean decode batch the pool allowed, and preemptions.

    python benchmarks/bench_block_size.py [--quick] [--sizes 1,8,16,24,32,64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

from bench_overhead import measure as measure_step
from bench_throughput import run_policy
from common import RESULTS, ROOT, Stack, fmt, machine, pyplot, save_plot, table, write_result
from prompts import corpus_ids, trace_prompts

from client.engine.reservation import Paged
from client.params import SamplingParams
from client.request import Request
from pagedkv.model.tokenizer import load_tokenizer

SIZES = (1, 8, 16, 24, 32, 64)
BATCH, CONTEXT, PROMPT_LEN = 32, 512, 480
#: SmolLM2-135M's attention: q heads, KV heads, head_dim, layers.
HQ, HKV, DIM, LAYERS = 9, 3, 64, 30
PREFIX_LEN = 300
#: bench_throughput.py's defaults: requests, length scale, caps, batch cap (its budget: this many
#: requests of the trace's mean final length).
TRACE_REQUESTS, TRACE_SCALE, TRACE_MAX, MAX_NUM_SEQS = 32, 0.25, 128, 16


def attention_ms(block_size: int, reps: int) -> dict:
    """One decode step's attention (plan + every layer) at ``block_size``, on this process's path."""
    import torch
    from bench_kernels import make_batch, measure

    torch.set_num_threads(os.cpu_count() or 1)
    batch = make_batch([1] * BATCH, [CONTEXT] * BATCH, HQ, HKV, DIM, block_size, torch.float32, "cpu")
    row = measure(batch, LAYERS, reps, cuda=False, decode=False)
    return {"step_ms": row["step_ms"], "plan_ms": row["plan_ms"], "kernel": row["kernel"]}


def attention_torch_path(sizes, reps: int) -> dict[int, dict]:
    """:func:`attention_ms` for every size in a child process with the native kernel switched off."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_block_size as b; "
            f"print(json.dumps({{s: b.attention_ms(s, {reps}) for s in {list(sizes)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PAGEDKV_NATIVE_CPU": "0"},
                         capture_output=True, text=True, check=True, cwd=ROOT / "benchmarks")
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def prefix_reuse(stack: Stack, tok, ids: list[int]) -> int:
    """Prompt tokens a second request with the first one's ``PREFIX_LEN``-token prefix found cached."""
    engine = stack.engine(tokenizer=tok)
    try:
        prefix = ids[1000:1000 + PREFIX_LEN]
        for tail in (ids[5000:5020], ids[6000:6020]):
            p = prefix + tail
            req = Request(p, p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            engine.add(req)
            while engine.has_work():
                engine.step()
        return req.num_cached_tokens
    finally:
        engine.close()


def budget_throughput(sizes, tok, requests: int) -> dict[int, dict]:
    """Output tokens/s of pagedkv on bench_throughput's trace with one KV budget (tokens) at every block size."""
    prompts = trace_prompts(tok, "sharegpt", requests, seed=0, scale=TRACE_SCALE, max_prompt=TRACE_MAX,
                            max_output=TRACE_MAX)
    budget = MAX_NUM_SEQS * round(sum(len(p) + o for p, o in prompts) / len(prompts))
    longest = max(len(p) + o for p, o in prompts)
    out = {}
    for s in sizes:
        blocks = max(budget // s, math.ceil(longest / s))
        with Stack(["--num-blocks", str(blocks), "--block-size", str(s), "--no-prefix-caching"], f"tput{s}") as stack:
            summary, _ = run_policy(stack, tok, prompts, Paged(), argparse.Namespace(max_num_seqs=MAX_NUM_SEQS))
        out[s] = {k: summary[k] for k in ("output_tokens_per_s", "mean_batch", "max_batch", "preemptions", "wall_s")}
        out[s] |= {"num_blocks": blocks, "budget_tokens": budget}
        print(
            f"  block {s:>2}: {summary['output_tokens_per_s']:.0f} out tok/s, mean batch {summary['mean_batch']:.1f}, "
            f"{summary['preemptions']} preemptions ({blocks} blocks = {blocks * s} tokens)",
            flush=True,
        )
    return out


def memory_side() -> dict[str, dict[int, float]]:
    """Utilization per dataset and block size from bench_memory's last result ({} when none)."""
    path = RESULTS / "bench_memory.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text()).get("runs", {})
    return {
        ds: {
            int(name.split("-")[1]): row["utilization_avg"]
            for name, row in policies.items()
            if name.startswith("paged-") and isinstance(row, dict)
        }
        for ds, policies in runs.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--steps", type=int, default=None, help="decode steps measured per size (default 12)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    reps, steps = (5, 6) if args.quick else (11, args.steps or 12)

    print("attention kernels ...", flush=True)
    native = {s: attention_ms(s, reps) for s in sizes}
    torch_path = attention_torch_path(sizes, reps)
    tok = load_tokenizer("smollm2")
    ids = corpus_ids(tok)
    runs = {}
    for s in sizes:
        blocks = BATCH * math.ceil((PROMPT_LEN + steps + 32) / s) + math.ceil(2 * (PREFIX_LEN + 20) / s) + 16
        with Stack(["--num-blocks", str(blocks), "--block-size", str(s)], f"bs{s}") as stack:
            # The first requests decode while the rest prefill (1,024 tokens a step): past those steps.
            step = measure_step(
                stack, tok, ids, BATCH, steps, PROMPT_LEN, extra_tokens=math.ceil(BATCH * PROMPT_LEN / 1024) + 4
            )
            reused = prefix_reuse(stack, tok, ids)
        runs[s] = step | {"prefix_reused": reused, "num_blocks": blocks}
        print(
            f"  block {s:>2}: step {1e3 * step['step']:.1f} ms, memory {1e3 * step['memory']:.2f} ms, "
            f"Step {step['step_bytes'] / 1024:.1f} KiB, prefix reused {reused}/{PREFIX_LEN}",
            flush=True,
        )

    print(f"throughput under one KV budget ({TRACE_REQUESTS} requests) ...", flush=True)
    tput = budget_throughput(sizes, tok, TRACE_REQUESTS // 2 if args.quick else TRACE_REQUESTS)
    util = memory_side()
    rows = []
    for s in sizes:
        r = runs[s]
        rows.append(
            [
                s,
                fmt(native[s]["step_ms"]),
                fmt(torch_path[s]["step_ms"]),
                fmt(1e3 * r["step"], ".1f"),
                fmt(1e3 * r["model"], ".1f"),
                fmt(1e3 * r["memory"]),
                fmt(r["step_bytes"] / 1024, ".1f"),
                fmt(BATCH / r["step"], ".0f"),
                f"{r['prefix_reused']}/{PREFIX_LEN}",
                fmt(tput[s]["output_tokens_per_s"], ".0f"),
                fmt(tput[s]["mean_batch"], ".1f"),
                tput[s]["preemptions"],
                *(fmt(100 * util[ds][s], ".1f") if s in util.get(ds, {}) else "-" for ds in ("sharegpt", "alpaca")),
            ]
        )
    table(
        f"Block size: cost per decode step at batch {BATCH} (context ~{PROMPT_LEN + steps // 2}; attention at "
        f"{CONTEXT}) and what it gives back",
        [
            "block",
            "attn native ms",
            "attn torch ms",
            "step ms",
            "model ms",
            "memory ms",
            "Step KiB",
            "out tok/s",
            "prefix reused",
            "budget tok/s",
            "budget batch",
            "preempt",
            "ShareGPT util %",
            "Alpaca util %",
        ],
        rows,
    )
    write_result(
        "bench_block_size",
        {
            "machine": machine(),
            "batch": BATCH,
            "context": CONTEXT,
            "prompt_len": PROMPT_LEN,
            "prefix_len": PREFIX_LEN,
            "steps": steps,
            "attention_native": native,
            "attention_torch": torch_path,
            "runs": runs,
            "budget_throughput": tput,
            "utilization": util,
        },
    )
    plt = pyplot()
    if plt:
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5))
        a.plot(sizes, [native[s]["step_ms"] for s in sizes], "o-", label="attention, native CPU kernel")
        a.plot(sizes, [torch_path[s]["step_ms"] for s in sizes], "o-", label="attention, torch path")
        a.plot(sizes, [1e3 * runs[s]["memory"] for s in sizes], "o-", label="memory service per step")
        a.set_xlabel("block size (tokens)")
        a.set_ylabel("ms per decode step (batch 32)")
        a.set_yscale("log")
        a.set_title("Cost side")
        a.legend(fontsize=8)
        b.plot(
            sizes,
            [100 * runs[s]["prefix_reused"] / PREFIX_LEN for s in sizes],
            "o-",
            label=f"prefix reused (of {PREFIX_LEN} tokens)",
        )
        for ds, label in (("sharegpt", "ShareGPT-like"), ("alpaca", "Alpaca-like")):
            u = util.get(ds, {})
            if u:
                b.plot(
                    [s for s in sizes if s in u],
                    [100 * u[s] for s in sizes if s in u],
                    "o-",
                    label=f"KV utilization, {label} (bench_memory)",
                )
        b.set_xlabel("block size (tokens)")
        b.set_ylabel("%")
        b.set_title("What it gives back")
        b.legend(fontsize=8)
        c.plot(sizes, [tput[s]["output_tokens_per_s"] for s in sizes], "o-", label="output tokens/s")
        c.plot(sizes, [10 * tput[s]["mean_batch"] for s in sizes], "s--", label="mean decode batch x 10")
        c.set_xlabel("block size (tokens)")
        c.set_title(f"End to end, one KV budget ({tput[sizes[0]]['budget_tokens']} tokens)")
        c.legend(fontsize=8)
        save_plot(fig, "bench_block_size")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
