"""What watching costs: the decode step of `pagedkv serve` at batch 32 with the dashboard closed,
with its feed streamed, and with the page open in headless Chromium.

Modes (one `pagedkv serve`, embedded memory service and worker, SmolLM2-135M fp32 on CPU, 1 GiB of
KV cache, ``--admin-api-key``; the feed reads every lease with the embedded service's admin token):

- ``closed``: nobody watches; the feed's thread sleeps.
- ``feed``: one client reads ``/dashboard/events`` (2 snapshots/s): all an open page asks of the
  server, with no browser competing for this machine's cores.
- ``page``: ``/dashboard`` open and logged in, in headless Chromium on this same machine (it draws
  every snapshot: the grid, the tables, the charts), as an operator would have it open.

Each run sends 32 streamed completions at once (prompts of 96 tokens cut from the corpus,
different in every run; 64 output tokens, greedy, ignore_eos). Its step time is measured over the
window in which all 32 decode, from the last request's first token to the first request's last
token: for each request, the time between its first and last token inside the window over the
tokens between them; the run's figure is the median over the 32 requests. Modes alternate round
by round (closed, feed, page, closed, ...) so that a noisy machine's drift falls on each; the
table gives each mode's median over rounds and its change against ``closed``.

    python benchmarks/bench_dashboard.py [--rounds 4] [--quick] [--no-browser]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import ROOT, Service, fmt, machine, pyplot, save_plot, table, write_result
from prompts import corpus_ids

from client.tokenizer import load_tokenizer

sys.path.insert(0, str(ROOT / "scripts"))
from headless_chromium import chromium, log_in, snapshot_number  # noqa: E402 - scripts/ is not a package

KEY = "bench-operator"
BATCH, PROMPT_LEN, OUTPUT_LEN = 32, 96, 64
MODES = ("closed", "feed", "page")


# ------------------------------------------------------------------ load
async def one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> list[tuple[float, int]]:
    """One streamed completion: (arrival time, tokens) of each chunk that carried tokens."""
    body = {"prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    points = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])
            if n:
                points.append((time.perf_counter(), n))
    return points


def step_time(streams: list[list[tuple[float, int]]]) -> float:
    """Median over requests of seconds per token while every request decodes (module docstring)."""
    start = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    per = []
    for s in streams:
        inside = [(t, n) for t, n in s if start <= t <= end]
        tokens = sum(n for _, n in inside[1:])
        if len(inside) >= 2 and tokens:
            per.append((inside[-1][0] - inside[0][0]) / tokens)
    if len(per) < len(streams) // 2:
        raise RuntimeError(f"only {len(per)} of {len(streams)} requests decoded inside the common window")
    return statistics.median(per)


def run_batch(url: str, prompts: list[list[int]]) -> float:
    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(one(c, url, p) for p in prompts))

    return step_time(asyncio.run(go()))


# ------------------------------------------------------------------ viewers
class FeedReader:
    """Reads /dashboard/events in a thread, as a page would (counts the snapshots)."""

    def __init__(self, url: str):
        self.url, self.snapshots, self.bytes = url, 0, 0
        self.tick_ms: list[float] = []  # the feed's own wall and CPU time per tick, as it reports them
        self.tick_cpu_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with httpx.stream("GET", f"{self.url}/dashboard/events", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=None) as r:
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data:"):
                    self.snapshots += 1
                    self.bytes += len(line)
                    feed = json.loads(line[5:]).get("feed") or {}
                    if feed.get("last_tick_ms"):
                        self.tick_ms.append(feed["last_tick_ms"])
                        self.tick_cpu_ms.append(feed["last_tick_cpu_ms"])

    def close(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.snapshots


class Page:
    """/dashboard open and logged in, in headless Chromium (scripts/headless_chromium.py)."""

    def __init__(self, url: str):
        self.driver = chromium(browser_log=False)
        log_in(self.driver, url, KEY)
        self.first = snapshot_number(self.driver)

    def close(self) -> int:
        drawn = snapshot_number(self.driver) - self.first
        self.driver.quit()
        return drawn


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every mode (default 4)")
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--no-browser", action="store_true", help="leave out the page mode (no Chromium here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    modes = [m for m in MODES if not (args.no_browser and m == "page")]
    if "page" in modes and not (shutil.which("chromium") and shutil.which("chromedriver")):
        ap.error("the page mode needs Chromium and ChromeDriver (scripts/install_browser.sh), or --no-browser")

    tok = load_tokenizer("smollm2")
    corpus = corpus_ids(tok)
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:  # different content in every run: no prefix-cache hit between runs
        starts = [rng.randrange(len(corpus) - PROMPT_LEN) for _ in range(BATCH)]
        return [corpus[s:s + PROMPT_LEN] for s in starts]

    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-dashboard-") as tmp:
        srv = Service(["serve", "--device", "cpu", "--admin-api-key", KEY, "--max-num-seqs", str(BATCH),
                       "--kv-cache-memory", "1GiB"], "serve", Path(tmp), env={"PAGEDKV_LOG_LEVEL": "warning"})
        url = srv.info.get("url") or f"http://{srv.address}"
        try:
            run_batch(url, prompts())  # warm-up: first-use costs out of the measured runs
            snap = httpx.get(f"{url}/dashboard/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
            print(f"pool: {snap['pool']['total_blocks']} blocks of {snap['pool']['block_size']} tokens; "
                  f"feed scope: {snap['scope']}")
            for r in range(rounds):
                for mode in modes:
                    viewer = FeedReader(url) if mode == "feed" else Page(url) if mode == "page" else None
                    try:
                        t0 = time.perf_counter()
                        st = run_batch(url, prompts())
                        wall = time.perf_counter() - t0
                    finally:
                        seen = viewer.close() if viewer else 0
                    tick = (statistics.median(viewer.tick_ms), statistics.median(viewer.tick_cpu_ms)) if (
                        isinstance(viewer, FeedReader) and viewer.tick_ms) else (None, None)
                    runs.append({"round": r, "mode": mode, "step_s": st, "wall_s": wall, "snapshots": seen,
                                 "tick_ms": tick[0], "tick_cpu_ms": tick[1], "snapshot_bytes": (
                                     viewer.bytes // max(1, viewer.snapshots)) if isinstance(viewer, FeedReader) else None})
                    print(f"round {r} {mode:6s} step {st * 1e3:7.2f} ms  run {wall:5.1f} s  snapshots {seen}"
                          + (f"  tick {tick[0]:.1f} ms wall, {tick[1]:.1f} ms CPU" if tick[0] else ""))
        finally:
            srv.stop()

    base = statistics.median(x["step_s"] for x in runs if x["mode"] == "closed")
    rows, summary = [], {}
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        med = statistics.median(x["step_s"] for x in mine)
        paired = [x["step_s"] / c["step_s"] - 1 for x, c in zip(mine, [y for y in runs if y["mode"] == "closed"])]
        summary[mode] = {"step_ms": med * 1e3, "change": med / base - 1, "paired_change_median": statistics.median(paired),
                         "snapshots_per_run": statistics.median(x["snapshots"] for x in mine)}
        rows.append([mode, fmt(med * 1e3), fmt(100 * (med / base - 1), "+.2f"),
                     fmt(100 * statistics.median(paired), "+.2f"), fmt(min(x["step_s"] for x in mine) * 1e3),
                     fmt(max(x["step_s"] for x in mine) * 1e3), str(int(summary[mode]["snapshots_per_run"]))])
    table(f"Decode step at batch {BATCH}, pagedkv serve on CPU, {rounds} rounds (median over rounds)",
          ["mode", "step ms", "vs closed %", "paired %", "min ms", "max ms", "snapshots/run"], rows)
    write_result("bench_dashboard", {"machine": machine(), "batch": BATCH, "prompt_len": PROMPT_LEN,
                                     "output_len": OUTPUT_LEN, "rounds": rounds, "runs": runs, "summary": summary})
    plt = pyplot()
    if plt:
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode in modes:
            mine = [x for x in runs if x["mode"] == mode]
            ax.plot([x["round"] for x in mine], [x["step_s"] * 1e3 for x in mine], "o-", label=mode)
        ax.set_xlabel("round")
        ax.set_ylabel(f"decode step at batch {BATCH} (ms)")
        ax.set_title("Step time with the dashboard closed, its feed read, the page open")
        ax.legend()
        save_plot(fig, "bench_dashboard")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
