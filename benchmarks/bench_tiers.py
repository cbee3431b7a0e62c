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

Part 3, the disk tier (``--skip-disk`` leaves it out). The same trace, a working set 4x the host
tier (and 8x the device pool): device only, device + host, device + host + disk (a disk tier
larger than the working set). Then a restart of the memory service (SIGTERM) before the last turn:
the TTFT of that turn with the disk tier kept (warm) against an emptied directory (cold), and
the disk's write and read rates for blocks of this size (slab files with checksums, as
benchmarks/bench_disk_io.py measures them).

    python benchmarks/bench_tiers.py [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
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


def chat(stack: Stack, tok, ids: list[int], args, turns: range | None = None, histories: list | None = None) -> dict:
    """Run the multi-turn trace on ``stack`` (``turns`` of it, from ``histories``: the conversations
    so far, extended in place); TTFTs by turn and counters."""
    engine = stack.engine(SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=512), tok)
    turns = range(args.turns) if turns is None else turns
    try:
        histories = [[] for _ in range(args.conversations)] if histories is None else histories
        ttfts: dict[int, list[float]] = {}
        out_tokens, wall = 0, 0.0
        computed = 0
        before = engine.memory.stats()
        for turn in turns:
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
        wait_for_disk_writes(engine.memory)
        after = engine.memory.stats()
    finally:
        engine.close()
    later = [t for turn in turns if turn >= 1 for t in ttfts[turn]] or [t for v in ttfts.values() for t in v]
    return {"ttft_mean_s": sum(later) / len(later), "ttft_p50_s": pct(later, 0.5), "ttft_p99_s": pct(later, 0.99),
            "ttft_by_turn_s": {t: sum(v) / len(v) for t, v in ttfts.items()}, "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall, "tokens_computed": computed,
            "reloads": after.reloads - before.reloads, "offloads": after.offloads - before.offloads,
            "host_cache_hits": after.host_cache_hits - before.host_cache_hits,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "disk_hits": after.disk.hits - before.disk.hits, "disk_writes": after.disk.writes - before.disk.writes,
            "final_history_tokens": max(len(h) for h in histories)}


