"""Node transfers on one machine: NIXL read throughput, and time to first token pulling a cached
prefix from another node vs computing it (docs/design-notes.md, "Nodes"). SmolLM2, block size 16.

Part 1, throughput. A spawned process holds a pool of SmolLM2's layout (``[blocks, 30, 2, 16, 3,
64]``: 368,640 bytes a block in bf16, 737,280 in fp32) registered with NIXL as a worker's
:class:`TransferAgent` registers it; this process reads N blocks (1, 8, 64, 256) with
``TransferAgent.read_blocks``: ``contig`` ids (one descriptor) and ``scatter`` ids (even source
blocks into odd local ones, shuffled: N descriptors). Beside them ``raw NIXL``, a plain
``nixl_agent`` reading the same bytes as one descriptor, busy-polling (the gap is our layer's cost),
and ``memcpy`` of the same bytes inside this process. Medians of one call, connected beforehand;
GB/s = 10^9 bytes / s. Twice: ``progress thr on`` as shipped (NIXL's progress thread in every
agent, pausing ``transfer_agent.PROGRESS_DELAY_US`` between rounds) and ``off`` (the source then
progresses NIXL every 1 ms, which UCX's set-up needs).

Part 2, TTFT. Two nodes as in tests/system/test_node_transfers.py (two memory services with one
``--transfer-key-file`` and their own ``--node-name``, a worker each with ``--node-transfers``). Per
prefix length P, a fresh corpus window of P tokens + 8 is computed on node A (which caches its P/16
full blocks); then node B (``Client(B, peers=[A])``, ``max_num_batched_tokens`` 512) gets that prefix
with another 8-token suffix, max_tokens 1: ``pull`` reads P tokens from A and computes 8;
``recompute`` is the same prompt under a cache salt of its own (B computes P + 8). A new window per
repetition, so B never holds the prefix itself; B's pull threshold is 1 block, to measure below the
default (``client.engine.transfers.DEFAULT_MIN_BLOCKS``, 2). TTFT: the client's arrival to first token,
medians (the two orders alternate); ``fwd``: of it, the worker's forward. ``plain``: one node started
without ``--node-transfers`` (no NIXL agent anywhere), a fresh prompt (computed) then its prefix with
another suffix (``plain hit``: the node's own cache, the floor a pull can approach). The crossover
is the shortest P from which pulling wins at every longer P.

What it showed (2-core VM, 2026-12-02; docs/benchmarks.md section 11): the first run found NIXL's
progress thread polling without pause (a core busy in every worker with ``--node-transfers``,
forwards 1.7-4x slower); with ``TransferAgent``'s pause a pull of 16-1536 tokens costs 43-76 ms of
TTFT in bf16 (a node's own cache hit: 30-57 ms) and beats recomputing from the first block (1.1x)
to 14.3x (bf16) and 21.2x (fp32) at 1536 tokens; against a node without NIXL at all, from 4 blocks
(bf16) and 1 (fp32). The progress thread still halves the throughput of large reads (2.35 vs 4.17
GB/s at 256 blocks, bf16). DEFAULT_MIN_BLOCKS = 2 stays.

    python benchmarks/bench_nodes.py [--quick] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import Stack, machine, median, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from client.api import Client
from client.engine.transfers import DEFAULT_MIN_BLOCKS
from client.params import SamplingParams
from compute_service.transfer_agent import TransferAgent, TransferSource
from memory_service.layout import make_layout
from pagedkv.model.tokenizer import load_tokenizer

BS = 16
SUFFIX = 8
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    """``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of SmolLM2's pool."""
    lay = make_layout("smollm2", block_size=BS, dtype="float32", num_blocks=num_blocks)
    return (num_blocks, lay.num_layers, 2, BS, lay.num_kv_heads, lay.head_dim)


# ------------------------------------------------------------ part 1: NIXL reads
@contextlib.contextmanager
def progress_thread(on: bool):
    """NIXL agents made inside get ``enable_prog_thread=on`` (TransferAgent leaves NIXL's default, on)."""
    from nixl_cu12 import _api

    made = _api.nixl_agent_config
    if not on:
        _api.nixl_agent_config = functools.partial(made, enable_prog_thread=False)
    try:
        yield
    finally:
        _api.nixl_agent_config = made


