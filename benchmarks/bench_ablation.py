"""What each speed change bought: the compute worker's model step, variant by variant, side by side.

A *variant* is a checkout of this repository (a commit; default the working tree), a dtype (pool
and model) and environment switches (``PAGEDKV_PACKED_LINEAR=0``: projections through
``F.linear``; ``PAGEDKV_NATIVE_CPU=0``: attention and cache writes on the torch path;
``PAGEDKV_CPU_LINEAR=off``: projections through oneDNN's matmul, not kernels.cpu.packed_linear;
``PAGEDKV_FUSED_DECODE=0``: decode steps op by op, not kernels.cpu.layers). Each variant
runs in a process of its own, started from its checkout (``git worktree add --detach`` into a
temporary folder for a commit), which loads SmolLM2-135M-Instruct, maps nothing (a private pool
tensor in the variant's dtype) and, per case, builds the step the worker would build
(``compute_service.step_inputs.build_step_inputs`` from a ``StepRequest``), then times
``model(*inputs.model_args(pool))`` plus greedy sampling: the worker's step without gRPC and
grant checks (benchmarks/bench_worker.py measures those).

Cases: single-stream decode (batch 1, context 256), batched decode (batch 32, context 256) and a
prefill step (2 prompts of 256 tokens). The variants run in rounds, one case each in turn, so the
machine's drift weighs on all alike; medians over rounds.

    python benchmarks/bench_ablation.py                       # the default ladder at the working tree
    python benchmarks/bench_ablation.py --variant "before=d1392cf:float32" \\
        --variant "bf16 packed=HEAD:bfloat16" --variant "no native=HEAD:bfloat16:PAGEDKV_NATIVE_CPU=0"

``--variant LABEL=COMMIT:DTYPE[:ENV=VALUE,...]`` (COMMIT ``.`` is the working tree). Prints one table
(ms per step and tokens/s per case), writes benchmarks/results/bench_ablation.json and .png.
``--breakdown`` adds where each case's time goes inside the model (projections, attention, norms,
the fused layers, sampling, the rest); ``--services`` adds, per working-tree variant, a served
decode step's time outside the model at batch 1 and 32 (worker handler, Step RPC, memory service,
scheduling: benchmarks/bench_overhead.py's split, on a stack started in the variant's dtype and switches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [("decode b1", 1, 256, 1), ("decode b32", 32, 256, 1), ("prefill 2x256", 2, 0, 256)]
DEFAULT_VARIANTS = [
    "fp32, F.linear, torch attention=.:float32:PAGEDKV_PACKED_LINEAR=0,PAGEDKV_NATIVE_CPU=0",
    "fp32, packed, native=.:float32",
    "bf16, F.linear, torch attention=.:bfloat16:PAGEDKV_PACKED_LINEAR=0,PAGEDKV_NATIVE_CPU=0",
    "bf16, packed, torch attention=.:bfloat16:PAGEDKV_NATIVE_CPU=0",
    "bf16, packed, native, oneDNN decode matmul=.:bfloat16:PAGEDKV_CPU_LINEAR=off",
    "bf16, packed, native, native projections=.:bfloat16:PAGEDKV_FUSED_DECODE=0",
    "bf16, native projections, fused decode layers=.:bfloat16",
]


#: Where a step's time goes: wall seconds inside modules of these classes (the model runs
#: synchronously on the CPU, so a module's wall time is its cost); the rest is "other" (RoPE,
#: residual adds, SwiGLU's activation, embedding, sampling).
BREAKDOWN = {"Linear": "projections", "PagedAttention": "attention + cache write", "RMSNorm": "norms"}
#: A decode step whose layers ran as one native call (compute_service.model.fused_decode) spends them here.
FUSED = "fused decode layers"
#: The sampler (compute_service.sampling.sample), timed around its call.
SAMPLING = "sampling"
#: Outside the model (``--services``: benchmarks/bench_overhead.measure on a stack of the variant), ms per
#: step: the worker's handler less its forward and sampler, the Step call's transport, the memory
#: service's calls, and the engine's scheduling and bookkeeping.
OUTSIDE = {"worker_other": "worker handler", "step_rpc": "Step RPC", "memory": "memory service",
           "client": "scheduling"}
SERVICE_BATCHES = (1, 32)


def _clock(model) -> dict[str, float]:
    """Hook every module whose class is in BREAKDOWN; returns the dict its seconds are summed into."""
    spent = dict.fromkeys(BREAKDOWN.values(), 0.0)
    started: dict[int, float] = {}

    def enter(module, args):
        started[id(module)] = time.perf_counter()

    def leave(module, args, out):
        spent[BREAKDOWN[type(module).__name__]] += time.perf_counter() - started.pop(id(module))

    for module in model.modules():
        if type(module).__name__ in BREAKDOWN:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
    fused = getattr(model, "fused_decode", None)
    if fused is not None:  # a decode step's layers in one native call: no module hooks inside
        spent[FUSED] = 0.0
        run = fused.run

        def timed(*args):
            t = time.perf_counter()
            try:
                return run(*args)
            finally:
                spent[FUSED] += time.perf_counter() - t

        fused.run = timed
    return spent


def child(dtype_name: str, breakdown: bool) -> None:
    """Run in a variant's checkout: load, then for each line `CASE REPS` on stdin print JSON timings
    (with `breakdown`, also the seconds per BREAKDOWN category, summed over the reps)."""
    sys.path[:0] = [str(Path.cwd() / "protos"), str(Path.cwd())]
    import torch

    from compute_service.model.llama import LlamaForPagedLM
    from compute_service.sampling import sample
    from compute_service.step_inputs import build_step_inputs
    from compute_service.weights.source import load_model_source
    from pagedkv.compute.v1 import compute_service_pb2 as pb

    dtype = getattr(torch, dtype_name)
    config, weights = load_model_source("smollm2")
    model = LlamaForPagedLM(config, weights, dtype=dtype)
    del weights
    block_size, num_blocks = 16, 32 * (256 // 16 + 2) + 8
    pool = torch.zeros(num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype)
    gen = torch.Generator().manual_seed(0)

    def request(batch: int, ctx: int, new: int) -> pb.StepRequest:
        seqs = []
        per = -(-(ctx + new) // block_size)
        for b in range(batch):
            ids = torch.randint(0, config.vocab_size, (new,), generator=gen).tolist()
            seqs.append(pb.StepSequence(
                seq_id=b, token_ids=ids, positions=list(range(ctx, ctx + new)),
                block_ids=list(range(b * per, (b + 1) * per)), sampling=pb.SamplingParams(temperature=0.0)))
        return pb.StepRequest(sequences=seqs)

    spent = _clock(model) if breakdown else {}
    if breakdown:
        spent[SAMPLING] = 0.0
    steps = {}
    for name, batch, ctx, new in CASES:
        req = request(batch, ctx, new)
        steps[name] = (req, build_step_inputs(req, block_size=block_size, num_blocks=num_blocks,
                                              vocab_size=config.vocab_size, device=torch.device("cpu")))

    def run(name: str) -> float:
        req, inputs = steps[name]
        t = time.perf_counter()
        logits = model(*inputs.model_args(pool))
        s = time.perf_counter()
        sample(logits, inputs.sampling, [0] * len(inputs.sample_rows))
        end = time.perf_counter()
        if breakdown:
            spent[SAMPLING] += end - s
        return end - t

    for name in steps:  # warm up (oneDNN's kernels are made on a shape's first call)
        run(name), run(name)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        name, reps = line.rsplit(" ", 1)
        for k in spent:
            spent[k] = 0.0
        seconds = [run(name) for _ in range(int(reps))]
        print(json.dumps({"seconds": seconds, "spent": spent}), flush=True)


class Variant:
    def __init__(self, spec: str, tmp: Path, breakdown: bool) -> None:
        self.label, rest = spec.split("=", 1)
        parts = rest.split(":", 2)
        self.commit, self.dtype = parts[0], parts[1]
        self.env = dict(kv.split("=", 1) for kv in parts[2].split(",")) if len(parts) > 2 and parts[2] else {}
        self.tree = ROOT
        if self.commit != ".":
            sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", self.commit], text=True).strip()
            self.commit = sha[:10]
            self.tree = tmp / sha[:10]
            if not self.tree.exists():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(self.tree), sha],
                               check=True)
        env = {**os.environ, **self.env, "PYTHONPATH": f"{self.tree / 'protos'}:{self.tree}"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
               self.dtype] + (["--breakdown"] if breakdown else [])
        self.proc = subprocess.Popen(cmd,
                                     cwd=self.tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.times: dict[str, list[float]] = {name: [] for name, *_ in CASES}
        self.spent: dict[str, dict[str, float]] = {name: {} for name, *_ in CASES}

    def ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"variant {self.label!r} failed to start")
        self.threads = json.loads(line)["threads"]

    def run(self, name: str, reps: int) -> None:
        self.proc.stdin.write(f"{name} {reps}\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        self.times[name] += reply["seconds"]
        for k, v in reply["spent"].items():
            self.spent[name][k] = self.spent[name].get(k, 0.0) + v

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def outside(variants: list[Variant], result: dict) -> None:
    """Per working-tree variant: a memory service and a worker in the variant's dtype and switches,
    and benchmarks/bench_overhead.measure at each of SERVICE_BATCHES (decode, context ~124); prints
    the step split in OUTSIDE's parts beside the model's forward, and adds it to ``result``."""
    from bench_overhead import measure
    from common import Stack, fmt, table
    from prompts import corpus_ids

    from pagedkv.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    ids = corpus_ids(tok)
    rows = []
    for v, rec in zip(variants, result["variants"]):
        if v.tree != ROOT:
            print(f"  {v.label}: a commit's stack is not started here; --services measures working-tree variants")
            continue
        with Stack(["--num-blocks", "1024", "--block-size", "16", "--kv-cache-dtype", v.dtype], "ablation",
                   worker_args=["--dtype", v.dtype], env=v.env) as stack:
            for batch in SERVICE_BATCHES:
                r = measure(stack, tok, ids, batch, 8, 120)
                rec[f"services b{batch}"] = r
                rows.append([v.label, batch, fmt(1e3 * r["step"], ".1f"), fmt(1e3 * r["model"], ".1f")]
                            + [f"{fmt(1e3 * r[k], '.2f')} ({r[k] / r['step']:.0%})" for k in OUTSIDE])
    table("a served decode step outside the model (ms per step, medians; benchmarks/bench_overhead.py's split)",
          ["variant", "batch", "step", "model"] + list(OUTSIDE.values()), rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="LABEL=COMMIT:DTYPE[:ENV=VALUE,...] (repeat)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--result-name", default="bench_ablation")
    ap.add_argument("--breakdown", action="store_true",
                    help="also where each case's time goes (projections, attention, norms, sampling, other), "
                         "ms per step")
    ap.add_argument("--services", action="store_true",
                    help="also, per working-tree variant, the time outside the model at decode batch 1 and 32 "
                         "(worker handler, Step RPC, memory service, scheduling) on a stack of that variant")
    ap.add_argument("--child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.breakdown)
        return 0
    from common import fmt, machine, pyplot, save_plot, table, write_result

    specs = args.variant or DEFAULT_VARIANTS
    reps = {"decode b1": 5, "decode b32": 3, "prefill 2x256": 1}
    with tempfile.TemporaryDirectory(prefix="pagedkv-ablation-") as tmp:
        variants = [Variant(s, Path(tmp), args.breakdown) for s in specs]
        try:
            for v in variants:
                v.ready()
            for _ in range(args.rounds):
                for name, *_ in CASES:
                    for v in variants:
                        v.run(name, reps[name])
        finally:
            for v in variants:
                v.close()
            for v in variants:
                if v.tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(v.tree)], check=False)
    rows, result = [], {"machine": machine(), "cases": CASES, "variants": []}
    for v in variants:
        rec = {"label": v.label, "commit": v.commit, "dtype": v.dtype, "env": v.env, "threads": v.threads}
        row = [v.label, v.commit, v.dtype]
        for name, batch, _ctx, new in CASES:
            ms = statistics.median(v.times[name]) * 1e3
            tok_s = batch * new / ms * 1e3
            rec[name] = {"ms": ms, "tok_s": tok_s, "samples": len(v.times[name])}
            row += [fmt(ms, ".1f"), fmt(tok_s, ".0f")]
        rows.append(row)
        result["variants"].append(rec)
    header = ["variant", "commit", "dtype"] + [f"{n} {u}" for n, *_ in CASES for u in ("ms", "tok/s")]
    table("model step per variant (medians over rounds)", header, rows)
    if args.breakdown:
        cats = list(BREAKDOWN.values()) + [FUSED, SAMPLING, "other"]
        rows = []
        for v, rec in zip(variants, result["variants"]):
            for name, *_ in CASES:
                n = len(v.times[name])
                total = sum(v.times[name]) / n * 1e3
                ms = {k: s / n * 1e3 for k, s in v.spent[name].items()}
                ms.setdefault(FUSED, 0.0)
                ms.setdefault(SAMPLING, 0.0)
                ms["other"] = total - sum(ms.values())
                rec[name]["breakdown_ms"] = ms
                rows.append([v.label, name,
                             fmt(total, ".1f")] + [f"{fmt(ms[k], '.1f')} ({ms[k] / total:.0%})" for k in cats])
        table("where a step's time goes (ms per step, mean over rounds; hooks on the modules)",
              ["variant", "case", "total"] + cats, rows)
    if args.services:
        outside(variants, result)
    write_result(args.result_name, result)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(CASES), figsize=(5 * len(CASES), 0.5 * len(variants) + 2))
        for ax, (name, *_) in zip(axes, CASES):
            ax.barh([v["label"] for v in result["variants"]], [v[name]["tok_s"] for v in result["variants"]])
            ax.set_title(f"{name} (tokens/s)")
            ax.invert_yaxis()
        for ax in axes[1:]:
            ax.set_yticklabels([])
        save_plot(fig, args.result_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
