"""The host tier behind the pool: multi-turn chat TTFT with the tier off and on, and swap against
recompute preemption at block sizes 8-64 (the vLLM paper's Fig. 19).

Part 1, multi-turn chat. ``--conversations`` conversations of ``--turns`` turns each; every turn
re-sends the conversation's whole history (previous prompts and answers) plus a new user message
of ``--turn-tokens`` tokens and generates ``--answer-tokens`` tokens greedily (ignore_eos). Turns
run round by round (turn 1 of every conversation, then turn 2, ...), so between two turns of a
conversation the others pass through the device. Each request is sent when the one before it
finished (``--concurrency`` 1: a closed loop, as a user waits for the answer), so its TTFT is its
own prefill (with what the cache saves), not time queued behind other requests' decoding; a
higher concurrency runs that many requests at once. The device pool holds about a quarter of the
final working set (every conversation's history); three runs of the same trace:

- ``tier off``: that pool, no host tier (an evicted history is recomputed);
- ``tier on``: that pool and a host tier holding the whole working set (an evicted history is
  offloaded, and reloaded at the next turn);
- ``large pool``: one device pool as large as both tiers together, no host tier. On CPU both tiers
  are host memory, so this row shows what the tier costs against plain capacity; on a GPU node
  the tier's true gain is device memory it does not need (scripts/gpu_check.py).

TTFT (arrival to first token) over turns 2 and later (turn 1 is cold in every run): mean, p50,
p99; output tokens / s; prompt tokens computed (the workers' step tokens) and reloaded blocks.

Part 2, swap vs recompute. ``--swap-requests`` requests of ``--swap-prompt`` prompt tokens and
``--swap-output`` output tokens in a pool too small for all of them at full length, with prefix
caching off (so recompute recomputes), preemption by recompute vs by swap (a host tier large
enough for every request), at block sizes 8, 16, 32, 64: wall time, preemptions and swaps.

    python benchmarks/bench_tiers.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from common import Stack, machine, pct, pyplot, run_engine, save_plot, table, write_result
from prompts import corpus_ids

from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from memory_service.layout import make_layout
from pagedkv.model.tokenizer import load_tokenizer


def block_nbytes(block_size: int, dtype: str = "float32") -> int:
    """Bytes of one block of SmolLM2's KV (every layer, K and V)."""
    return make_layout("smollm2", block_size=block_size, dtype=dtype, num_blocks=1).block_nbytes


def chat(stack: Stack, tok, ids: list[int], args) -> dict:
    """Run the multi-turn trace on ``stack``; TTFTs by turn and counters."""
    engine = stack.engine(SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=512), tok)
    try:
        histories = [[] for _ in range(args.conversations)]
        ttfts: dict[int, list[float]] = {}
        out_tokens, wall = 0, 0.0
        computed = 0
        before = engine.memory.stats()
        for turn in range(args.turns):
            reqs = []
            for c, hist in enumerate(histories):
                at = (7919 * (c * args.turns + turn + 1)) % (len(ids) - args.turn_tokens)
                prompt = hist + ids[at:at + args.turn_tokens]
                reqs.append(Request(prompt, prompt, SamplingParams(
                    max_tokens=args.answer_tokens, temperature=0, ignore_eos=True), request_id=f"c{c}t{turn}"))
            for at in range(0, len(reqs), args.concurrency):
                group = reqs[at:at + args.concurrency]
                for r in group:
                    r.metrics.arrival = time.time()
                engine.traces.clear()
                wall += run_engine(engine, group)
                computed += sum(t.num_tokens for t in engine.traces)
            for c, r in enumerate(reqs):
                assert r.error is None, r.error
                histories[c] = list(r.prompt_token_ids) + list(r.seqs[0].generated)
                out_tokens += len(r.seqs[0].generated)
            ttfts[turn] = [r.metrics.ttft for r in reqs]
        after = engine.memory.stats()
    finally:
        engine.close()
    later = [t for turn in range(1, args.turns) for t in ttfts[turn]]
    return {"ttft_mean_s": sum(later) / len(later), "ttft_p50_s": pct(later, 0.5), "ttft_p99_s": pct(later, 0.99),
            "ttft_by_turn_s": {t: sum(v) / len(v) for t, v in ttfts.items()}, "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall, "tokens_computed": computed,
            "reloads": after.reloads - before.reloads, "offloads": after.offloads - before.offloads,
            "host_cache_hits": after.host_cache_hits - before.host_cache_hits,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "final_history_tokens": max(len(h) for h in histories)}


