"""Serving measured by vLLM's own client: ``vllm bench serve`` against ``pagedkv serve`` and ``vllm serve``.

`bench_serving.py --client vllm-bench` runs this: each system is started in turn (``bench_serving``'s
helpers: same model, KV memory, batch cap, served name; prefix caching off), and vLLM's benchmark
client, from vLLM's virtual environment, sends the same workload to each: its ``random`` dataset
(``--random-input-len`` 256 / ``--random-output-len`` 128 tokens by default, fixed seed), 64 prompts,
``--ignore-eos``, streamed OpenAI completions, once per request rate (``inf``: all at once; then 2
requests/s, Poisson arrivals). The figures are the client's own (its saved JSON result): output
tokens/s, TTFT and TPOT at p50 and p99, completed requests.

The goal checked: pagedkv's output throughput >= 1.3x vLLM's at rate inf, and at 2 requests/s
pagedkv's TTFT p99 and TPOT p50 no worse than vLLM's.

    make bench-serving BENCH_SERVING_ARGS="--client vllm-bench"
    python benchmarks/bench_serving.py --client vllm-bench --rates inf,2 --num-prompts 64
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from common import fmt, machine, pyplot, save_plot, table, write_result

#: The goals: throughput ratio at rate inf; at a finite rate, pagedkv's latencies no worse than vLLM's.
GOAL_THROUGHPUT = 1.3
#: (JSON key of vLLM's result, column) of the figures kept.
FIGURES = (
    ("completed", "ok"),
    ("output_throughput", "out tok/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)


def add_args(ap) -> None:
    """The flags of this mode (`bench_serving.parse_args` adds them)."""
    g = ap.add_argument_group("--client vllm-bench (vLLM's own benchmark client)")
    g.add_argument("--rates", default="inf,2", help="request rates, one client run each (req/s; inf: all at once)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--bench-dtype", default="bfloat16", help="both servers' dtype")


def run_client(url: str, rate: str, args, out_dir: Path, label: str) -> dict:
    """One ``vllm bench serve`` run against ``url`` at ``rate``; its figures (`FIGURES`) and the raw result.

    Raises:
        RuntimeError: the client failed or wrote no result (its output's tail in the message).
    """
    from bench_serving import VLLM_CLI  # the CLI shim vllm serve uses too

    exe = Path(args.vllm_venv) / "bin" / "python"
    name = f"{label.replace(' ', '-')}-rate-{rate}.json"
    cmd = [
        str(exe), "-c", VLLM_CLI, "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", args.model, "--tokenizer", str(args.hf_dir),
        "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", rate, "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
    ]  # fmt: skip
    print(f"  vllm bench serve --request-rate {rate} ({args.num_prompts} prompts)")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out_dir, timeout=3600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    path = out_dir / name
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    raw = json.loads(path.read_text())
    return {key: raw.get(key) for key, _ in FIGURES} | {"failed": args.num_prompts - (raw.get("completed") or 0)}


def verdict(runs: dict, rates: list[str]) -> dict | None:
    """The goal, from the runs of both systems (keys "pagedkv RATE", "vllm RATE")."""
    out, text = {}, []
    if "inf" in rates and {"pagedkv inf", "vllm inf"} <= runs.keys():
        ratio = runs["pagedkv inf"]["output_throughput"] / runs["vllm inf"]["output_throughput"]
        out["throughput_inf"] = {"ratio": ratio, "goal": GOAL_THROUGHPUT, "holds": ratio >= GOAL_THROUGHPUT}
        text.append(f"throughput at rate inf x{ratio:.2f} (goal >= {GOAL_THROUGHPUT}: "
                    f"{'holds' if ratio >= GOAL_THROUGHPUT else 'not yet'})")
    for rate in (r for r in rates if r != "inf"):
        p, v = runs.get(f"pagedkv {rate}"), runs.get(f"vllm {rate}")
        if not p or not v:
            continue
        holds = p["p99_ttft_ms"] <= v["p99_ttft_ms"] and p["p50_tpot_ms"] <= v["p50_tpot_ms"]
        out[f"latency_{rate}"] = {"holds": holds}
        text.append(f"at {rate} req/s TTFT p99 {p['p99_ttft_ms']:.0f} vs {v['p99_ttft_ms']:.0f} ms, TPOT p50 "
                    f"{p['p50_tpot_ms']:.1f} vs {v['p50_tpot_ms']:.1f} ms (goal: no worse: "
                    f"{'holds' if holds else 'not yet'})")
    if not text:
        return None
    out["text"] = "pagedkv / vLLM by vllm bench serve: " + "; ".join(text)
    return out


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs, rates = result["runs"], result["config"]["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, title in ((axes[0], "output_throughput", "output tokens / s"),
                           (axes[1], "p99_ttft_ms", "TTFT p99 (ms)"), (axes[2], "p50_tpot_ms", "TPOT p50 (ms)")):
        for i, system in enumerate(("pagedkv", "vllm")):
            vals = [(runs.get(f"{system} {r}") or {}).get(key) or 0 for r in rates]
            ax.bar([x + i * 0.4 for x in range(len(rates))], vals, 0.4, label=system)
        ax.set_xticks([x + 0.2 for x in range(len(rates))], [f"rate {r}" for r in rates])
        ax.set_title(title)
        ax.legend()
    c = result["config"]
    fig.suptitle(f"vllm bench serve: {c['num_prompts']} random prompts {c['input_len']} in / {c['output_len']} out, "
                 f"{c['dtype']}, batch cap {c['max_num_seqs']}")
    save_plot(fig, name)


def main(args) -> int:
    """Every system of ``args.systems`` at ``args.bench_dtype``, each client rate in turn; prints the table
    and the verdict, writes the result. Returns 0 when every request of every run completed."""
    from bench_serving import started

    from pagedkv.runtime.paths import pagedkv_home

    rates = [r for r in args.rates.split(",") if r]
    systems = [s for s in (args.systems or "pagedkv,vllm").split(",") if s]
    args.hf_dir = Path(args.vllm_model_dir or pagedkv_home() / "smollm2-hf")
    args.no_prefix_caching = True
    result = {
        "machine": machine(),
        "config": {"client": "vllm bench serve", "rates": rates, "num_prompts": args.num_prompts,
                   "input_len": args.random_input_len, "output_len": args.random_output_len,
                   "dtype": args.bench_dtype, "max_num_seqs": args.max_num_seqs, "prefix_caching": False,
                   "kv_cache_gib": args.kv_cache_gib, "date": time.strftime("%Y-%m-%d")},
        "runs": {},
    }
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-client-"))
    print(f"server logs and client results: {log_dir}")
    for system in systems:
        with started(system, args.bench_dtype, args, log_dir) as url:
            for rate in rates:
                result["runs"][f"{system} {rate}"] = {"system": system, "rate": rate,
                                                      **run_client(url, rate, args, log_dir, system)}
    rows = [[s["system"], s["rate"], *(fmt(s[k], ".0f" if k == "completed" else ".1f") for k, _ in FIGURES)]
            for s in result["runs"].values()]
    result["table"] = table(
        f"vllm bench serve: {args.num_prompts} random prompts ({args.random_input_len} in / {args.random_output_len} "
        f"out, ignore_eos), {args.bench_dtype}, batch cap {args.max_num_seqs}, prefix caching off, "
        f"{os.cpu_count()} cores",
        ["system", "rate", *(c for _, c in FIGURES)], rows)
    result["verdict"] = verdict(result["runs"], rates)
    if result["verdict"]:
        print(result["verdict"]["text"])
    write_result(args.result_name, result)
    plot(result, args.result_name)
    return 0 if all(s["failed"] == 0 for s in result["runs"].values()) else 1
