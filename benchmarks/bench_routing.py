"""KV-aware routing vs round-robin over two nodes, on a trace of shared system prompts.

Two nodes on one machine as in tests/system/test_node_transfers.py (a memory service with one
``--transfer-key-file`` and a worker with ``--node-transfers`` each), SmolLM2 in bf16, block size
16, behind one :class:`client.cluster.core.Cluster` (what ``pagedkv serve --node ...`` runs). The trace:
``--systems`` system prompts of ``--system-tokens`` tokens (corpus windows), each followed by a
distinct ``--user-tokens``-token question, ``--requests`` requests in all, greedy, ``ignore_eos``,
``--max-tokens`` each; every request of a run carries one cache salt (tenants opted into sharing;
each run its own, so no run sees another's cache). A run first sends one request per system prompt,
one after the other (a deployment that has served them), then the rest arrive at ``--rate``
requests/s (Poisson, seeded: the same arrival times for every policy), and it waits for all.

Policies, side by side:

- ``kv``: :class:`client.cluster.router.Router`'s cost (blocks to prefill + blocks the node is busy with),
  from the nodes' KV events; a node that lacks a prefix the other caches reads it (prefix pull);
- ``round-robin``: each node in turn, pulls on (what a node lacks it may still read from the other);
- ``kv, no pulls`` and ``round-robin, no pulls``: the same two, every miss computed on the node it
  lands on (routing alone, as a KV router in front of nodes that cannot share KV).

Columns: output tokens/s over the timed part (wall; bounded by the arrival rate), the timed
requests' time to first token (median, p90); the prompt tokens served from a node's own
prefix cache (GetStats prefix_cache_hits over prefix_cache_queries, both nodes), the tokens read
from the other node, and what was left to compute; requests per node; requests routed to a node
that held part of their prefix.

    python benchmarks/bench_routing.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time
from pathlib import Path

from common import Stack, machine, median, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from client.cluster.core import Cluster, NodeSpec
from client.params import SamplingParams
from client.services import MemoryClient
from pagedkv.model.tokenizer import load_tokenizer

BS = 16
POLICIES = [("kv", "kv", True), ("round-robin", "round-robin", True), ("kv, no pulls", "kv", False),
            ("round-robin, no pulls", "round-robin", False)]


def trace(ids: list[int], systems: int, system_tokens: int, user_tokens: int, requests: int, seed: int = 0):
    """(system prompt index, prompt) per request: one per system prompt first, then the rest shuffled,
    each with its own question."""
    rng = random.Random(seed)
    starts = rng.sample(range(len(ids) - system_tokens), systems)
    heads = [ids[s:s + system_tokens] for s in starts]
    out = []
    for i in range(requests):
        q = rng.randrange(len(ids) - user_tokens)
        out.append((i % systems, heads[i % systems] + ids[q:q + user_tokens]))
    rest = out[systems:]
    rng.shuffle(rest)  # arrivals in no pattern a round-robin could line up with by chance
    return out[:systems] + rest


def counters(stacks: list[Stack]) -> tuple[int, int]:
    """(prefix_cache_hits, prefix_cache_queries) summed over the nodes, tokens."""
    hits = queries = 0
    for s in stacks:
        m = MemoryClient(s.memory_address)
        try:
            st = m.stats()
            hits, queries = hits + st.prefix_cache_hits, queries + st.prefix_cache_queries
        finally:
            m.close()
    return hits, queries


def run(stacks: list[Stack], label: str, routing: str, pulls: bool, reqs, params: SamplingParams, systems: int,
        rate: float) -> dict:
    specs = [NodeSpec(n, s.memory_address, s.worker_addresses) for n, s in zip("ab", stacks)]
    salt = f"run-{label}"
    with Cluster(specs, routing=routing, pulls=pulls) as cluster:
        for i in range(systems):  # one request per system prompt: the deployment has served them
            cluster.submit(next(p for k, p in reqs if k == i), params, cache_salt=salt).result()
        time.sleep(0.5)  # the KV events of those reach the router
        engines = [n.client.engine for n in cluster.nodes.values()]
        pulled0 = sum(e.pulls.tokens_pulled if e.pulls else 0 for e in engines)
        hits0, queries0 = counters(stacks)
        cluster.router.routed.clear()
        cluster.router.prefix_hits.clear()
        gaps = random.Random(1).expovariate
        t = time.perf_counter()
        handles = []
        for _, p in reqs[systems:]:
            handles.append(cluster.submit(p, params, cache_salt=salt))
            time.sleep(gaps(rate))
        outs = [h.result() for h in handles]
        wall = time.perf_counter() - t
        hits1, queries1 = counters(stacks)
        pulled = sum(e.pulls.tokens_pulled if e.pulls else 0 for e in engines) - pulled0
        prompt_tokens = sum(len(p) for _, p in reqs[systems:])
        row = {"policy": label, "requests": len(outs), "wall_s": wall,
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "prompt_tokens": prompt_tokens,
               "own_cache_tokens": hits1 - hits0, "lookup_tokens": queries1 - queries0, "pulled_tokens": pulled,
               "routed": dict(cluster.router.routed), "routed_to_prefix": sum(cluster.router.prefix_hits.values())}
    row["computed_tokens"] = prompt_tokens - row["own_cache_tokens"] - pulled
    ttfts = sorted(o.metrics["ttft"] for o in outs)
    row["ttft_median_s"], row["ttft_p90_s"] = median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))]
    row["output_tok_s"] = row["output_tokens"] / wall
    print(f"  {label}: {row['output_tok_s']:.1f} tok/s, own cache {row['own_cache_tokens']}, pulled {pulled}, "
          f"routed {row['routed']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (~1 min)")
    ap.add_argument("--systems", type=int, default=None, help="default 16 (quick 4)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s after the first per system prompt")
    ap.add_argument("--system-tokens", type=int, default=None, help="default 512 (quick 256)")
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--requests", type=int, default=None, help="default 64 (quick 16)")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    system_tokens = args.system_tokens or (256 if args.quick else 512)
    requests = args.requests or (16 if args.quick else 64)
    systems = args.systems or (4 if args.quick else 16)
    ids = corpus_ids(load_tokenizer("smollm2"))
    reqs = trace(ids, systems, system_tokens, args.user_tokens, requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result = {"machine": machine(), "config": {
        "model": "smollm2", "dtype": "bfloat16", "block_size": BS, "systems": systems, "rate": args.rate,
        "system_tokens": system_tokens, "user_tokens": args.user_tokens, "requests": requests,
        "max_tokens": args.max_tokens, "quick": args.quick}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-routing-") as tmp, contextlib.ExitStack() as es:
        key = Path(tmp) / "transfer.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        stacks = []
        for name in "ab":
            s = Stack(["--kv-cache-memory", "1GiB", "--block-size", str(BS), "--kv-cache-dtype", "bfloat16",
                       "--transfer-key-file", str(key), "--node-name", name], f"routing-{name}")
            s.worker_args = ["--node-transfers"]
            stacks.append(es.enter_context(s))
        for label, routing, pulls in POLICIES:
            result["runs"].append(run(stacks, label, routing, pulls, reqs, params, systems, args.rate))
    rows = result["runs"]
    table(
        f"KV-aware routing vs round-robin, 2 nodes, {requests - systems} timed requests at {args.rate}/s ({systems} "
        f"system prompts x {system_tokens} tokens + {args.user_tokens}, {args.max_tokens} out)",
        [
            "policy",
            "out tok/s",
            "TTFT p50 ms",
            "p90 ms",
            "own cache",
            "pulled",
            "computed",
            "prompt tokens",
            "per node",
            "to prefix",
        ],
        [
            [
                r["policy"],
                f"{r['output_tok_s']:.1f}",
                f"{1e3 * r['ttft_median_s']:.0f}",
                f"{1e3 * r['ttft_p90_s']:.0f}",
                f"{r['own_cache_tokens']} ({r['own_cache_tokens'] / r['prompt_tokens']:.0%})",
                r["pulled_tokens"],
                r["computed_tokens"],
                r["prompt_tokens"],
                "/".join(str(v) for v in r["routed"].values()),
                r["routed_to_prefix"],
            ]
            for r in rows
        ],
    )
    write_result("bench_routing", result)
    plt = pyplot()
    if plt is not None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["policy"] for r in rows]
        ax1.bar(names, [r["output_tok_s"] for r in rows])
        ax1.set(ylabel="output tokens/s", title="throughput")
        bottom = [0] * len(rows)
        for key, label in (
            ("own_cache_tokens", "own prefix cache"),
            ("pulled_tokens", "read from the other node"),
            ("computed_tokens", "computed"),
        ):
            vals = [r[key] for r in rows]
            ax2.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set(ylabel="prompt tokens", title="where the prompt tokens came from")
        ax2.legend(fontsize=8)
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", labelsize=8)
        save_plot(fig, "bench_routing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