def wait_for_disk_writes(memory, timeout: float = 60.0) -> None:
    """Until the disk tier's queued writes are done (no host block held for one): what a restart keeps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and memory.stats().host_used_blocks:
        time.sleep(0.05)


def restarted(stack: Stack, wipe: Path | None = None) -> None:
    """Stop the memory service (SIGTERM) and start it again over the same flags (after removing
    ``wipe``, its disk directory, for a cold start); wait for the worker to map the new pool."""
    from client.services import MemoryClient, WorkerClient

    stack.memory.stop()
    if wipe is not None:
        shutil.rmtree(wipe)
    stack.memory = stack.memory.respawn()
    memory, worker = MemoryClient(stack.memory.address), WorkerClient(stack.worker.address)
    try:
        generation = memory.pool().generation
        deadline = time.monotonic() + 120
        while worker.model_info().pool_generation != generation and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        memory.close()
        worker.close()


def disk_part(tok, ids: list[int], args, tmp: Path) -> dict:
    """Part 3: the trace with a working set 4x the host tier, device only / + host / + host + disk;
    then a restart before the last turn, warm (the disk tier kept) against cold (a new directory)."""
    bs, nbytes = args.block_size, block_nbytes(args.block_size)
    final = args.turns * (args.turn_tokens + args.answer_tokens)
    working_set = args.conversations * -(-final // bs)
    device = max(working_set // 8, args.concurrency * -(-(final + bs) // bs))
    host = max(working_set // 4, 1)
    tiers = {"device only": ["--num-blocks", str(device)],
             "device + host": ["--num-blocks", str(device), "--host-cache-memory", str(host * nbytes)]}
    disk_flags = lambda d: [*tiers["device + host"], "--disk-cache-dir", str(d),  # noqa: E731
                            "--disk-cache-size", str(4 * working_set * (nbytes + 8192))]
    tiers["device + host + disk"] = disk_flags(tmp / "disk")
    out: dict = {"config": {"device_blocks": device, "host_blocks": host, "working_set_blocks": working_set}}
    for name, mem in tiers.items():
        with Stack([*mem, "--block-size", str(bs)], "disk") as stack:
            out[name] = chat(stack, tok, ids, args)
        print(f"  {name:<22} TTFT mean {out[name]['ttft_mean_s']:.3f} s  p99 {out[name]['ttft_p99_s']:.3f} s  "
              f"computed {out[name]['tokens_computed']}  disk hits {out[name]['disk_hits']}", flush=True)
    half = args.turns - 1  # the restart comes before the last turn
    for i, (name, cold) in enumerate((("warm restart (disk kept)", False), ("cold restart (new disk)", True))):
        folder = tmp / f"restart{i}"
        with Stack([*disk_flags(folder), "--block-size", str(bs)], "restart") as stack:
            histories = [[] for _ in range(args.conversations)]
            chat(stack, tok, ids, args, range(half), histories)
            restarted(stack, wipe=folder if cold else None)
            r = out[name] = chat(stack, tok, ids, args, range(half, half + 1), histories)
        print(f"  {name:<24} TTFT of turn {half + 1}: {r['ttft_mean_s']:.3f} s  computed {r['tokens_computed']}  "
              f"disk hits {r['disk_hits']}", flush=True)
    out["restart_gain"] = out["cold restart (new disk)"]["ttft_mean_s"] / out["warm restart (disk kept)"]["ttft_mean_s"]
    # The disk's own rates for blocks of this size (bench_disk_io's slab files, buffered, with checksums).
    from bench_disk_io import slab

    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(64)]
    (tmp / "io").mkdir()
    w, r, _, _ = slab(tmp / "io", blocks, False)
    out["disk_write_gbs"], out["disk_read_gbs"] = 64 * nbytes / w / 1e9, 64 * nbytes / r / 1e9
    return out


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
    ap.add_argument("--skip-disk", action="store_true", help="without the disk tier's part")
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
    if not args.skip_disk:
        with tempfile.TemporaryDirectory(prefix="pagedkv-bench-disk-") as tmp:
            d = result["disk"] = disk_part(tok, ids, args, Path(tmp))
        cfg = d["config"]
        names = ["device only", "device + host", "device + host + disk"]
        table(f"Multi-turn chat with a disk tier: working set {cfg['working_set_blocks']} blocks, host tier "
              f"{cfg['host_blocks']} (1/4 of it), device pool {cfg['device_blocks']}; TTFT over turns >= 2",
              ["run", "TTFT mean s", "p99 s", "tokens computed", "disk hits (tokens)", "disk writes"],
              [[n, f"{d[n]['ttft_mean_s']:.3f}", f"{d[n]['ttft_p99_s']:.3f}", d[n]["tokens_computed"],
                d[n]["disk_hits"], d[n]["disk_writes"]] for n in names])
        half = args.turns - 1  # the restart comes before the last turn
        table(f"After a memory-service restart (SIGTERM) at turn {half + 1}: its TTFT, warm (the disk tier kept) vs "
              f"cold (an empty directory); disk {d['disk_write_gbs']:.2f} GB/s write, {d['disk_read_gbs']:.2f} GB/s "
              "read",
              ["run", "TTFT mean s", "tokens computed", "disk hits (tokens)", "cold / warm"],
              [[n, f"{d[n]['ttft_mean_s']:.3f}", d[n]["tokens_computed"], d[n]["disk_hits"],
                f"{d['restart_gain']:.2f}x" if n.startswith("warm") else ""]
               for n in ("warm restart (disk kept)", "cold restart (new disk)")])
    write_result("bench_tiers", result)
    plt = pyplot()
    if plt is not None:
        panels = [p for p in ("chat", "swap", "disk") if result.get(p)]
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
        if "disk" in panels:
            ax = axes[0][panels.index("disk")]
            d = result["disk"]
            names = ["device only", "device + host", "device + host + disk", "warm restart (disk kept)",
                     "cold restart (new disk)"]
            ax.bar(range(len(names)), [d[n]["ttft_mean_s"] for n in names], color=["#999", "#2a7", "#47c", "#c72",
                                                                                   "#777"])
            ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
            ax.set_ylabel("mean TTFT (s)")
            ax.set_title("Disk tier: working set 4x the host tier; a restart")
        save_plot(fig, "bench_tiers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
