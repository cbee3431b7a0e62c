"""What watching costs: the decode step of `pagedkv serve` at batch 32 with the dashboard closed
and open, in the same run.

One `pagedkv serve` (embedded memory service and worker, SmolLM2-135M fp32 on CPU, 1 GiB of KV
cache, ``--admin-api-key``; the feed reads every lease with the embedded service's admin token).
Two ways of watching:

- ``feed``: a client reads ``/dashboard/events`` (one snapshot a second): all an open page asks of the
  server, with no browser competing for this machine's cores.
- ``page``: ``/dashboard`` open and logged in, in headless Chromium on this same machine, drawing
  every snapshot (the grid, the tables, the charts), as an operator would have it open.

A run sends 32 streamed completions at once (prompts of 96 tokens cut from the corpus, different in
every run; ``--output-len`` tokens, greedy, ignore_eos). While all 32 decode, the watcher is
switched off and on every ``--segment`` seconds (the page: opened, then left for about:blank, its
session kept). A segment's step time is the median over every request's time between consecutive
tokens inside it (its first ``SETTLE`` seconds left out: the feed wakes, the page loads). Each
"on" segment is compared with the mean of the two "off" segments around it, which cancels the
slow drift of a shared machine (the step also grows with the context); the same comparison of each
"off" segment with the "off" segments two away gives the noise floor (``off vs off``).

    python benchmarks/bench_dashboard.py [--runs 2] [--output-len 384] [--segment 4] [--quick] [--no-browser]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import ROOT, Service, fmt, machine, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from pagedkv.model.tokenizer import load_tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
from headless_chromium import chromium, log_in  # noqa: E402 - scripts/ is not a package

KEY = "bench-operator"
BATCH, PROMPT_LEN = 32, 96
#: Seconds at the start of a segment left out of its step time.
SETTLE = 1.0
#: Clock ticks per second of /proc's CPU times.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The roles whose CPU time is recorded per segment.
ROLES = ("front", "memory", "worker", "chromium")


# ------------------------------------------------------------------ CPU time
def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from /proc (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def roles(serve_pid: int) -> dict[int, str]:
    """The processes that share this machine's cores: the front, its memory service and worker, and
    Chromium's processes, by pid."""
    out = {serve_pid: "front"}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == serve_pid:
            out[int(d.name)] = "memory" if b"memory" in cmd else "worker" if b"compute" in cmd else "front"
        elif stat.split("(", 1)[1].startswith("chromium"):
            out[int(d.name)] = "chromium"
    return out


def cpu_by_role(serve_pid: int) -> dict[str, float]:
    """CPU seconds so far of each role (:func:`roles`)."""
    total: dict[str, float] = {}
    for pid, role in roles(serve_pid).items():
        total[role] = total.get(role, 0.0) + _proc_cpu(pid)
    return total


# ------------------------------------------------------------------ watchers
class FeedReader:
    """Reads /dashboard/events while on, as a page would; records the feed's own tick cost."""

    def __init__(self, url: str):
        self.url = url
        self.tick_ms: list[float] = []  # the feed's wall and CPU time per tick, as it reports them
        self.tick_cpu_ms: list[float] = []
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def on(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(self._stop,), daemon=True)
        self._thread.start()

    def off(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._stop = self._thread = None

    def _read(self, stop: threading.Event) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=None) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return  # leaving closes the stream: the feed rests
                if line.startswith("data:"):
                    feed = json.loads(line[5:]).get("feed") or {}
                    if feed.get("last_tick_ms"):
                        self.tick_ms.append(feed["last_tick_ms"])
                        self.tick_cpu_ms.append(feed["last_tick_cpu_ms"])

    def close(self) -> None:
        self.off()


class Page:
    """/dashboard in headless Chromium (scripts/headless_chromium.py): on opens it (logged in), off
    leaves it for about:blank, which ends its stream."""

    def __init__(self, url: str):
        self.url = url
        self.driver = chromium(browser_log=False)
        log_in(self.driver, url, KEY)
        self.driver.get("about:blank")

    def on(self) -> None:
        self.driver.get(f"{self.url}/dashboard")

    def off(self) -> None:
        self.driver.get("about:blank")

    def close(self) -> None:
        self.driver.quit()


