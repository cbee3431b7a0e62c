"""Shared-prefix throughput with automatic prefix caching on and off (the vLLM paper, §6.4 / Fig. 16).

``--num-requests`` requests (24; 8 with ``--quick``) share a few-shot prefix, short (~100 tokens)
or long (~800 tokens), each followed by a different question (~24 tokens) and generating
``--max-tokens`` (16) tokens greedily with ignore_eos. The same engine, scheduler and worker run
against a memory service with prefix caching (the default) and one started with
``--no-prefix-caching``.

Before the timed requests, one untimed request with the same prefix runs on both services (the
"system prompt already served" state of a running deployment): without it, every request
admitted in the first step would miss, since a block enters the cache only once its KV is
written. Throughput = timed requests / wall seconds. The cache hit rate is GetStats
prefix_cache_hits / prefix_cache_queries (tokens) over the timed requests. Beside the paper's
figures for LLaMA-13B translation with a 1-shot (80-token) and 5-shot (341-token) prefix: 1.67x
and 3.58x.

    python benchmarks/bench_prefix.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from common import Stack, machine, median, pyplot, run_engine, save_plot, table, write_result
from prompts import corpus_ids

from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from pagedkv.model.tokenizer import load_tokenizer

PAPER = {"short": 1.67, "long": 3.58}


def make_requests(ids: list[int], prefix_len: int, n: int, question_len: int, max_tokens: int, offset: int):
    prefix = ids[offset:offset + prefix_len]
    out = []
    for i in range(n + 1):  # the first one warms the cache
        q0 = (offset + prefix_len + 97 * (i + 1)) % (len(ids) - question_len)
        p = prefix + ids[q0:q0 + question_len]
        out.append(Request(p, p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    return out


def run(stack: Stack, tok, ids, prefix_len: int, args) -> dict:
    engine = stack.engine(SchedulerConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=512), tok)
    try:
        warm, *reqs = make_requests(ids, prefix_len, args.num_requests, 24, args.max_tokens, 50 + prefix_len)
        run_engine(engine, [warm])
        engine.traces.clear()
        before = engine.memory.stats()
        for r in reqs:  # arrival = now, not when the list was built
            r.metrics.arrival = time.time()
        wall = run_engine(engine, reqs)
        after = engine.memory.stats()
        for r in reqs:
            assert r.error is None, r.error
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        return {"wall_s": wall, "requests_per_s": len(reqs) / wall,
                "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
                "computed_tokens": sum(t.num_tokens for t in engine.traces),
                "ttft_median_s": median([r.metrics.ttft for r in reqs]),
                "hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries,
                "prefix_caching": after.prefix_caching}
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 requests")
    ap.add_argument("--num-requests", type=int, default=None, help="timed requests per run (default 24; quick 8)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--short", type=int, default=100, help="short prefix tokens")
    ap.add_argument("--long", type=int, default=800, help="long prefix tokens")
    args = ap.parse_args()
    args.num_requests = args.num_requests or (8 if args.quick else 24)
    tok = load_tokenizer("smollm2")
    ids = corpus_ids(tok)
    num_blocks = -(-(args.num_requests + 2) * (args.long + 24 + args.max_tokens) // 16) + 64
    result = {"machine": machine(), "config": {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
                                               "question_tokens": 24, "block_size": 16, "num_blocks": num_blocks},
              "runs": {}, "paper_speedup": PAPER}
    for caching in (True, False):
        mem_args = ["--num-blocks", str(num_blocks), "--block-size",
                    "16"] + ([] if caching else ["--no-prefix-caching"])
        with Stack(mem_args, "prefix") as stack:
            for name, plen in (("short", args.short), ("long", args.long)):
                r = run(stack, tok, ids, plen, args)
                r["prefix_tokens"] = plen
                result["runs"][f"{name}/{'on' if caching else 'off'}"] = r
                print(f"  {name:<5} prefix {plen:>4}  caching {'on ' if caching else 'off'}  "
                      f"{r['requests_per_s']:.2f} req/s  hit rate {100 * r['hit_rate']:.1f}%", flush=True)
    rows = []
    speedups = {}
    for name in ("short", "long"):
        on, off = result["runs"][f"{name}/on"], result["runs"][f"{name}/off"]
        speedups[name] = on["requests_per_s"] / off["requests_per_s"]
        for tag, r in (("off", off), ("on", on)):
            rows.append([name, r["prefix_tokens"], tag, f"{r['requests_per_s']:.3f}", f"{r['ttft_median_s']:.2f}",
                         f"{100 * r['hit_rate']:.1f}", f"{r['wall_s']:.1f}",
                         f"{speedups[name]:.2f}x" if tag == "on" else "", f"{PAPER[name]}x" if tag == "on" else ""])
    table(f"Shared prefix, {args.num_requests} requests x (prefix + 24 question tokens), {args.max_tokens} new tokens",
          ["prefix", "tokens", "caching", "req/s", "TTFT p50 s", "hit %", "wall s", "speedup", "paper"], rows)
    result["speedup"] = speedups
    write_result("bench_prefix", result)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = range(2)
        ax.bar([x - 0.2 for x in xs], [result["runs"][f"{n}/off"]["requests_per_s"] for n in ("short", "long")],
               width=0.4, label="prefix caching off")
        ax.bar([x + 0.2 for x in xs], [result["runs"][f"{n}/on"]["requests_per_s"] for n in ("short", "long")],
               width=0.4, label="prefix caching on")
        ax.set_xticks(list(xs), [f"short ({args.short})", f"long ({args.long})"])
        ax.set_ylabel("requests / s")
        ax.set_title("Shared few-shot prefix")
        ax.legend()
        save_plot(fig, "bench_prefix")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
