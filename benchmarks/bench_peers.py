"""Speed peer: vLLM's CPU build (``vllm serve``) against ``pagedkv serve``, same model, same trace.

Both servers run SmolLM2-135M-Instruct from the same weights (vLLM from the Hugging Face directory
that ``scripts/setup_vllm_cpu.sh`` writes from the GGUF pagedkv serves), each at float32 and at
bfloat16 (``--dtypes``), over HTTP (OpenAI completions, streamed), started and stopped in turn by
``bench_serving``'s helpers. Everything that could favour one side is the same for both:

- the trace: ``bench_serving``'s default, 48 requests (ShareGPT-like lengths x1.5, mean ~250
  prompt tokens, at most 128 output tokens), sent as token ids so both compute the same prompt
  tokens (checked against the servers' ``usage``), greedy, ``ignore_eos`` and ``max_tokens``, so
  both compute the same number of output tokens (checked);
- batch cap 32 (``--max-num-seqs``), 1 GiB of KV memory, prefix caching off; everything else is
  each server's default (vLLM's block size is 32, the smallest its CPU attention takes);
- throughput: all requests at once, after 2 unmeasured warm-up requests; output tokens / s over
  the span until the last request ends;
- single stream: the first ``--single-requests`` (4) prompts of the trace, 128 output tokens each,
  one at a time on the same server: decode tok/s = 1 / median TPOT, and the median end-to-end time.

Greedy agreement, on output token ids (``return_token_ids``): each run against its own system's
float32 run (``= own fp32``) and against vLLM's float32 run (``= vLLM fp32``): requests whose
tokens are identical (count of N) and the mean matching prefix (leading tokens equal, over the
longer of the two outputs).

The machine's load drifts, so one sitting runs every (system, dtype) in turn, the systems
alternating within each dtype (vllm fp32, pagedkv fp32, vllm bf16, pagedkv bf16), and the ratio
that counts is the one within a sitting: pagedkv / vLLM at each one's best dtype (by throughput),
and single-stream tok/s at each one's best. ``--sittings N`` repeats the cycle, every other one in
reverse order.

    make bench-peers        # scripts/setup_vllm_cpu.sh (once, ~5 min), then this (~10-15 min)
    python benchmarks/bench_peers.py [--num-requests 8 --max-output 32 --single-requests 1]

llama.cpp (llama-cpp-python, on the Q4_1 GGUF: quantized arithmetic, so a speed row only, with no
agreement) is an optional extra row of single-stream figures: ``make bench-peers
BENCH_PEERS_ARGS=--llama-cpp`` builds llama-cpp-python first (about 7 minutes on 2 cores) with
portable CPU flags, since a native build dies with "Illegal instruction" here:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python

Prints one table and the ratios, writes ``benchmarks/results/bench_peers.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import bandwidth
from bench_serving import (
    Outcome,
    Request,
    add_server_args,
    add_trace_args,
    make_requests,
    run_trace,
    started,
    summarize,
)
from common import fmt, machine, median, pyplot, save_plot, table, write_result

from compute_service.weights.source import load_model_source
from pagedkv.config import default_dtype
from pagedkv.model.checkpoint_dtype import SMOLLM2_DTYPE
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.paths import smollm2_gguf_path

SYSTEMS = ("vllm", "pagedkv")
#: The goals: pagedkv / vLLM throughput at each one's best dtype and at each one's default (``auto``)
#: dtype, single stream at each one's best, and single-stream decode as a share of the bandwidth bound.
GOAL_THROUGHPUT, GOAL_DEFAULTS, GOAL_SINGLE, GOAL_BOUND = 1.5, 1.3, 1.3, 0.6


# ---------------------------------------------------------------- agreement
def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy agreement of one run's output token ids with a reference run's, request by request.

    Returns ``identical`` (requests whose tokens equal the reference's), ``n`` (requests),
    ``mean_prefix`` (mean over requests of the matching prefix over the longer output, in [0, 1];
    two empty outputs count 1) and ``prefix_tokens`` (the matching prefix of each request).

    Raises:
        ValueError: the two runs have different numbers of requests.
    """
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} references")
    prefixes = [matching_prefix(a, b) for a, b in zip(outputs, reference)]
    fractions = [p / max(len(a), len(b)) if a or b else 1.0 for p, a, b in zip(prefixes, outputs, reference)]
    return {"identical": sum(a == b for a, b in zip(outputs, reference)), "n": len(outputs),
            "mean_prefix": sum(fractions) / len(fractions) if fractions else None, "prefix_tokens": prefixes}