def swap_run(stack: Stack, tok, ids: list[int], mode: str, args) -> dict:
    engine = stack.engine(SchedulerConfig(max_num_seqs=args.swap_requests, max_num_batched_tokens=512,
                                          preemption_mode=mode), tok)
    try:
        prompts = [ids[997 * i:997 * i + args.swap_prompt] for i in range(args.swap_requests)]
        reqs = [Request(p, p, SamplingParams(max_tokens=args.swap_output, temperature=0, ignore_eos=True),
                        request_id=f"s{i}") for i, p in enumerate(prompts)]
        before = engine.memory.stats()
        wall = run_engine(engine, reqs)
        after = engine.memory.stats()
        for r in reqs:
            assert r.error is None, r.error
        return {"wall_s": wall, "output_tokens_per_s": sum(len(r.seqs[0].generated) for r in reqs) / wall,
                "preemptions": engine.preemptions, "swap_fallbacks": engine.swap_fallbacks, "steps": engine.step_count,
                "model_s": sum(t.model_seconds for t in engine.traces), "swap_outs": after.swap_outs - before.swap_outs,
                "swap_ins": after.swap_ins - before.swap_ins, "reloads": after.reloads - before.reloads,
                "outputs": [list(r.seqs[0].generated) for r in reqs]}
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer conversations and turns, two block sizes")
    ap.add_argument("--conversations", type=int, default=None, help="conversations (default 8; quick 6)")
    ap.add_argument("--turns", type=int, default=None, help="turns per conversation (default 4; quick 3)")
    ap.add_argument("--turn-tokens", type=int, default=96, help="new user tokens per turn (default 96)")
    ap.add_argument("--answer-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="chat requests sent at once, each group after the last finished (default 1)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--swap-requests", type=int, default=6)
    ap.add_argument("--swap-prompt", type=int, default=160)
    ap.add_argument("--swap-output", type=int, default=96)
    ap.add_argument("--block-sizes", default=None,
                    help="swap vs recompute block sizes (default 8,16,32,64; quick 16,32)")
    ap.add_argument("--skip-swap", action="store_true", help="only the multi-turn chat")
    ap.add_argument("--skip-chat", action="store_true", help="only swap vs recompute")
    args = ap.parse_args()
    args.conversations = args.conversations or (6 if args.quick else 8)
    args.turns = args.turns or (3 if args.quick else 4)
    sizes = [int(b) for b in (args.block_sizes or ("16,32" if args.quick else "8,16,32,64")).split(",")]
    tok = load_tokenizer("smollm2")
    ids = corpus_ids(tok)
    bs = args.block_size
    final = args.turns * (args.turn_tokens + args.answer_tokens)
    working_set = args.conversations * -(-final // bs)  # blocks of every final history
    device = max(working_set // 4, args.concurrency * -(-(final + bs) // bs))
    host = working_set + device
    nbytes = block_nbytes(bs)
    result = {"machine": machine(), "config": {**vars(args), "device_blocks": device, "host_blocks": host,
                                               "working_set_blocks": working_set, "block_nbytes": nbytes}, "chat": {}}
    print(f"working set {working_set} blocks; device pool {device}; host tier {host} ({host * nbytes / 2**20:.0f} MiB)",
          flush=True)
    runs = {"tier off": ["--num-blocks", str(device)],
            "tier on": ["--num-blocks", str(device), "--host-cache-memory", str(host * nbytes)],
            "large pool": ["--num-blocks", str(device + host)]}
    for name, mem in ({} if args.skip_chat else runs).items():
        with Stack([*mem, "--block-size", str(bs)], "tiers") as stack:
            r = result["chat"][name] = chat(stack, tok, ids, args)
        print(f"  {name:<10} TTFT mean {r['ttft_mean_s']:.3f} s  computed {r['tokens_computed']} tokens  "
              f"reloads {r['reloads']}", flush=True)
    if result["chat"]:
        off = result["chat"]["tier off"]["ttft_mean_s"]
        rows = [
            [
                name,
                f"{r['ttft_mean_s']:.3f}",
                f"{r['ttft_p50_s']:.3f}",
                f"{r['ttft_p99_s']:.3f}",
                f"{r['output_tokens_per_s']:.1f}",
                r["tokens_computed"],
                r["reloads"],
                f"{off / r['ttft_mean_s']:.2f}x",
            ]
            for name, r in result["chat"].items()
        ]
        table(
            f"Multi-turn chat: {args.conversations} conversations x {args.turns} turns (+{args.turn_tokens} user, "
            f"{args.answer_tokens} answer tokens), {args.concurrency} at a time, device pool {device} blocks, "
            f"working set {working_set}; TTFT over turns >= 2",
            ["run", "TTFT mean s", "p50 s", "p99 s", "out tok/s", "tokens computed", "reloads", "TTFT vs off"],
            rows,
        )
        result["ttft_gain_tier_on"] = off / result["chat"]["tier on"]["ttft_mean_s"]

    if not args.skip_swap:
        result["swap"] = {}
        total = args.swap_requests * (args.swap_prompt + args.swap_output)
        for b in sizes:
            dev = -(-total // b) * 5 // 8  # about 5/8 of what every request needs at full length
            host_bytes = (-(-total // b) + 8) * block_nbytes(b)
            mem = [
                "--num-blocks",
                str(dev),
                "--block-size",
                str(b),
                "--no-prefix-caching",
                "--host-cache-memory",
                str(host_bytes),
            ]
            with Stack(mem, "swap") as stack:
                for mode in ("recompute", "swap"):
                    r = result["swap"][f"{b}/{mode}"] = swap_run(stack, tok, ids, mode, args)
                    print(
                        f"  block {b:>2} {mode:<9} {r['wall_s']:.2f} s (model {r['model_s']:.2f} s, {r['steps']} "
                        f"steps)  preemptions {r['preemptions']}  swaps {r['swap_outs']}",
                        flush=True,
                    )
            same = result["swap"][f"{b}/recompute"].pop("outputs") == result["swap"][f"{b}/swap"].pop("outputs")
            result["swap"][f"{b}/swap"]["outputs_equal_recompute"] = same
        rows = []
        for b in sizes:
            rc, sw = result["swap"][f"{b}/recompute"], result["swap"][f"{b}/swap"]
            rows.append(
                [
                    b,
                    f"{rc['wall_s']:.2f}",
                    rc["preemptions"],
                    f"{sw['wall_s']:.2f}",
                    sw["preemptions"],
                    sw["swap_outs"],
                    f"{rc['wall_s'] / sw['wall_s']:.2f}x",
                    sw["outputs_equal_recompute"],
                ]
            )
        table(
            f"Swap vs recompute: {args.swap_requests} requests x ({args.swap_prompt} prompt + {args.swap_output} "
            "output tokens) in ~5/8 of the blocks they need, prefix caching off",
            ["block", "recompute s", "preempt", "swap s", "preempt", "swap-outs", "swap speedup", "same output"],
            rows,
        )
    write_result("bench_tiers", result)
    plt = pyplot()
    if plt is not None:
        panels = [p for p in ("chat", "swap") if result.get(p)]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
        if "chat" in panels:
            ax = axes[0][0]
            names = list(result["chat"])
            ax.bar(names, [result["chat"][n]["ttft_mean_s"] for n in names], color=["#999", "#2a7", "#47c"])
            ax.set_ylabel("mean TTFT, turns >= 2 (s)")
            ax.set_title("Multi-turn chat, working set ~4x the device pool")
        if "swap" in panels:
            ax = axes[0][-1]
            ax.plot(sizes, [result["swap"][f"{b}/recompute"]["wall_s"] for b in sizes], "o-", label="recompute")
            ax.plot(sizes, [result["swap"][f"{b}/swap"]["wall_s"] for b in sizes], "s-", label="swap")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.set_xlabel("block size (tokens)")
            ax.set_ylabel("wall time (s)")
            ax.set_ylim(bottom=0)
            ax.set_title("Preemption: swap vs recompute (paper Fig. 19)")
            ax.legend()
        save_plot(fig, "bench_tiers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