# ------------------------------------------------------------------ one run
async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int, first: asyncio.Event,
                  started: list[int]) -> list[float]:
    """One streamed completion: the arrival time of each chunk that carried tokens."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])
            if n:
                times.extend([time.perf_counter()] * n)
                if len(times) == n:
                    started[0] += 1
                    if started[0] == BATCH:
                        first.set()
    return times


def run(url: str, serve_pid: int, prompts: list[list[int]], watcher, output_len: int, segment: float) -> dict:
    """Send the batch; switch ``watcher`` off and on every ``segment`` s while all decode."""
    segments: list[tuple[str, float, float, dict]] = []  # (state, start, end, CPU seconds by role in it)
    done = threading.Event()

    def toggle(first: threading.Event):
        first.wait()
        state = "off"
        while not done.wait(SETTLE):  # the feed wakes or rests, the page loads or goes
            t0, c0 = time.perf_counter(), cpu_by_role(serve_pid)
            if done.wait(segment - SETTLE):
                break
            t1, c1 = time.perf_counter(), cpu_by_role(serve_pid)
            segments.append((state, t0, t1, {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in ROLES}))
            if state == "off":
                watcher.on()
                state = "on"
            else:
                watcher.off()
                state = "off"
        watcher.off()

    first_all = threading.Event()

    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        first, started = asyncio.Event(), [0]

        async def relay():
            await first.wait()
            first_all.set()

        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            tasks = [asyncio.create_task(_stream(c, url, p, output_len, first, started)) for p in prompts]
            relay_task = asyncio.create_task(relay())
            streams = []
            for t in asyncio.as_completed(tasks):
                streams.append(await t)
                done.set()  # the first request finished: the batch is no longer 32
            relay_task.cancel()
            return streams

    toggler = threading.Thread(target=toggle, args=(first_all,), daemon=True)
    toggler.start()
    streams = asyncio.run(go())
    toggler.join(timeout=60)
    end = min(s[-1] for s in streams)
    rows = []
    for state, t0, t1, cpu in segments:
        if t1 > end:  # a request had finished: not batch 32 any more
            continue
        gaps = [b - a for s in streams for a, b in zip(s, s[1:]) if t0 <= a and b <= t1 and b > a]
        if len(gaps) >= BATCH:
            rows.append({"state": state, "start": t0, "end": t1, "step_ms": 1e3 * statistics.median(gaps),
                         "gaps": len(gaps), "cores": {k: v / (t1 - t0) for k, v in cpu.items()}})
    return {"segments": rows}


def paired(segments: list[dict]) -> tuple[list[float], list[float]]:
    """(on vs the mean of the two off segments around it, off vs the off segments two away): relative changes."""
    on, null = [], []
    for i, s in enumerate(segments):
        if s["state"] == "on" and 0 < i < len(segments) - 1:
            ref = (segments[i - 1]["step_ms"] + segments[i + 1]["step_ms"]) / 2
            on.append(s["step_ms"] / ref - 1)
        if s["state"] == "off" and 1 < i < len(segments) - 2:
            ref = (segments[i - 2]["step_ms"] + segments[i + 2]["step_ms"]) / 2
            null.append(s["step_ms"] / ref - 1)
    return on, null


def cpu_paired(segments: list[dict]) -> dict[str, list[float]]:
    """Per role: the cores an "on" segment used minus the mean of the two "off" segments around it."""
    out: dict[str, list[float]] = {k: [] for k in ROLES}
    for i, s in enumerate(segments):
        if s["state"] == "on" and 0 < i < len(segments) - 1:
            for k in ROLES:
                out[k].append(s["cores"][k] - (segments[i - 1]["cores"][k] + segments[i + 1]["cores"][k]) / 2)
    return out


def mean_sem(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None)


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs of each watcher (default 2)")
    ap.add_argument("--output-len", type=int, default=384, help="output tokens per request (default 384)")
    ap.add_argument("--segment", type=float, default=4.0, help="seconds between switching the watcher (default 4)")
    ap.add_argument("--quick", action="store_true", help="1 run of each, 192 output tokens")
    ap.add_argument("--no-browser", action="store_true", help="leave out the page (no Chromium here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    runs, output_len = (1, 192) if args.quick else (args.runs, args.output_len)
    watchers = ["feed"] + ([] if args.no_browser else ["page"])

    tok = load_tokenizer("smollm2")
    corpus = corpus_ids(tok)
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:  # different content in every run: no prefix-cache hit between runs
        return [corpus[s:s + PROMPT_LEN] for s in (rng.randrange(len(corpus) - PROMPT_LEN) for _ in range(BATCH))]

    results: dict[str, list] = {w: [] for w in watchers}
    ticks: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-dashboard-") as tmp:
        srv = Service(["serve", "--device", "cpu", "--admin-api-key", KEY, "--max-num-seqs", str(BATCH),
                       "--kv-cache-memory", "1GiB"], "serve", Path(tmp), env={"PAGEDKV_LOG_LEVEL": "warning"})
        url = srv.info.get("url") or f"http://{srv.address}"
        try:
            snap = httpx.get(f"{url}/dashboard/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
            print(f"pool: {snap['pool']['total_blocks']} blocks of {snap['pool']['block_size']} tokens; "
                  f"feed scope: {snap['scope']}")
            old = prompts()  # warm-up: first-use costs out of the measured runs
            asyncio.run(_warm(url, old))
            for r in range(runs):
                for w in watchers:
                    watcher = FeedReader(url) if w == "feed" else Page(url)
                    try:
                        out = run(url, srv.pid, prompts(), watcher, output_len, args.segment)
                    finally:
                        watcher.close()
                    if isinstance(watcher, FeedReader) and watcher.tick_ms:
                        ticks.append((statistics.median(watcher.tick_ms), statistics.median(watcher.tick_cpu_ms)))
                    on, null = paired(out["segments"])
                    results[w].append(out | {"run": r, "on_vs_off": on, "off_vs_off": null})
                    print(f"run {r} {w:5s} {len(out['segments'])} segments; on vs off "
                          f"{fmt(100 * statistics.median(on), '+.2f') if on else '-'}% (median), "
                          f"off vs off {fmt(100 * statistics.median(null), '+.2f') if null else '-'}%")
        finally:
            srv.stop()

    rows, summary = [], {}
    for w in watchers:
        on = [x for r in results[w] for x in r["on_vs_off"]]
        null = [x for r in results[w] for x in r["off_vs_off"]]
        segs = [s for r in results[w] for s in r["segments"]]
        m, sem = mean_sem(on)
        nm, nsem = mean_sem(null)
        summary[w] = {
            "on_segments": len(on),
            "on_vs_off_median": statistics.median(on) if on else None,
            "on_vs_off_mean": m,
            "on_vs_off_sem": sem,
            "off_vs_off_median": statistics.median(null) if null else None,
            "off_vs_off_mean": nm,
            "off_vs_off_sem": nsem,
            "step_ms_on": statistics.median(s["step_ms"] for s in segs if s["state"] == "on"),
            "step_ms_off": statistics.median(s["step_ms"] for s in segs if s["state"] == "off"),
        }
        pct = lambda v: fmt(None if v is None else 100 * v, "+.2f")
        rows.append(
            [
                w,
                str(len(on)),
                fmt(summary[w]["step_ms_off"]),
                fmt(summary[w]["step_ms_on"]),
                pct(summary[w]["on_vs_off_median"]),
                f"{pct(m)} ± {fmt(None if sem is None else 100 * sem)}",
                pct(summary[w]["off_vs_off_median"]),
                f"{pct(nm)} ± {fmt(None if nsem is None else 100 * nsem)}",
            ]
        )
    table(
        f"Decode step at batch {BATCH} with the dashboard off and on (segments of {args.segment:g} s, "
        f"pagedkv serve on CPU)",
        ["watcher", "on segs", "off ms", "on ms", "on vs off % (median)", "mean ± sem", "off vs off %", "mean ± sem"],
        rows,
    )
    cpu_rows = []
    for w in watchers:
        per_run = [cpu_paired(r["segments"]) for r in results[w]]
        extra = {k: [x for p in per_run for x in p[k]] for k in ROLES}
        summary[w]["extra_cores"] = {k: mean_sem(v)[0] for k, v in extra.items()}
        cpu_rows.append(
            [w] + [f"{fmt(mean_sem(extra[k])[0], '+.3f')} ± {fmt(mean_sem(extra[k])[1], '.3f')}" for k in ROLES]
        )
    table(
        "CPU used while watching, in cores (each on segment minus the off segments around it; mean ± sem)",
        ["watcher", *ROLES],
        cpu_rows,
    )
    if ticks:
        print(
            f"the feed's own tick in the server: {statistics.median(t[0] for t in ticks):.1f} ms wall, "
            f"{statistics.median(t[1] for t in ticks):.1f} ms CPU, one every "
            f"{snap['feed']['interval_s'] if snap.get('feed') else '?'} s "
            "while watched"
        )
    write_result(
        "bench_dashboard",
        {
            "machine": machine(),
            "batch": BATCH,
            "prompt_len": PROMPT_LEN,
            "output_len": output_len,
            "segment_s": args.segment,
            "settle_s": SETTLE,
            "runs": results,
            "summary": summary,
            "feed_tick_ms": [t[0] for t in ticks],
            "feed_tick_cpu_ms": [t[1] for t in ticks],
        },
    )
    plt = pyplot()
    if plt:
        fig, axes = plt.subplots(1, len(watchers), figsize=(6 * len(watchers), 4), squeeze=False)
        for ax, w in zip(axes[0], watchers):
            for r in results[w]:
                t0 = r["segments"][0]["start"] if r["segments"] else 0
                for state, color in (("off", "tab:blue"), ("on", "tab:red")):
                    pts = [((s["start"] - t0), s["step_ms"]) for s in r["segments"] if s["state"] == state]
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        "o",
                        color=color,
                        label=f"{state}" if r["run"] == 0 else None,
                    )
            ax.set_title(f"{w}: dashboard off / on")
            ax.set_xlabel("seconds into the decode")
            ax.set_ylabel(f"step at batch {BATCH} (ms)")
            ax.legend()
        save_plot(fig, "bench_dashboard")
    return 0


async def _warm(url: str, prompts: list[list[int]]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), headers={"Authorization": f"Bearer {KEY}"}) as c:
        await asyncio.gather(
            *(
                c.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 16, "ignore_eos": True})
                for p in prompts
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