def shown_agreement(a: dict | None, reference: bool = False) -> str:
    if reference:
        return "ref"
    return "-" if a is None else f"{a['identical']}/{a['n']} {100 * a['mean_prefix']:.0f}%"


# -------------------------------------------------------------------- runs
def single_stream(requests: list[Request], outcomes: list[Outcome]) -> dict:
    """Single-stream figures: decode tok/s = 1 / median TPOT, median TTFT and end-to-end (s)."""
    good = [o for o in outcomes if o.ok]
    tpot = median([o.tpot for o in good])
    return {"requests": len(requests), "completed": len(good), "output_tokens": [o.output_tokens for o in good],
            "decode_tok_s": 1.0 / tpot if tpot else None, "tpot_p50_ms": tpot and 1e3 * tpot,
            "ttft_p50_s": median([o.ttft for o in good]), "e2e_p50_s": median([o.e2e for o in good]),
            "errors": [o.error for o in outcomes if not o.ok][:5]}


def checks(requests: list[Request], outcomes: list[Outcome]) -> dict:
    """What makes the runs comparable: prompt tokens as the server counted them, output token ids."""
    return {"prompt_len_mismatches": sum(o.ok and o.prompt_tokens != r.prompt_len for r, o in zip(requests, outcomes)),
            "token_ids_mismatches": sum(o.ok and len(o.token_ids) != r.max_tokens for r, o in zip(requests, outcomes))}


def run_server(system: str, dtype: str, args, requests: list[Request], single: list[Request], log_dir: Path) -> dict:
    """Start one server, run the trace all at once, then the single-stream requests; stop it."""
    t0 = time.perf_counter()
    with started(system, dtype, args, log_dir) as url:
        start_s = time.perf_counter() - t0
        load = os.getloadavg()[0]
        outcomes, wall = asyncio.run(run_trace(url, args.model, requests, False, args.warmup, token_ids=True))
        s_outcomes, _ = asyncio.run(run_trace(url, args.model, single, False, 0, token_ids=True, sequential=True))
    run = {"system": system, "dtype": dtype, "start_s": start_s, **summarize(requests, outcomes, wall),
           **checks(requests, outcomes), "single": {**single_stream(single, s_outcomes), **checks(single, s_outcomes)},
           "load_avg_1m": [load, os.getloadavg()[0]], "tokens": [o.token_ids for o in outcomes]}
    print(
        f"{system} {dtype}: started in {start_s:.0f} s; {run['completed']}/{len(requests)} ok, "
        f"{run['output_tokens_per_s']:.1f} out tok/s; single stream {fmt(run['single']['decode_tok_s'], '.1f')} tok/s "
        f"(load {load:.1f} -> {os.getloadavg()[0]:.1f})"
    )
    for e in run["errors"] + run["single"]["errors"]:
        print(f"  {e}")
    for key in ("prompt_len_mismatches", "token_ids_mismatches", "output_len_mismatches"):
        if run[key] or run["single"].get(key):
            print(f"  warning: {key} {run[key]} (single stream {run['single'].get(key)})")
    return run


def run_llama_cpp(single: list[Request]) -> dict:
    """llama.cpp (llama-cpp-python, in this process) on the single-stream prompts, one at a time."""
    from llama_cpp import Llama

    model = Llama(
        model_path=str(smollm2_gguf_path()),
        n_ctx=1024,
        n_batch=512,
        n_threads=os.cpu_count() or 1,
        logits_all=False,
        verbose=False,
    )

    def generate(ids: list[int], n: int) -> Outcome:
        model.reset()
        out, t0, times = Outcome(), time.perf_counter(), []
        for token in model.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            out.token_ids.append(token)
            if len(times) == n:
                break
        out.ok, out.ttft, out.e2e, out.output_tokens = True, times[0] - t0, times[-1] - t0, len(times)
        return out

    generate(single[0].prompt_ids[:8], 4)  # warm up
    outcomes = [generate(r.prompt_ids, r.max_tokens) for r in single]
    return {
        "system": "llama.cpp",
        "dtype": "Q4_1",
        "single": single_stream(single, outcomes),
        "version": __import__("llama_cpp").__version__,
    }


