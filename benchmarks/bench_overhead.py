"""Where a decode step's time goes outside the model: services, RPC, serialization, scheduling.

At batch 1, 8, 32 and 64 (decode steady state, context ~128 tokens: 120-token prompts, the steps
measured after every request has finished its prefill), each engine step is split into:

- ``model``: the worker's forward (StepResponse.model_seconds, attention included);
- ``worker other``: the rest of the worker's handler (StepResponse.step_seconds - model_seconds:
  decoding the request, block tables, sampling, encoding the response);
- ``step RPC``: the Step call's wall time seen by the client minus the worker's step_seconds
  (gRPC transport and (de)serialization on both sides);
- ``memory``: wall time of every memory-service call the engine made in the step (MemoryClient
  methods wrapped with timers: AppendSlots, AllocateSequences, FreeSequences, GetStats,
  CommitComputedTokens, ForkSequences);
- ``client``: the rest of Engine.step (scheduling, building the request, updating requests).

The overhead share is 1 - model / step. Median over the measured steps. One memory service and
one worker on loopback, block size 16, SmolLM2-135M fp32 on CPU.

    python benchmarks/bench_overhead.py [--quick] [--steps 16]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

from common import Stack, machine, median, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from pagedkv.model.tokenizer import load_tokenizer

MEMORY_CALLS = ("append", "allocate", "free", "stats", "commit", "fork", "sequences")
PARTS = ("model", "worker_other", "step_rpc", "memory", "client")


class Timers:
    """Per-step accumulators filled by wrapped client methods."""

    def __init__(self):
        self.memory = 0.0
        self.memory_calls = collections.Counter()
        self.step_wall = 0.0
        self.worker_step = 0.0
        self.worker_model = 0.0
        self.step_bytes = 0  # serialized StepRequest bytes sent to the worker

    def reset(self):
        self.__init__()


def instrument(engine, timers: Timers) -> None:
    for name in MEMORY_CALLS:
        fn = getattr(engine.memory, name)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                timers.memory += time.perf_counter() - t
                timers.memory_calls[_name] += 1

        setattr(engine.memory, name, timed)
    worker = engine.workers[0]
    step = worker.step

    def timed_step(request):
        timers.step_bytes += request.ByteSize()
        t = time.perf_counter()
        resp = step(request)
        timers.step_wall += time.perf_counter() - t
        timers.worker_step += resp.step_seconds
        timers.worker_model += resp.model_seconds
        return resp

    worker.step = timed_step


def measure(stack: Stack, tok, ids: list[int], batch: int, steps: int, prompt_len: int, extra_tokens: int = 4) -> dict:
    """Decode ``batch`` requests of ``prompt_len`` tokens; the breakdown of up to ``steps`` steps that
    decode the whole batch. Each request generates ``steps + extra_tokens`` tokens: ``extra_tokens``
    must cover the steps it decodes while later requests still prefill."""
    engine = stack.engine(SchedulerConfig(max_num_seqs=max(64, batch), max_num_batched_tokens=1024), tok)
    timers = Timers()
    instrument(engine, timers)
    try:
        for i in range(batch):
            start = (i * 37) % (len(ids) - prompt_len)
            p = ids[start:start + prompt_len]
            engine.add(Request(p, p, SamplingParams(max_tokens=steps + extra_tokens, temperature=0, ignore_eos=True)))
        rows = []
        while engine.has_work():
            timers.reset()
            engine.step()
            t = engine.traces[-1] if engine.traces else None
            if t is None or t.num_tokens != batch or len(t.request_ids) != batch or t.finished:
                continue  # prefill, or a step where requests finish
            rows.append({"step": t.step_seconds, "model": t.model_seconds,
                         "worker_other": timers.worker_step - timers.worker_model,
                         "step_rpc": timers.step_wall - timers.worker_step, "memory": timers.memory,
                         "client": t.step_seconds - timers.step_wall - timers.memory,
                         "memory_calls": sum(timers.memory_calls.values()), "step_bytes": timers.step_bytes})
            if len(rows) >= steps:
                break
    finally:
        engine.close()
    out = {k: median([r[k] for r in rows]) for k in ("step", *PARTS, "memory_calls", "step_bytes")}
    out["overhead_share"] = 1 - out["model"] / out["step"]
    out["overhead_share_per_step_median"] = median([1 - r["model"] / r["step"] for r in rows])
    out["steps_measured"] = len(rows)
    out["batch"] = batch
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 measured steps per batch size")
    ap.add_argument("--steps", type=int, default=None, help="decode steps measured per batch size (default 16)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=120)
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 16)
    tok = load_tokenizer("smollm2")
    ids = corpus_ids(tok)
    result = {"machine": machine(), "config": {"steps": steps, "prompt_len": args.prompt_len, "block_size": 16},
              "runs": []}
    with Stack(["--num-blocks", "1024", "--block-size", "16"], "overhead") as stack:
        for b in (int(x) for x in args.batches.split(",")):
            r = measure(stack, tok, ids, b, steps, args.prompt_len)
            result["runs"].append(r)
            print(f"  batch {b:>3}: step {1e3 * r['step']:.1f} ms, outside the model {100 * r['overhead_share']:.1f}%",
                  flush=True)
    rows = []
    for r in result["runs"]:
        rows.append([r["batch"], r["steps_measured"], f"{1e3 * r['step']:.1f}", *(f"{1e3 * r[k]:.2f}" for k in PARTS),
                     f"{r['memory_calls']:.0f}", f"{100 * r['overhead_share']:.1f}"])
    table(f"Decode step breakdown, context ~{args.prompt_len + steps // 2} tokens, milliseconds (median over the steps "
          f"measured: up to {steps} that decode the full batch and finish nobody)",
          ["batch", "steps", "step", "model", "worker other", "step RPC", "memory", "client", "mem calls",
           "outside model %"], rows)
    write_result("bench_overhead", result)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = [str(r["batch"]) for r in result["runs"]]
        bottom = [0.0] * len(labels)
        for k in PARTS:
            vals = [100 * r[k] / r["step"] for r in result["runs"]]
            ax.bar(labels, vals, bottom=bottom, label=k)
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.set_xlabel("batch (decode)")
        ax.set_ylabel("% of step time (medians)")
        ax.set_title("Decode step time by part")
        ax.legend(fontsize=8)
        save_plot(fig, "bench_overhead")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
