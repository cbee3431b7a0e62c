"""Soak: a worker's memory under a long serving load, sampled every minute.

Starts ``pagedkv serve`` (its embedded memory service and one worker) once per variant, keeps
``--streams`` requests in flight for the variant's minutes (each stream sends its next request
when its last one ended: prompts and output lengths from the project's trace, each stream its own
seed, greedy and sampled in turn, all streamed), and every ``--sample-every`` seconds reads the
anonymous memory (``RssAnon`` of ``/proc/<pid>/status``) of the worker, the memory service and the
front. The worker is the front's child running ``compute``; a new pid is a restart.

Variants (``--variants NAME[:MINUTES],...``):

- ``row-buckets``: the defaults (oneDNN projections at a bounded set of row counts,
  ``compute_service.model.linear.bucket_rows``).
- ``no-buckets``: ``PAGEDKV_ROW_BUCKETS=0``, oneDNN at every row count a step brings: each new
  count builds primitives that oneDNN's and ideep's caches keep (docs/benchmarks.md, "Worker
  memory under load").
- ``unpacked``: ``PAGEDKV_PACKED_LINEAR=0``, projections through ``F.linear`` (no oneDNN caches).

Verdict per variant (:func:`flatness`): after ``--warmup-minutes``, every sample of the worker
stays within ``--tolerance`` of its value at the end of warm-up, with 0 restarts and 0 failed
requests; the spread (max / min - 1) and a least-squares slope (MiB per hour) are printed beside.

    python benchmarks/bench_soak.py                                  # 30 min, 64 streams, defaults
    python benchmarks/bench_soak.py --variants row-buckets:30,no-buckets:10

Prints a table per variant, writes ``benchmarks/results/bench_soak.json`` and ``.png`` (``--result-name``). Not part
of ``make test``; one run takes the variants' minutes plus a start of ``pagedkv serve`` each.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx
from bench_serving import Request, payload, send, stop_server
from common import ROOT, fmt, machine, pyplot, save_plot, table, write_result
from prompts import trace_prompts

from client.ops.stack import ServiceProcess
from pagedkv.model.tokenizer import load_tokenizer

VARIANTS = {
    "row-buckets": {},
    "no-buckets": {"PAGEDKV_ROW_BUCKETS": "0"},
    "unpacked": {"PAGEDKV_PACKED_LINEAR": "0"},
}


def anon_mib(pid: int) -> float | None:
    """``RssAnon`` of process ``pid`` in MiB, or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> dict[str, int]:
    """The ``memory`` and ``compute`` child processes of ``pid``: role -> pid."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for role in ("memory", "compute"):
            if role.encode() in argv:
                out[role] = int(stat.parent.name)
    return out


class Load:
    """``streams`` closed-loop request streams against ``url``; counts what they got."""

    def __init__(self, url: str, model: str, requests: list[list[Request]]):
        self.url = url.rstrip("/") + "/v1/completions"
        self.model, self.requests = model, requests
        self.ok = self.failed = self.tokens = 0
        self.errors: list[str] = []
        self.stop = False

    async def stream(self, client, i: int) -> None:
        n = 0
        while not self.stop:
            req = self.requests[i][n % len(self.requests[i])]
            body = payload(req, self.model, chat=False)
            body["temperature"] = 0.0 if n % 2 == 0 else 0.8
            out = await send(client, self.url, body, False, 0.0)
            if out.ok:
                self.ok, self.tokens = self.ok + 1, self.tokens + out.output_tokens
            else:
                self.failed += 1
                self.errors = (self.errors + [out.error])[-5:]
            n += 1


async def soak(url: str, serve_pid: int, minutes: float, args, requests) -> dict:
    """Run the load for ``minutes``, sampling every ``args.sample_every`` seconds; the samples and counts."""
    load = Load(url, args.model, requests)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples, worker_pids = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = [asyncio.create_task(load.stream(client, i)) for i in range(args.streams)]
        t0 = time.monotonic()
        while True:
            kids = children(serve_pid)
            w = kids.get("compute")
            if w is not None and (not worker_pids or worker_pids[-1] != w):
                worker_pids.append(w)
            elapsed = time.monotonic() - t0
            samples.append({"minute": elapsed / 60, "worker_mib": anon_mib(w) if w else None,
                            "memory_mib": anon_mib(kids["memory"]) if "memory" in kids else None,
                            "front_mib": anon_mib(serve_pid), "requests_ok": load.ok,
                            "requests_failed": load.failed, "output_tokens": load.tokens})
            if elapsed >= minutes * 60:
                break
            await asyncio.sleep(min(args.sample_every, minutes * 60 - elapsed))
        load.stop = True
        await asyncio.wait(tasks, timeout=300)
    wall = time.monotonic() - t0
    return {"minutes": minutes, "samples": samples, "worker_restarts": max(0, len(worker_pids) - 1),
            "requests_ok": load.ok, "requests_failed": load.failed, "errors": load.errors,
            "output_tokens_per_s": load.tokens / wall, **flatness(samples, args.warmup_minutes, args.tolerance)}


def flatness(samples: list[dict], warmup_minutes: float, tolerance: float) -> dict:
    """The worker's memory after warm-up against its value at the end of warm-up (the first sample
    at or past ``warmup_minutes``): ``drift``, the largest |sample / that value - 1|; ``spread``,
    max / min - 1; ``slope_mib_per_hour``, a least-squares line's; ``flat``: drift <= ``tolerance``.
    A sample is one instant, so it holds the activations of the step computing then (tens of MiB at
    512 tokens): drift bounds them and any growth together, the slope shows growth alone."""
    after = [(s["minute"], s["worker_mib"]) for s in samples if s["minute"] >= warmup_minutes and s["worker_mib"]]
    if len(after) < 2:
        return {"reference_mib": None, "drift": None, "spread": None, "slope_mib_per_hour": None, "flat": False}
    ref = after[0][1]
    xs, ys = [m for m, _ in after], [v for _, v in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    drift = max(abs(v / ref - 1) for v in ys)
    return {"reference_mib": ref, "drift": drift, "spread": max(ys) / min(ys) - 1, "slope_mib_per_hour": 60 * slope,
            "flat": drift <= tolerance}


def run_variant(name: str, minutes: float, args, requests, log_dir: Path) -> dict:
    """Start ``pagedkv serve`` with the variant's environment, soak it, stop it."""
    cmd = ["serve", "--served-model-name", args.model, "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory", f"{args.kv_cache_gib}GiB", *args.pagedkv_args.split()]
    print(f"\n{name}: pagedkv {' '.join(cmd)}  ({minutes:g} min, {args.streams} streams)", flush=True)
    srv = ServiceProcess.pagedkv(cmd, log_dir, f"serve-{name}", env={"PAGEDKV_LOG_LEVEL": "warning", **VARIANTS[name]},
                                 cwd=ROOT, timeout=300, detach=True)
    try:
        url = srv.info.get("url") or f"http://{srv.address}"
        return asyncio.run(soak(url, srv.pid, minutes, args, requests))
    finally:
        stop_server(srv)


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant, run in result["runs"].items():
        pts = [(s["minute"], s["worker_mib"]) for s in run["samples"] if s["worker_mib"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=variant)
    ax.axvline(result["config"]["warmup_minutes"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes of load")
    ax.set_ylabel("worker anonymous memory (MiB)")
    ax.set_title(f"Soak: {result['config']['streams']} streams against pagedkv serve")
    ax.legend()
    save_plot(fig, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="row-buckets", help="NAME[:MINUTES],... of " + ", ".join(VARIANTS))
    ap.add_argument("--minutes", type=float, default=30.0, help="minutes of a variant that names none")
    ap.add_argument("--streams", type=int, default=64, help="requests kept in flight")
    ap.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup-minutes", type=float, default=10.0, help="samples before this are warm-up")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest max/min - 1 after warm-up")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--model", default="smollm2", help="served model name")
    ap.add_argument("--pagedkv-args", default="", help="extra flags for pagedkv serve (one string)")
    ap.add_argument("--result-name", default="bench_soak", help="benchmarks/results/<name>.json and .png")
    args = ap.parse_args()
    plan = []
    for item in args.variants.split(","):
        name, _, minutes = item.partition(":")
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")
        plan.append((name, float(minutes) if minutes else args.minutes))
    tok = load_tokenizer("smollm2")
    requests = [[Request(tok.decode(ids), len(ids), n, 0.0, list(ids)) for ids, n in
                 trace_prompts(tok, "sharegpt", 64, seed=i, max_prompt=args.max_prompt, max_output=args.max_output)]
                for i in range(args.streams)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pagedkv-soak-") as tmp:
        for name, minutes in plan:
            runs[name] = r = run_variant(name, minutes, args, requests, Path(tmp))
            rows = [[fmt(s["minute"], ".1f"), fmt(s["worker_mib"], ".0f"), fmt(s["memory_mib"], ".0f"),
                     fmt(s["front_mib"], ".0f"), s["requests_ok"], s["requests_failed"]] for s in r["samples"]]
            table(f"{name}: anonymous memory (MiB) by minute",
                  ["minute", "worker", "memory svc", "front", "requests ok", "failed"], rows)
            flat = r["flat"] and r["worker_restarts"] == 0 and r["requests_failed"] == 0
            r["verdict"] = "flat" if flat else "NOT flat"
            pct = (lambda v: fmt(None if v is None else 100 * v, "+.1f" if v is not None and v < 0 else ".1f"))
            print(f"{name}: worker restarts {r['worker_restarts']}, requests ok {r['requests_ok']}, failed "
                  f"{r['requests_failed']}, {r['output_tokens_per_s']:.1f} output tok/s; worker after "
                  f"{args.warmup_minutes:g} min: reference {fmt(r['reference_mib'], '.0f')} MiB, drift "
                  f"{pct(r['drift'])}%, spread {pct(r['spread'])}%, slope {fmt(r['slope_mib_per_hour'], '+.0f')} "
                  f"MiB/h -> {r['verdict']} (tolerance {100 * args.tolerance:g}%)", flush=True)
            for e in r["errors"]:
                print(f"  error: {e}")
    result = {"machine": machine(), "config": {k: v for k, v in vars(args).items()}, "runs": runs}
    write_result(args.result_name, result)
    plot(result, args.result_name)
    return 0 if all(r["verdict"] == "flat" for name, r in runs.items() if name != "no-buckets") else 1


if __name__ == "__main__":
    raise SystemExit(main())