# ------------------------------------------------------------------ verdict
def verdict(runs: dict, bound: dict | None = None) -> dict | None:
    """pagedkv / vLLM at each one's best dtype: throughput (best by throughput) and single stream;
    throughput at each one's default dtype (``auto`` on this CPU, the same rule for both); and
    pagedkv's single stream at ``bound["dtype"]`` as a share of the bandwidth bound (`bandwidth.bound`)."""
    best, single = {}, {}
    for s in runs.values():
        sys_ = s["system"]
        if s.get("completed"):
            if sys_ not in best or s["output_tokens_per_s"] > best[sys_]["output_tokens_per_s"]:
                best[sys_] = s
        tok_s = s["single"]["decode_tok_s"]
        if tok_s and (sys_ not in single or tok_s > single[sys_]["single"]["decode_tok_s"]):
            single[sys_] = s
    if not {"pagedkv", "vllm"} <= best.keys() or not {"pagedkv", "vllm"} <= single.keys():
        return None
    p, v, ps, vs = best["pagedkv"], best["vllm"], single["pagedkv"], single["vllm"]
    out = {
        "throughput": {
            "pagedkv": [p["dtype"], p["output_tokens_per_s"]],
            "vllm": [v["dtype"], v["output_tokens_per_s"]],
            "ratio": p["output_tokens_per_s"] / v["output_tokens_per_s"],
            "goal": GOAL_THROUGHPUT,
        },
        "single_stream": {
            "pagedkv": [ps["dtype"], ps["single"]["decode_tok_s"]],
            "vllm": [vs["dtype"], vs["single"]["decode_tok_s"]],
            "ratio": ps["single"]["decode_tok_s"] / vs["single"]["decode_tok_s"],
            "goal": GOAL_SINGLE,
        },
    }
    t, s = out["throughput"], out["single_stream"]

    def held(ratio, goal):
        return f"goal >= {goal}: {'holds' if ratio >= goal else 'not yet'}"

    out["text"] = (
        f"pagedkv / vLLM at each one's best dtype: throughput {t['pagedkv'][1]:.1f} ({t['pagedkv'][0]}) / "
        f"{t['vllm'][1]:.1f} ({t['vllm'][0]}) tok/s = x{t['ratio']:.2f} ({held(t['ratio'], GOAL_THROUGHPUT)}); "
        f"single stream {s['pagedkv'][1]:.1f} ({s['pagedkv'][0]}) / {s['vllm'][1]:.1f} ({s['vllm'][0]}) tok/s "
        f"= x{s['ratio']:.2f} ({held(s['ratio'], GOAL_SINGLE)})"
    )
    auto = str(default_dtype(cuda=False, checkpoint=SMOLLM2_DTYPE))
    pd, vd = runs.get(f"pagedkv {auto}"), runs.get(f"vllm {auto}")
    if pd and vd and pd.get("completed") and vd.get("completed"):
        ratio = pd["output_tokens_per_s"] / vd["output_tokens_per_s"]
        out["defaults"] = {"dtype": auto, "ratio": ratio, "goal": GOAL_DEFAULTS}
        out["text"] += f"; throughput at the defaults ({auto} for both) x{ratio:.2f} ({held(ratio, GOAL_DEFAULTS)})"
    one = runs.get(f"pagedkv {bound['dtype']}") if bound else None
    if one and one["single"]["decode_tok_s"]:
        share = one["single"]["decode_tok_s"] / bound["bound_tok_s"]
        out["bandwidth_bound"] = {**bound, "pagedkv_tok_s": one["single"]["decode_tok_s"], "share": share,
                                  "goal": GOAL_BOUND}
        out["text"] += (
            f"; single stream {one['single']['decode_tok_s']:.1f} tok/s ({bound['dtype']}) = {share:.0%} of the "
            f"bandwidth bound {bound['bound_tok_s']:.1f} tok/s ({bound['bytes_per_token'] / 1e6:.0f} MB a token at "
            f"{bound['context']} tokens of context, bandwidth copy {bound['copy_bandwidth'] / 1e9:.1f} / read "
            f"{bound['read_bandwidth'] / 1e9:.1f} GB/s; "
            f"{held(share, GOAL_BOUND)})"
        )
    return out


