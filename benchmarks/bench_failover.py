"""Worker failover under a streamed load: a killed worker's requests forked from their KV vs
prefilled again, and a rolling restart by drains, beside the same trace undisturbed.

One memory service and two compute workers (``--model``, default SmolLM2) mapping its pool, block
size 16, each run through a fresh :class:`client.Client`. The trace: ``--requests`` requests
arriving at ``--rate`` requests/s (Poisson, seeded), each a ``--shared-tokens``-token prefix common
to all (a system prompt) and a distinct ``--prompt-tokens``-token tail (corpus windows), greedy,
``ignore_eos``, ``--output-tokens`` tokens each. Every output is recorded as the engine publishes
it (the request handle's listener, what ``pagedkv serve``'s streams use), so each token has its
arrival time. Every run carries its own cache salt, so none finds another's blocks cached. Each
service runs one OpenMP thread (``--worker-threads``): two workers on two cores, each its own.

Runs, one trace:

- ``no restart``: undisturbed;
- ``fork failover``: a worker (drawn, ``--seed``) is SIGKILLed at a moment drawn between a fifth
  and a third of the arrivals, whatever step runs then; the requests its lost step ran get
  proven-only forks and go on on the other worker from their KV in the pool
  (client.engine.failover), computing the lost step's tokens again;
- ``re-prefill failover``: the same kill with ``Failover.migrate = "recompute"``: those requests
  are prefilled again on the other worker, prompt and generated tokens (request migration where a
  worker's KV dies with it). The pool's prefix cache gives back their full blocks; with
  ``--no-prefix-caching`` (every run) the whole re-prefill is computed;
- ``rolling restart``: from that moment, worker 0 is drained (``Client.drain``), stopped with
  SIGTERM, started again at its port, and taken back by the engine; then worker 1 the same way.

The killed worker is started again at its address between runs, so each run starts from two.
Columns: requests, failed ones, affected ones (streaming on the killed or drained worker when it
went; ``no restart``: all), those with ``no restart``'s tokens; the affected requests' inter-token
gaps (p50, p99, max) and stall (median of the longest gap ending at one of the first two tokens
after the kill or the drain: ms, and engine steps, 1 when none was missed); tokens computed again
(``EngineStats.recomputed_worker_failure``), tokens the completed steps computed beyond ``no
restart`` (the lost step's own work is not in them); prefix-cache hit rate and tokens (GetStats);
wall seconds. The plot draws each token's gap against its arrival around the kill, both modes.

    python benchmarks/bench_failover.py [--quick] [--model smollm2]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, ServiceProcess, Stack, fmt, machine, median, pct, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from client import Client, SamplingParams
from client.ops.stack import wait_healthy
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.logs import configure_logging

BS = 16
RUNS = ("no restart", "fork failover", "re-prefill failover", "rolling restart")
#: Seconds before and after the kill that the plot shows.
WINDOW = (3.0, 10.0)


@dataclass(slots=True)
class Record:
    """One request of a run: when each of its tokens arrived (perf_counter seconds, and the engine's
    step count then) and how it ended."""

    index: int
    step_count: Callable[[], int]  # the engine's step count now
    times: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    handle: object = None

    def listener(self, out, error) -> None:
        """The handle's listener, on the engine thread: stamp every new token."""
        now = time.perf_counter()
        if error is not None:
            self.error, self.done = f"{type(error).__name__}: {error}", True
        if out is None:
            return
        ids = out.outputs[0].token_ids
        self.times += [now] * (len(ids) - len(self.tokens))
        self.steps += [self.step_count()] * (len(ids) - len(self.tokens))
        self.tokens = list(ids)
        self.done = self.done or out.finished

    def gaps(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [b - a for a, b in zip(self.times, self.times[1:])]

    def across(self, t: float) -> tuple[float, int] | None:
        """The longest gap ending at one of the first two tokens after ``t`` (the first may come from
        a step its worker had done before ``t``), in seconds and in engine steps (1: no step passed
        without a token); None if it had no token before ``t``, or none after."""
        k = next((k for k, x in enumerate(self.times) if x > t), None)
        if not k:
            return None
        ends = range(k, min(k + 2, len(self.times)))
        return (max(self.times[j] - self.times[j - 1] for j in ends),
                max(self.steps[j] - self.steps[j - 1] for j in ends))


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds for the table ("-" for None)."""
    return fmt(None if seconds is None else 1e3 * seconds, ".0f")


def make_trace(tok, args) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt token ids) per request: a shared prefix and a distinct tail each."""
    rng = random.Random(args.seed)
    ids = corpus_ids(tok)
    start = rng.randrange(len(ids) - args.shared_tokens)
    shared = ids[start:start + args.shared_tokens]
    out, t = [], 0.0
    for _ in range(args.requests):
        q = rng.randrange(len(ids) - args.prompt_tokens)
        out.append((t, shared + ids[q:q + args.prompt_tokens]))
        t += rng.expovariate(args.rate)
    return out


class Workers:
    """Starts the stack's workers again at their addresses (``stack.workers[w]``: the process now)."""

    def __init__(self, stack: Stack, args, run_dir: Path):
        self.stack, self.args, self.run_dir, self.starts = stack, args, run_dir, 0

    def start(self, w: int) -> float:
        """Start worker ``w`` again at its port (its old process is gone); returns the seconds it took
        to turn healthy."""
        t0 = time.perf_counter()
        old = self.stack.workers[w]
        old.proc.wait()
        port = int(old.address.rsplit(":", 1)[1])
        self.starts += 1
        flags = ["compute", "--memory", self.stack.memory_address, "--model", self.args.model,
                 *(["--device", self.args.device] if self.args.device else [])]
        svc = ServiceProcess.pagedkv(flags, self.run_dir, f"failover-worker{w}-start{self.starts}", port=port,
                                     env=self.stack.env, cwd=ROOT)
        wait_healthy(svc.address, 180)
        self.stack.workers[w] = svc
        return time.perf_counter() - t0


def wait_until(t: float, done: threading.Event) -> None:
    """Sleep until perf_counter() reaches ``t``; RuntimeError if the run ended first (lengthen the trace)."""
    if done.wait(max(0.0, t - time.perf_counter())):
        raise RuntimeError("the run ended before the disruption: lengthen the trace")


def streaming_on(records: list[Record], w: int) -> list[int]:
    """The requests streaming (a token out, not finished) on worker ``w`` now, by index."""
    return [r.index for r in records
            if r.handle is not None and not r.done and r.tokens and r.handle.request.worker == w]


def wait_ready(client: Client, address: str, timeout: float = 120.0) -> tuple[float, int]:
    """Wait until the engine takes the worker at ``address`` back; returns (seconds, nudges): a nudge is a
    one-token request sent when the trace had no work left, so the engine steps (and probes)."""
    t0, nudges = time.perf_counter(), 0
    while dict(client.engine_stats().workers).get(address) != "ready":
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the engine did not take {address} back within {timeout:.0f} s")
        if not client.engine.has_work():
            client.submit([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True)).result(timeout=60)
            nudges += 1
        time.sleep(0.02)
    return time.perf_counter() - t0, nudges


def run(stack: Stack, workers: Workers, trace, label: str, args, event=None) -> dict:
    """Run the trace through a fresh Client; ``event(client, records, done, t0)`` runs beside it (the
    kill or the rolling restart; ``t0``: the trace's start, perf_counter seconds) and returns what it did."""
    client = Client(stack.memory_address, stack.worker_addresses, max_num_seqs=args.max_num_seqs,
                    recovery_timeout=60, lease_ttl=600)
    if label == "re-prefill failover":
        client.engine.failover.migrate = "recompute"
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    records = [Record(i, lambda: client.engine.step_count) for i in range(len(trace))]
    done, happened = threading.Event(), {}
    before, load = client.stats(), os.getloadavg()[0]

    def side():
        try:
            happened.update(event(client, records, done, t0) or {})
        except Exception as e:  # noqa: BLE001 - reported with the run
            happened["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=side, daemon=True) if event else None
    t0 = time.perf_counter()
    try:
        if thread:
            thread.start()
        for (at, prompt), rec in zip(trace, records):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            rec.handle = client.submit(prompt, params, cache_salt=f"{label}/{args.seed}", listener=rec.listener,
                                       request_id=f"r{rec.index}")
        for rec in records:
            try:
                rec.handle.result(timeout=600)
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not raised
                rec.error = rec.error or f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - t0
        done.set()
        if thread:
            thread.join(timeout=300)
        stats, after = client.engine_stats(), client.stats()
        steps = client.engine.step_count
        computed = sum(t.num_tokens for t in client.engine.traces)
    finally:
        client.close()
    if "error" in happened:
        raise RuntimeError(f"{label}: {happened['error']}")
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    at = happened.get("affected")  # request index -> when the kill or its worker's drain came
    affected = sorted(at) if at is not None else [r.index for r in records]
    gaps = [g for i in affected for g in records[i].gaps()]
    across = [g for g in (records[i].across(t) for i, t in at.items()) if g] if at else []
    result = {
        "requests": len(records), "failed": sum(r.error is not None for r in records),
        "errors": sorted({r.error for r in records if r.error}), "affected": affected,
        "gap_p50_s": pct(gaps, 0.5), "gap_p99_s": pct(gaps, 0.99), "gap_max_s": max(gaps, default=None),
        "event_gap_p50_s": median([g for g, _ in across]), "event_gaps_s": [g for g, _ in across],
        "event_gap_p50_steps": median([n for _, n in across]), "event_gaps_steps": [n for _, n in across],
        "recomputed_worker_failure": stats.recomputed_worker_failure,
        "recomputed_preemption": stats.recomputed_preemption,
        "worker_failovers": stats.worker_failovers, "tokens_computed": computed, "steps": steps, "wall_s": wall,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits, "hit_rate": hits / queries if queries else None,
        "event": {k: v for k, v in happened.items() if k != "affected"},
        "load_avg_1m": [load, os.getloadavg()[0]],
        "tokens": [r.tokens for r in records], "times": [[round(x - t0, 4) for x in r.times] for r in records],
    }
    if "t" in happened:
        result["event"]["t"] = round(happened["t"] - t0, 4)
    for w in result["event"].get("workers", []):
        w["t"] = round(w["t"] - t0, 4)
    print(f"  {label:<20} {wall:6.1f} s  {steps} steps  failed {result['failed']}  affected {len(affected)}  "
          f"gap max {fmt(result['gap_max_s'], '.3f')} s  recomputed {stats.recomputed_worker_failure}  "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    return result


def kill_at(workers: Workers, w: int, at: float):
    """The failover event: SIGKILL worker ``w`` ``at`` seconds into the trace, whatever step runs then."""
    def event(client: Client, records: list[Record], done: threading.Event, t0: float) -> dict:
        wait_until(t0 + at, done)
        affected = streaming_on(records, w)
        workers.stack.workers[w].proc.kill()
        t = time.perf_counter()
        return {"t": t, "step": client.engine.step_count, "worker": w, "affected": {i: t for i in affected}}
    return event


def rolling_at(workers: Workers, at: float):
    """The rolling restart, ``at`` seconds into the trace: drain, SIGTERM, start again and wait for
    worker 0, then worker 1."""
    def event(client: Client, records: list[Record], done: threading.Event, t0: float) -> dict:
        wait_until(t0 + at, done)
        out = {"t": time.perf_counter(), "step": client.engine.step_count, "affected": {}, "workers": []}
        for w in (0, 1):
            address, affected, t1 = workers.stack.workers[w].address, streaming_on(records, w), time.perf_counter()
            reply = client.drain(address)
            drained = time.perf_counter() - t1
            workers.stack.workers[w].stop()  # SIGTERM: graceful shutdown
            stopped = time.perf_counter() - t1
            workers.start(w)
            started = time.perf_counter() - t1
            back, nudges = wait_ready(client, address)
            out["affected"].update({i: t1 for i in affected if i not in out["affected"]})
            out["workers"].append({"worker": address, "moved_sequences": reply["moved_sequences"],
                                   "drain_s": drained, "stopped_s": stopped, "started_s": started,
                                   "back_s": started + back, "nudges": nudges, "t": t1})
        return out
    return event


def trim(result: dict) -> None:
    """What the JSON keeps of the runs' streams: no token ids, and token times (s from the run's start)
    only in the failover runs, for the requests with a token in the plot's window around the kill."""
    for r in result["runs"].values():
        r.pop("tokens", None)
        times = r.pop("times")
        if "worker" in r["event"]:
            t = r["event"]["t"]
            r["times"] = {i: ts for i, ts in enumerate(times) if any(-WINDOW[0] <= x - t <= WINDOW[1] for x in ts)}


def plot(result: dict, kill: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, label in zip(axes, ("fork failover", "re-prefill failover")):
        r = result["runs"][label]
        t_kill, affected = r["event"]["t"], set(r["affected"])
        for i, times in sorted(r["times"].items(), key=lambda it: it[0] in affected):  # the affected on top
            xs = [b - t_kill for b in times[1:]]
            ys = [1e3 * (b - a) for a, b in zip(times, times[1:])]
            keep = [(x, y) for x, y in zip(xs, ys) if -WINDOW[0] <= x <= WINDOW[1]]
            if not keep:
                continue
            hit = i in affected
            ax.plot(*zip(*keep), ".-" if hit else ".", ms=3 if hit else 2, lw=0.6, alpha=0.9 if hit else 0.35,
                    color=None if hit else "#999")
        ax.axvline(0, color="#c33", lw=1)
        ax.set_title(f"{label}: worker {kill['worker']} killed at {kill['at_s']:.1f} s (step {r['event']['step']})")
        ax.set_xlabel("token arrival, s after the kill")
        ax.set_yscale("log")
    axes[0].set_ylabel("inter-token gap (ms)")
    fig.suptitle("Each token's gap since the previous one; colour: requests streaming on the killed worker, "
                 "grey: the others", fontsize=10)
    save_plot(fig, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shorter trace (32 requests, 16 tokens each)")
    ap.add_argument("--model", default="smollm2", help="model of both services (default smollm2)")
    ap.add_argument("--device", default=None, help="--device of both services (default theirs)")
    ap.add_argument("--requests", type=int, default=None, help="requests in the trace (default 96; quick 32)")
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (default 2)")
    ap.add_argument("--shared-tokens", type=int, default=64, help="prefix common to every prompt (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="distinct prompt tail (default 96)")
    ap.add_argument("--output-tokens", type=int, default=None, help="tokens generated each (default 32; quick 16)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once (default 32)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="blocks in the pool (default 1024)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="the pool's prefix cache off, every run")
    ap.add_argument("--worker-threads", type=int, default=1, help="OMP_NUM_THREADS of each service (default 1; 0: all)")
    ap.add_argument("--seed", type=int, default=0, help="trace, kill moment and killed worker (default 0)")
    ap.add_argument("--result-name", default="bench_failover", help="results/<name>.json and .png")
    args = ap.parse_args()
    configure_logging(os.environ["PAGEDKV_LOG_LEVEL"])  # common's "warning" (a logger configured it at import)
    args.requests = args.requests or (32 if args.quick else 96)
    args.output_tokens = args.output_tokens or (16 if args.quick else 32)
    tok = load_tokenizer(args.model)
    trace = make_trace(tok, args)
    mem = ["--num-blocks", str(args.num_blocks), "--block-size", str(BS),
           *(["--no-prefix-caching"] if args.no_prefix_caching else [])]
    rng = random.Random(args.seed)
    kill = {"at_s": round(rng.uniform(trace[-1][0] / 5, trace[-1][0] / 3), 2), "worker": rng.randrange(2)}
    result = {"machine": machine(), "config": vars(args), "runs": {}}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagedkv-failover-") as tmp:
        stack = Stack(mem, "failover", device=args.device, model=args.model)
        stack.num_workers, stack.run_dir = 2, Path(tmp)
        stack.env = {"OMP_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else None
        with stack:
            workers = Workers(stack, args, Path(tmp))
            with Client(stack.memory_address, stack.worker_addresses) as warm:  # load both workers' kernels
                warm.generate([p for _, p in trace[:4]], SamplingParams(max_tokens=4, ignore_eos=True),
                              cache_salt="warm-up")
            runs = result["runs"]
            runs["no restart"] = run(stack, workers, trace, "no restart", args)
            for label in ("fork failover", "re-prefill failover"):
                runs[label] = run(stack, workers, trace, label, args, kill_at(workers, kill["worker"], kill["at_s"]))
                runs[label]["event"]["restart_s"] = workers.start(kill["worker"])
            runs["rolling restart"] = run(stack, workers, trace, "rolling restart", args,
                                             rolling_at(workers, kill["at_s"]))
    result["kill"] = kill
    result["total_s"] = time.perf_counter() - t_all
    base = runs["no restart"]
    rows = []
    for label in RUNS:
        r = runs[label]
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        r["same_tokens"] = same
        r["extra_computed"] = r["tokens_computed"] - base["tokens_computed"]
        rows.append([label, r["requests"], r["failed"], len(r["affected"]), f"{same}/{r['requests']}",
                     ms(r["gap_p50_s"]), ms(r["gap_p99_s"]), ms(r["gap_max_s"]), ms(r["event_gap_p50_s"]),
                     fmt(r["event_gap_p50_steps"], "g"),
                     r["recomputed_worker_failure"], r["extra_computed"] if label != "no restart" else "-",
                     fmt(r["hit_rate"] and 100 * r["hit_rate"], ".1f"), r["prefix_cache_hits"], f"{r['wall_s']:.1f}"])
    text = table(f"Failover and rolling restart: {args.requests} requests at {args.rate:g}/s "
                 f"({args.shared_tokens} shared + {args.prompt_tokens} prompt tokens, {args.output_tokens} out), "
                 f"2 workers, {args.model}; the kill (worker {kill['worker']}) or the first drain {kill['at_s']:.1f} s "
                 "into the trace; gaps of the affected requests",
                 ["run", "reqs", "failed", "affected", "same tokens", "gap p50 ms", "p99 ms", "max ms",
                  "at event ms", "steps", "recomputed", "extra computed", "hit %", "hit tokens", "wall s"], rows)
    result["table"] = text
    for w in runs["rolling restart"]["event"].get("workers", []):
        print(f"  rolling restart {w['worker']}: {w['moved_sequences']} sequences moved, drained in "
              f"{w['drain_s'] * 1e3:.0f} ms, back after {w['back_s']:.1f} s ({w['nudges']} nudges)")
        if w["nudges"]:
            print(f"  note: the trace ended before {w['worker']} was back; {w['nudges']} one-token requests kept the "
                  "engine stepping (their tokens are in the rolling restart's counts): lengthen the trace")
    trim(result)
    write_result(args.result_name, result)
    plot(result, kill, args.result_name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