def _source_node(conn, dtype: str, num_blocks: int, progress: bool) -> None:
    """The source process: its pool registered with a NIXL agent until the parent says stop."""
    from nixl_cu12 import _api

    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL's own handler prints INFO on stdout
    pool = torch.ones(pool_shape(num_blocks), dtype=DTYPES[dtype])
    agent = _api.nixl_agent(f"bench-source-{dtype}", _api.nixl_agent_config(enable_prog_thread=progress))
    nbytes = pool.numel() * pool.element_size()
    reg = agent.register_memory([(pool.data_ptr(), nbytes, 0, "")], "DRAM")
    conn.send(TransferSource(agent.name, agent.get_agent_metadata(), pool.data_ptr(), num_blocks, nbytes // num_blocks))
    while not conn.poll(0.1 if progress else 1e-3):
        if not progress:
            agent.get_new_notifs()  # progresses UCX: answers a reader's connection set-up
    agent.deregister_memory(reg)


@contextlib.contextmanager
def source_node(dtype: str, num_blocks: int, progress: bool):
    """A spawned source process; yields its TransferSource, stops it on exit (killed if stuck)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_source_node, args=(child, dtype, num_blocks, progress), daemon=True)
    proc.start()
    child.close()
    try:
        if not conn.poll(120):
            raise RuntimeError("the source process did not start within 120 s")
        yield conn.recv()
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


class RawReader:
    """``nixl_agent`` used directly: one registered buffer, one descriptor per read, busy polling."""

    def __init__(self, nbytes: int, source: TransferSource):
        from nixl_cu12 import _api  # imported (its logs routed) by TransferAgent

        self.buf, self.source = torch.zeros(nbytes, dtype=torch.uint8), source
        self.agent = _api.nixl_agent("bench-raw", _api.nixl_agent_config(backends=["UCX"]))
        self.reg = self.agent.register_memory([(self.buf.data_ptr(), nbytes, 0, "")], "DRAM")
        peer = self.agent.add_remote_agent(source.agent_metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer

    def read(self, nbytes: int) -> None:
        """The source's first ``nbytes`` bytes into the buffer's first ``nbytes``."""
        descs = [self.agent.get_xfer_descs(np.array([[addr, nbytes, 0]], dtype=np.uint64), "DRAM")
                 for addr in (self.buf.data_ptr(), self.source.base_address)]
        handle = self.agent.initialize_xfer("READ", *descs, self.peer)
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended in state {state}")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


def timed(reps: int, fn, *args) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return median(out)


def throughput(dtype: str, progress: bool, sizes: list[int], reps: int) -> list[dict]:
    """Part 1 for one dtype, NIXL progress threads on or off in every agent: a row per block count."""
    num_blocks, rng = 2 * max(sizes), random.Random(0)
    with source_node(dtype, num_blocks, progress) as source, progress_thread(progress):
        pool = torch.zeros(pool_shape(num_blocks), dtype=DTYPES[dtype])
        agent = TransferAgent(f"bench-reader-{dtype}", pool)
        raw = RawReader(max(sizes) * agent.block_bytes, source)
        try:
            agent.read_blocks(source, [(0, 0)])  # connect
            raw.read(agent.block_bytes)
            flat, rows = pool.view(-1).view(torch.uint8), []
            for n in sizes:
                nbytes = n * agent.block_bytes
                evens, odds = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
                rng.shuffle(evens)
                rng.shuffle(odds)
                t = {"contiguous": timed(reps, agent.read_blocks, source, [(i, i) for i in range(n)]),
                     "scattered": timed(reps, agent.read_blocks, source, list(zip(evens, odds))),
                     "raw_nixl": timed(reps, raw.read, nbytes),
                     "memcpy": timed(reps, torch.Tensor.copy_, raw.buf[:nbytes], flat[:nbytes])}
                rows.append({"progress_thread": progress, "blocks": n, "bytes": nbytes,
                             **{f"{k}_s": v for k, v in t.items()},
                             **{f"{k}_gbps": nbytes / v / 1e9 for k, v in t.items()},
                             **{f"{k}_us_per_block": 1e6 * v / n for k, v in t.items()}})
            return rows
        finally:
            raw.close()
            agent.close()


# ------------------------------------------------------ part 2: TTFT, pull vs compute
class Windows:
    """:meth:`prefix`: a fresh corpus window per call (distinct starts: no two share a block);
    :meth:`suffix`: :data:`SUFFIX` tokens from anywhere."""

    def __init__(self, ids: list[int], longest: int, count: int, seed: int):
        self.ids, self.rng = ids, random.Random(seed)
        self.starts = iter(self.rng.sample(range(len(ids) - longest), count))

    def prefix(self, p: int) -> list[int]:
        o = next(self.starts)
        return self.ids[o:o + p]

    def suffix(self) -> list[int]:
        s = self.rng.randrange(len(self.ids) - SUFFIX)
        return self.ids[s:s + SUFFIX]


def node_stack(name: str, dtype: str, prefixes: list[int], key: Path | None) -> Stack:
    """A node: memory service + one worker; with ``key``, a transfer key and ``--node-transfers``."""
    args = ["--num-blocks", str(2 * (max(prefixes) + SUFFIX) // BS + 256), "--block-size", str(BS), "--kv-cache-dtype",
            dtype]
    node = Stack(args + (["--transfer-key-file", str(key), "--node-name", name] if key else []), f"nodes-{name}")
    node.worker_args = ["--node-transfers"] if key else []
    return node


def ttft_nodes(dtype: str, prefixes: list[int], reps: int, ids: list[int]) -> list[dict]:
    """Part 2 for one dtype on two nodes: a row per prefix length (medians over ``reps``)."""
    windows = Windows(ids, max(prefixes), len(prefixes) * reps + 1, seed=1)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-nodes-") as tmp, contextlib.ExitStack() as stack:
        key = Path(tmp) / "transfer.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        a, b = (stack.enter_context(node_stack(n, dtype, prefixes, key)) for n in ("a", "b"))
        ca = stack.enter_context(Client(a.memory_address, a.worker_addresses))
        cb = stack.enter_context(Client(b.memory_address, b.worker_addresses, peers=[a.memory_address]))
        cb.engine.pulls.min_blocks = 1
        salts = iter(range(10 ** 6))

        def one(p: int, order: int) -> dict:
            prefix = windows.prefix(p)
            ca.generate([prefix + windows.suffix()], ONE_TOKEN)  # A caches the prefix's P / 16 blocks
            prompt, out = prefix + windows.suffix(), {}
            for kind in (("pull", "recompute") if order % 2 == 0 else ("recompute", "pull")):
                before = cb.engine.pulls.tokens_pulled
                cb.engine.traces.clear()  # the engine thread is idle between requests
                (r,) = cb.generate([prompt], ONE_TOKEN, cache_salt=None if kind == "pull" else f"cold-{next(salts)}")
                out[kind] = {"ttft_s": r.metrics["ttft"], "pulled": cb.engine.pulls.tokens_pulled - before,
                             "forward_s": sum(t.model_seconds for t in cb.engine.traces),
                             "cached": r.num_cached_tokens, "token": r.outputs[0].token_ids[0]}
            return out

        one(256, 0)  # warm-up: B connects to A's agent, both models see a long prefill
        rows = []
        for p in prefixes:
            runs = [one(p, i) for i in range(reps)]
            row = {"prefix_tokens": p, "prompt_tokens": p + SUFFIX, "reps": reps,
                   "pulled_tokens": min(r["pull"]["pulled"] for r in runs),
                   "pull_own_cache_tokens": max(r["pull"]["cached"] - r["pull"]["pulled"] for r in runs),
                   "recompute_cached_tokens": max(r["recompute"]["cached"] for r in runs),
                   "same_first_token": sum(r["pull"]["token"] == r["recompute"]["token"] for r in runs)}
            for kind in ("pull", "recompute"):
                row[f"{kind}_ttft_all_s"] = [r[kind]["ttft_s"] for r in runs]
                row[f"{kind}_ttft_s"] = median(row[f"{kind}_ttft_all_s"])
                row[f"{kind}_forward_s"] = median([r[kind]["forward_s"] for r in runs])
            rows.append(row)
            print(f"  {dtype} prefix {p:>5}: pull {1e3 * row['pull_ttft_s']:.1f} ms ({row['pulled_tokens']} "
                  f"tokens), recompute {1e3 * row['recompute_ttft_s']:.1f} ms", flush=True)
        return rows


def ttft_plain(dtype: str, prefixes: list[int], reps: int, ids: list[int]) -> dict[int, tuple[float, float]]:
    """On one node without ``--node-transfers``, median TTFT by prefix length of a fresh prompt
    (computed) and of its prefix again with another suffix (the node's own cache)."""
    windows = Windows(ids, max(prefixes), len(prefixes) * reps + 1, seed=2)
    out = {}
    with node_stack("plain", dtype, prefixes, None) as node, \
            Client(node.memory_address, node.worker_addresses) as client:
        ttft = lambda prompt: client.generate([prompt], ONE_TOKEN)[0].metrics["ttft"]
        ttft(windows.prefix(256) + windows.suffix())  # warm-up
        for p in prefixes:
            runs = []
            for _ in range(reps):
                prefix = windows.prefix(p)
                runs.append([ttft(prefix + windows.suffix()) for _ in range(2)])
            out[p] = (median([r[0] for r in runs]), median([r[1] for r in runs]))
    print(f"  {dtype} plain node, computed / own cache: "
          + ", ".join(f"{p} {1e3 * c:.1f} / {1e3 * h:.1f} ms" for p, (c, h) in out.items()), flush=True)
    return out


def crossover(rows: list[dict], against: str) -> dict:
    """The shortest prefix from which pulling beats ``row[against]`` at every longer prefix measured."""
    at = None
    for row in reversed(rows):
        if row["pull_ttft_s"] >= row[against]:
            break
        at = row["prefix_tokens"]
    if at is None:
        return {"prefix_tokens": None, "blocks": None, "note": f"pulling never won up to {rows[-1]['prefix_tokens']}"}
    lowest = ", the shortest measured" if at == rows[0]["prefix_tokens"] else ""
    return {"prefix_tokens": at, "blocks": at // BS,
            "note": f"pulling wins from {at} tokens ({at // BS} block{'s' * (at > BS)}{lowest}); "
                    f"DEFAULT_MIN_BLOCKS is {DEFAULT_MIN_BLOCKS}"}


def plot(result: dict, dtypes: list[str]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for d in dtypes:
        for r0 in (True, False):
            rows = [r for r in result["throughput"][d] if r["progress_thread"] == r0]
            for key, style in (("contiguous", "o-"), ("scattered", "s--"), ("raw_nixl", "^:")):
                ax1.plot([r["blocks"] for r in rows], [r[f"{key}_gbps"] for r in rows], style, alpha=0.4 if r0 else 1,
                         label=f"{key} {d}, progress thread {'on' if r0 else 'off'}")
        rows = result["ttft"][d]
        for key, style, label in (("pull", "o-", "pull from A"), ("recompute", "s--", "recompute on B"),
                                  ("plain", "^:", "computed, node without NIXL"),
                                  ("plain_hit", "v:", "own cache hit, node without NIXL")):
            ax2.plot([r["prefix_tokens"] for r in rows], [1e3 * r[f"{key}_ttft_s"] for r in rows], style,
                     label=f"{label} {d}")
    ax1.set(xscale="log", xlabel="blocks per read", ylabel="GB/s", title="NIXL reads between two processes")
    ax2.set(xscale="log", yscale="log", xlabel="shared prefix tokens", ylabel="TTFT ms (median)",
            title="TTFT on node B: pull vs compute")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    save_plot(fig, "bench_nodes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bf16 only, fewer sizes and repetitions (~1 min)")
    ap.add_argument("--dtypes", default=None, help="comma-separated (default bfloat16,float32; quick bfloat16)")
    args = ap.parse_args()
    dtypes = (args.dtypes or ("bfloat16" if args.quick else "bfloat16,float32")).split(",")
    sizes, reps_io = [1, 8, 64, 256], 5 if args.quick else 20
    prefixes = [32, 128, 512] if args.quick else [16, 32, 64, 128, 256, 512, 1024, 1536]
    reps = 2 if args.quick else 3
    ids = corpus_ids(load_tokenizer("smollm2"))
    result = {"machine": machine(), "config": {
        "model": "smollm2", "block_size": BS, "dtypes": dtypes, "quick": args.quick, "block_counts": sizes,
        "throughput_reps": reps_io, "prefix_tokens": prefixes, "suffix_tokens": SUFFIX, "ttft_reps": reps,
        "max_num_batched_tokens": 512, "default_min_blocks": DEFAULT_MIN_BLOCKS, "pull_min_blocks_used": 1},
        "throughput": {}, "ttft": {}, "crossover": {}}
    for d in dtypes:
        result["throughput"][d] = [r for on in (True, False) for r in throughput(d, on, sizes, reps_io)]
    for d in dtypes:
        rows = result["ttft"][d] = ttft_nodes(d, prefixes, reps, ids)
        plain = ttft_plain(d, prefixes, reps, ids)
        for row in rows:
            row["plain_ttft_s"], row["plain_hit_ttft_s"] = plain[row["prefix_tokens"]]
        result["crossover"][d] = {"as_deployed": crossover(rows, "recompute_ttft_s"),
                                  "vs_node_without_nixl": crossover(rows, "plain_ttft_s")}

    table("Part 1: reading N blocks of another process's pool (median of one call; GB/s and us/block)",
          ["dtype", "progress thr", "blocks", "MB", "contig GB/s", "us/blk", "scatter GB/s", "us/blk",
           "raw NIXL GB/s", "contig/raw", "memcpy GB/s"],
          [[d, "on" if r["progress_thread"] else "off", r["blocks"], f"{r['bytes'] / 1e6:.2f}",
            f"{r['contiguous_gbps']:.2f}", f"{r['contiguous_us_per_block']:.0f}", f"{r['scattered_gbps']:.2f}",
            f"{r['scattered_us_per_block']:.0f}", f"{r['raw_nixl_gbps']:.2f}",
            f"{r['contiguous_gbps'] / r['raw_nixl_gbps']:.2f}", f"{r['memcpy_gbps']:.2f}"]
           for d in dtypes for r in result["throughput"][d]])
    ms = lambda s: f"{1e3 * s:.1f}"
    table(f"Part 2: TTFT on node B (ms, median of {reps}; fwd: of it in the worker's forward), prefix pulled "
          f"from node A vs computed (+{SUFFIX} tokens); plain: a node without --node-transfers, computed / own cache",
          ["dtype", "prefix", "pulled", "pull", "fwd", "recompute", "fwd", "speedup", "plain", "plain/pull",
           "plain hit", "same token"],
          [[d, r["prefix_tokens"], r["pulled_tokens"], ms(r["pull_ttft_s"]), ms(r["pull_forward_s"]),
            ms(r["recompute_ttft_s"]), ms(r["recompute_forward_s"]), f"{r['recompute_ttft_s'] / r['pull_ttft_s']:.2f}x",
            ms(r["plain_ttft_s"]), f"{r['plain_ttft_s'] / r['pull_ttft_s']:.2f}x", ms(r["plain_hit_ttft_s"]),
            f"{r['same_first_token']}/{r['reps']}"] for d in dtypes for r in result["ttft"][d]])
    for d in dtypes:
        c = result["crossover"][d]
        print(f"crossover {d}, as deployed (B recomputes): {c['as_deployed']['note']}")
        print(f"crossover {d}, against a node without NIXL: {c['vs_node_without_nixl']['note']}")
        print(f"  suggests min_blocks {c['as_deployed']['blocks']} (against recompute on the same nodes), "
              f"{c['vs_node_without_nixl']['blocks']} (against a node without NIXL); "
              f"DEFAULT_MIN_BLOCKS is {DEFAULT_MIN_BLOCKS}")
    write_result("bench_nodes", result)
    plot(result, dtypes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