def add_agreement(runs: dict) -> None:
    """``vs_own_fp32`` and ``vs_vllm_fp32`` on each run of a sitting whose references completed."""

    def tokens(label):
        r = runs.get(label)
        return r["tokens"] if r and r.get("completed") == len(r["tokens"]) and not r.get("failed") else None

    for s in runs.values():
        if "tokens" not in s:
            continue
        for key, ref_label in (("vs_own_fp32", f"{s['system']} float32"), ("vs_vllm_fp32", "vllm float32")):
            ref = tokens(ref_label)
            s[key] = agreement(s["tokens"], ref) if ref is not None and not s.get("failed") else None


# --------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    who = ap.add_argument_group("systems")
    who.add_argument("--systems", default=",".join(SYSTEMS), help="vllm, pagedkv (comma-separated)")
    who.add_argument("--dtypes", default="float32,bfloat16", help="each system at each of these")
    who.add_argument("--sittings", type=int, default=1, help="repeat the whole cycle (every other one reversed)")
    who.add_argument(
        "--llama-cpp", action="store_true", help="add llama.cpp's single-stream row (needs llama-cpp-python)"
    )
    add_server_args(who, max_num_seqs=32)
    ap.set_defaults(no_prefix_caching=True)  # prefix caching off for both (the flag stays for bench_serving)
    add_trace_args(ap)
    ap.add_argument("--single-requests", type=int, default=4, help="single-stream requests, one at a time")
    ap.add_argument("--single-tokens", type=int, default=128, help="output tokens of each single-stream request")
    ap.add_argument("--result-name", default="bench_peers")
    args = ap.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(args.systems) <= set(SYSTEMS) or not args.systems:
        ap.error(f"--systems: some of {', '.join(SYSTEMS)}")
    if args.sittings < 1 or args.single_requests < 1 or args.single_tokens < 2:
        ap.error("--sittings and --single-requests must be >= 1, --single-tokens >= 2")
    if args.single_requests > args.num_requests:
        ap.error("--single-requests must be at most --num-requests")
    return args


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sitting = result["sittings"][0]["runs"]
    dtypes = list(dict.fromkeys(s["dtype"] for s in sitting.values() if s["system"] in SYSTEMS))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(SYSTEMS)
    for ax, title, value in (
        (axes[0], "throughput, output tokens / s", lambda s: s.get("output_tokens_per_s")),
        (axes[1], "single stream, decode tokens / s", lambda s: s["single"]["decode_tok_s"]),
    ):
        for i, system in enumerate(SYSTEMS):
            vals = [value(sitting.get(f"{system} {d}", {"single": {"decode_tok_s": None}})) or 0 for d in dtypes]
            ax.bar([x + i * width for x in range(len(dtypes))], vals, width, label=system)
        ax.set_xticks([x + width * (len(SYSTEMS) - 1) / 2 for x in range(len(dtypes))], dtypes)
        ax.set_title(title)
        ax.legend()
    c = result["config"]
    fig.suptitle(
        f"pagedkv serve vs vllm serve (CPU), {c['num_requests']} requests, batch cap {c['max_num_seqs']} "
        f"(sitting 1 of {len(result['sittings'])})"
    )
    save_plot(fig, name)


