"""KV-cache memory utilization: paged blocks vs contiguous reservation (the vLLM paper, Fig. 2 / §6.2).

A synthetic request trace (fixed seed) is replayed against a REAL memory-service process per
configuration, with no model: a request allocates its prompt at admission, then every step each
running request appends one token (one batched AppendSlots for all of them), and it is freed when
its output length is reached. All policies get the same KV budget in tokens:

- ``paged-B``: pagedkv blocks of B tokens (B = 1, 8, 16, 24, 32, 64), allocated on demand; when an
  append finds no block, the most recently admitted request is preempted (recompute: freed,
  requeued at the front with its length so far);
- ``orca-max``: a contiguous reservation of the max sequence length (2048) at admission;
- ``orca-pow2``: the true final length rounded up to a power of two;
- ``orca-oracle``: the true final length.

The reserving policies use block size 1 (the reservation is exact) and never append. Admission
is FCFS while allocation succeeds (OUT_OF_BLOCKS: the head waits), with at most
``--max-num-seqs`` running (256, vLLM's default) for every policy.

Trace: prompt/output lengths log-normal (sigma 0.8 of the log) with the paper's dataset means
(ShareGPT 161 / 338 tokens, Alpaca 19 / 58), prompt <= 1024, total <= 2048; Poisson arrivals at
``--overload`` (1.5) times the rate an ideally packed pool could serve
(budget / (E[prompt] + E[output] / 2) / E[output] requests per step), so the pool is the
bottleneck. Every policy replays the same trace for the same number of steps.

Measured per step, over the steps where a request was waiting (the pool, or the seq cap, was
the bottleneck): real token states (sum of current lengths) vs reserved memory (used_blocks *
block_size from GetStats). The gap splits into internal fragmentation (paged: slack in the last
block), reserved-for-later (slots reserved for tokens the request will still write) and
over-reservation (slots it never writes: reservation - final length). The pool hands out
scattered blocks, so the reserving policies see no external fragmentation here: their waste is a
lower bound of what a contiguous allocator would have.

Goals (issue 7): ShareGPT-like utilization >= 96% at block size 16 (Alpaca-like beside it), and
>= 2x the largest concurrent batch of orca-max.

    python benchmarks/bench_memory.py [--quick] [--budget 16384] [--steps 1500]
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import (  # noqa: F401
    DATASETS,
    SIGMA,
    Service,
    fmt,
    lengths,
    machine,
    pyplot,
    save_plot,
    table,
    write_result,
)

from client.engine.reservation import OrcaMax, OrcaOracle, OrcaPow2, Paged, ReservationPolicy
from client.errors import OutOfBlocks
from client.services import MemoryClient

POLICIES = [("paged-1", Paged(), 1), ("paged-8", Paged(), 8), ("paged-16", Paged(), 16), ("paged-24", Paged(), 24),
            ("paged-32", Paged(), 32), ("paged-64", Paged(), 64),
            ("orca-max", OrcaMax(2048), 1), ("orca-pow2", OrcaPow2(), 1), ("orca-oracle", OrcaOracle(), 1)]


@dataclass(slots=True, eq=False)
class Live:
    """A request in the replay."""

    arrival: int
    prompt_len: int
    final_len: int  # prompt + output tokens
    length: int = 0  # tokens held now (0 while waiting)
    seq_id: int | None = None
    reserved: int = 0  # tokens reserved (reserving policies)


def make_trace(dataset: str, steps: int, budget: int, overload: float, seed: int) -> list[tuple[int, int, int]]:
    """``(arrival_step, prompt_len, output_len)`` with Poisson arrivals over ``steps`` steps."""
    p_mean, o_mean = DATASETS[dataset]
    rate = overload * budget / (p_mean + o_mean / 2) / o_mean
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= steps:
            return out
        (p, o), = lengths(dataset, 1, rng)
        out.append((int(t), p, o))


def replay(address: str, policy: ReservationPolicy, block_size: int, trace, steps: int, max_num_seqs: int) -> dict:
    """Replay ``trace`` for ``steps`` steps on the memory service at ``address``; per-step samples."""
    mem = MemoryClient(address)
    lease = mem.create_lease(600).lease_id
    paged = isinstance(policy, Paged)
    reqs = [Live(a, p, p + o) for a, p, o in trace]
    pending = collections.deque(reqs)  # not yet arrived
    waiting: collections.deque[Live] = collections.deque()
    running: list[Live] = []
    samples = []
    preemptions = finished = 0
    rpc_seconds = 0.0
    for step in range(steps):
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        t0 = time.perf_counter()
        # 1. free requests that reached their final length
        done = [r for r in running if r.length >= r.final_len]
        if done:
            mem.free(lease, [r.seq_id for r in done])
            finished += len(done)
            running = [r for r in running if r.length < r.final_len]
        # 2. one token for every running request (paged: one batched AppendSlots)
        if paged:
            while running:
                try:
                    mem.append(lease, [(r.seq_id, 1) for r in running])
                    break
                except OutOfBlocks:  # preempt the most recently admitted (recompute)
                    victim = running.pop()
                    mem.free(lease, [victim.seq_id])
                    victim.seq_id = None
                    waiting.appendleft(victim)
                    preemptions += 1
        for r in running:
            r.length += 1
        # 3. admit FCFS while allocation succeeds
        stats = mem.stats()
        free_blocks = stats.available_blocks
        admit = []
        for r in waiting:
            if len(running) + len(admit) >= max_num_seqs:
                break
            want = max(r.length, r.prompt_len)
            reserve = policy.reserve(r.prompt_len, r.final_len - r.prompt_len)
            tokens = want if reserve is None else reserve
            need = -(-tokens // block_size)
            if need > free_blocks:
                break
            free_blocks -= need
            admit.append((r, want, tokens))
        tables = []
        while admit:
            try:
                tables = mem.allocate(lease, [t for _, _, t in admit]).sequences
                break
            except OutOfBlocks:
                admit.pop()
        for (r, want, tokens), t in zip(admit, tables):
            waiting.popleft()
            r.seq_id, r.length, r.reserved = t.seq_id, want, tokens
            running.append(r)
        # 4. measure
        stats = mem.stats()
        rpc_seconds += time.perf_counter() - t0
        real = sum(r.length for r in running)
        reserved = stats.used_blocks * stats.block_size
        if paged:
            slack, later, never = reserved - real, 0, 0
        else:
            slack = 0
            later = sum(r.final_len - r.length for r in running)
            never = sum(r.reserved - r.final_len for r in running)
            assert reserved == real + later + never, (reserved, real, later, never)
        samples.append({"step": step, "waiting": len(waiting), "running": len(running), "real": real,
                        "reserved": reserved, "slack": slack, "later": later, "never": never})
    if running:
        mem.free(lease, [r.seq_id for r in running])
    mem.release_lease(lease)
    mem.close()
    return {"samples": samples, "preemptions": preemptions, "finished": finished, "rpc_seconds": rpc_seconds}


def summarize(run: dict, budget: int) -> dict:
    sat = [s for s in run["samples"] if s["waiting"] > 0 and s["reserved"] > 0]
    if not sat:
        sat = [s for s in run["samples"] if s["reserved"] > 0]
    tot = sum(s["reserved"] for s in sat)
    util = [s["real"] / s["reserved"] for s in sat]
    return {
        "saturated_steps": len(sat),
        "utilization_avg": sum(s["real"] for s in sat) / tot,  # time-averaged share of reserved KV holding tokens
        "utilization_min": min(util),
        "utilization_peak": max(util),
        "internal_fragmentation": sum(s["slack"] for s in sat) / tot,
        "reserved_for_later": sum(s["later"] for s in sat) / tot,
        "over_reservation": sum(s["never"] for s in sat) / tot,
        "pool_occupancy_avg": tot / len(sat) / budget,
        "peak_real_tokens": max(s["real"] for s in run["samples"]),
        "max_batch": max(s["running"] for s in run["samples"]),
        "mean_batch": sum(s["running"] for s in sat) / len(sat),
        "finished": run["finished"],
        "preemptions": run["preemptions"],
        "ms_per_step": 1e3 * run["rpc_seconds"] / len(run["samples"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="600 steps instead of 1500")
    ap.add_argument("--budget", type=int, default=16384, help="KV budget in token slots (default 16384)")
    ap.add_argument("--steps", type=int, default=None, help="steps replayed per policy (default 1500)")
    ap.add_argument("--overload", type=float, default=1.5, help="arrival rate / ideal service rate (default 1.5)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="running-request cap for every policy (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datasets", default="sharegpt,alpaca")
    args = ap.parse_args()
    steps = args.steps or (600 if args.quick else 1500)
    result = {"machine": machine(), "config": {"budget_tokens": args.budget, "steps": steps, "overload": args.overload,
                                               "max_num_seqs": args.max_num_seqs, "seed": args.seed, "sigma": SIGMA,
                                               "max_seq_len": 2048, "dataset_means": DATASETS}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in args.datasets.split(","):
            trace = make_trace(dataset, steps, args.budget, args.overload, args.seed)
            result["runs"][dataset] = {"num_requests": len(trace)}
            for name, policy, bs in POLICIES:
                svc = Service(["memory", "--num-blocks", str(args.budget // bs), "--block-size", str(bs),
                               "--kv-cache-dtype", "float16", "--no-prefix-caching", "--lease-ttl", "600"],
                              f"{dataset}-{name}", Path(tmp))
                try:
                    run = replay(svc.address, policy, bs, trace, steps, args.max_num_seqs)
                finally:
                    svc.stop()
                s = summarize(run, args.budget)
                s["series"] = {k: [x[k] for x in run["samples"]] for k in ("running", "real", "reserved")}
                result["runs"][dataset][name] = s
                print(f"  {dataset:<9} {name:<12} util {s['utilization_avg']:.3f}  max batch {s['max_batch']:>4}  "
                      f"({s['ms_per_step']:.2f} ms/step)", flush=True)

    for dataset, runs in result["runs"].items():
        base = runs["orca-max"]["max_batch"]
        rows = []
        for name, _, _ in POLICIES:
            s = runs[name]
            rows.append([name, f"{100 * s['utilization_avg']:.1f}", f"{100 * s['utilization_peak']:.1f}",
                         f"{100 * s['internal_fragmentation']:.1f}", f"{100 * s['reserved_for_later']:.1f}",
                         f"{100 * s['over_reservation']:.1f}", f"{100 * s['pool_occupancy_avg']:.1f}",
                         f"{s['mean_batch']:.1f}", s["max_batch"], f"{s['max_batch'] / base:.2f}x", s["finished"],
                         s["preemptions"]])
        table(f"{dataset}-like trace: {runs['num_requests']} requests over {steps} steps, budget {args.budget} "
              f"tokens (% of reserved KV, averaged over saturated steps)",
              ["policy", "util%", "peak%", "int.frag%", "resv.later%", "over-resv%", "pool%", "mean batch",
               "max batch", "vs max", "done", "preempt"], rows)
    sg = result["runs"].get("sharegpt")
    al = result["runs"].get("alpaca")
    goals = {}
    if sg:
        goals["sharegpt_util_block16"] = sg["paged-16"]["utilization_avg"]
        goals["sharegpt_util_goal_met"] = sg["paged-16"]["utilization_avg"] >= 0.96
        goals["sharegpt_batch_ratio_vs_max"] = sg["paged-16"]["max_batch"] / sg["orca-max"]["max_batch"]
        goals["sharegpt_batch_goal_met"] = goals["sharegpt_batch_ratio_vs_max"] >= 2
        print(f"\ngoal: ShareGPT-like utilization at block 16 >= 96%: {100 * goals['sharegpt_util_block16']:.1f}% "
              f"({'met' if goals['sharegpt_util_goal_met'] else 'MISSED'})"
              + (f"; Alpaca-like {100 * al['paged-16']['utilization_avg']:.1f}%" if al else ""))
        print(f"goal: max concurrent batch >= 2x orca-max: {goals['sharegpt_batch_ratio_vs_max']:.2f}x "
              f"({'met' if goals['sharegpt_batch_goal_met'] else 'MISSED'})"
              + (f"; Alpaca-like {al['paged-16']['max_batch'] / al['orca-max']['max_batch']:.2f}x" if al else ""))
    if al:
        goals["alpaca_util_block16"] = al["paged-16"]["utilization_avg"]
        goals["alpaca_batch_ratio_vs_max"] = al["paged-16"]["max_batch"] / al["orca-max"]["max_batch"]
    result["goals"] = goals
    series = {d: {n: r.pop("series") for n, r in runs.items() if isinstance(r, dict) and "series" in r}
              for d, runs in result["runs"].items()}
    write_result("bench_memory", result)
    plot(result, series)
    return 0


def plot(result: dict, series: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    datasets = list(result["runs"])
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    names = [n for n, _, _ in POLICIES]
    for j, d in enumerate(datasets):
        runs = result["runs"][d]
        ax = axes[0][j]
        parts = [("utilization_avg", "token states", "tab:green"),
                 ("internal_fragmentation", "internal frag.", "tab:orange"),
                 ("reserved_for_later", "reserved for later",
                  "tab:blue"), ("over_reservation", "over-reservation", "tab:red")]
        bottom = [0.0] * len(names)
        for key, label, color in parts:
            vals = [100 * runs[n][key] for n in names]
            ax.bar(names, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("% of reserved KV memory")
        ax.set_title(f"{d}-like: where reserved KV goes")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
        ax = axes[1][j]
        for n in names:
            ax.plot(series[d][n]["running"], label=n, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("running requests")
        ax.set_title(f"{d}-like: concurrent batch")
        ax.legend(fontsize=7)
    save_plot(fig, "bench_memory")


if __name__ == "__main__":
    raise SystemExit(main())