def main() -> int:
    args = parse_args()
    tok = load_tokenizer("smollm2")
    requests = make_requests(args, tok)
    single = [
        Request(r.prompt, r.prompt_len, args.single_tokens, 0.0, r.prompt_ids) for r in requests[: args.single_requests]
    ]
    order = [(system, dtype) for dtype in args.dtypes for system in args.systems]
    n = len(requests)
    result = {
        "machine": machine(),
        "config": {
            "num_requests": n,
            "dataset": args.dataset,
            "scale": args.scale,
            "seed": args.seed,
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_gib": args.kv_cache_gib,
            "prefix_caching": False,
            "mean_prompt_tokens": sum(r.prompt_len for r in requests) / n,
            "output_tokens": sum(r.max_tokens for r in requests),
            "single_requests": len(single),
            "single_tokens": args.single_tokens,
            "order": [" ".join(o) for o in order],
            "command": " ".join(sys.argv),
        },
        "sittings": [],
    }
    c = result["config"]
    print(
        f"{n} requests: mean prompt {c['mean_prompt_tokens']:.0f} tokens, {c['output_tokens']} output tokens; "
        f"single stream: {len(single)} x {args.single_tokens} tokens"
    )
    auto = str(default_dtype(cuda=False, checkpoint=SMOLLM2_DTYPE))
    context = round(sum(r.prompt_len for r in single) / len(single) + args.single_tokens / 2)
    config, _ = load_model_source("smollm2")
    result["bandwidth_bound"] = b = bandwidth.bound(config, auto, context)
    print(f"bandwidth: copy {b['copy_bandwidth'] / 1e9:.1f} GB/s, read {b['read_bandwidth'] / 1e9:.1f} GB/s; "
          f"a {auto} decode token reads "
          f"{b['bytes_per_token'] / 1e6:.0f} MB at {context} tokens of context: bound {b['bound_tok_s']:.1f} tok/s")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    print(f"server logs: {log_dir}")
    for k in range(args.sittings):
        runs = {}
        for system, dtype in order if k % 2 == 0 else order[::-1]:
            runs[f"{system} {dtype}"] = run_server(system, dtype, args, requests, single, log_dir)
        if args.llama_cpp:
            runs["llama.cpp Q4_1"] = run_llama_cpp(single)
        add_agreement(runs)
        result["sittings"].append({"runs": runs, "verdict": verdict(runs, result["bandwidth_bound"])})

    rows = []
    for k, sitting in enumerate(result["sittings"], 1):
        for s in sitting["runs"].values():
            one = s["single"]
            rows.append(
                [
                    *([k] if args.sittings > 1 else []),
                    s["system"],
                    s["dtype"],
                    f"{s['completed']}/{n}" if "completed" in s else "-",
                    fmt(s.get("output_tokens_per_s"), ".1f"),
                    fmt(s.get("ttft_p50_ms"), ".0f"),
                    fmt(s.get("tpot_p50_ms"), ".0f"),
                    fmt(one["decode_tok_s"], ".1f"),
                    fmt(one["e2e_p50_s"], ".2f"),
                    shown_agreement(s.get("vs_own_fp32"), s["dtype"] == "float32"),
                    shown_agreement(s.get("vs_vllm_fp32"), (s["system"], s["dtype"]) == ("vllm", "float32")),
                ]
            )
    result["table"] = table(
        f"pagedkv serve vs vllm serve, {n} requests at once (mean {c['mean_prompt_tokens']:.0f} prompt tokens, "
        f"{c['output_tokens']} output tokens), batch cap {args.max_num_seqs}, prefix caching off, greedy; "
        f"single stream: {len(single)} x {args.single_tokens} tokens; {os.cpu_count()} cores",
        [
            *(["sitting"] if args.sittings > 1 else []),
            "system",
            "dtype",
            "ok",
            "out tok/s",
            "TTFT p50 ms",
            "TPOT p50 ms",
            "1-stream tok/s",
            "1-stream e2e s",
            "= own fp32",
            "= vLLM fp32",
        ],
        rows,
    )
    print("(= ...: requests with identical greedy tokens / N, and the mean matching prefix)")
    for k, sitting in enumerate(result["sittings"], 1):
        if sitting["verdict"]:
            print(("" if args.sittings == 1 else f"sitting {k}: ") + sitting["verdict"]["text"])
    for sitting in result["sittings"]:  # the agreement figures stay; the token ids are not kept
        for s in sitting["runs"].values():
            s.pop("tokens", None)
    write_result(args.result_name, result)
    plot(result, args.result_name)
    ok = all(
        s.get("failed", 0) == 0 and s["single"]["completed"] == len(single)
        for sitting in result["sittings"]
        for s in sitting["runs"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
