"""Speed peer: llama.cpp (llama-cpp-python) on the same GGUF and the same prompts as bench_throughput.

llama.cpp runs the Q4_1 weights with its own quantized arithmetic, so its greedy text differs from
the fp32 reference: this is a speed comparison only, never a correctness reference. Its Python API
serves one stream at a time, so it runs the requests one after another; pagedkv runs the same
requests single-stream (batch cap 1) and with continuous batching (batch cap 16, in a pool large
enough that memory is not the limit, unlike bench_throughput's budget). Same requests as
bench_throughput (ShareGPT-like lengths scaled by 0.25, greedy, exactly max_tokens new tokens each:
llama.cpp's end-of-sequence token is not honoured).

Not part of ``make bench``: ``make bench-peers`` builds llama-cpp-python first (about 7 minutes on
2 cores) with portable CPU flags, since a native build dies with "Illegal instruction" here:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python
    python benchmarks/bench_peers.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

from bench_throughput import run_policy, summarize
from common import Stack, fmt, machine, pyplot, save_plot, table, write_result
from prompts import trace_prompts

from client.reservation import Paged
from client.tokenizer import load_tokenizer
from pagedkv.paths import smollm2_gguf_path


def run_llama_cpp(prompts, threads: int) -> dict:
    from llama_cpp import Llama

    model = Llama(model_path=str(smollm2_gguf_path()), n_ctx=1024, n_batch=512, n_threads=threads,
                  logits_all=False, verbose=False)

    def generate(ids, n):
        model.reset()
        times = []
        for _ in model.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            times.append(time.time())
            if len(times) == n:
                break
        return times

    generate(prompts[0][0][:8], 4)  # warm up
    start = time.time()
    rows = []
    for ids, n in prompts:
        t0 = time.time()
        times = generate(ids, n)
        tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
        rows.append((times[0] - start, tpot, times[-1] - t0, n))
    s = summarize("llama.cpp", time.time() - start, rows, [1] * sum(n for _, n in prompts))
    s["max_batch"] = 1
    s["version"] = __import__("llama_cpp").__version__
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 requests at scale 0.2")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.num_requests or (10 if args.quick else 32)
    scale = 0.2 if args.quick else 0.25
    tok = load_tokenizer("smollm2")
    prompts = trace_prompts(tok, "sharegpt", n, args.seed, scale=scale, max_prompt=128, max_output=128)
    result = {"machine": machine(), "config": {"num_requests": n, "scale": scale}, "runs": {}}
    threads = os.cpu_count() or 1
    result["runs"]["llama.cpp (1 stream)"] = run_llama_cpp(prompts, threads)
    num_blocks = 16 * (256 // 16) + 64  # room for 16 requests of the trace's longest shape: memory is not the limit
    with Stack(["--num-blocks", str(num_blocks), "--block-size", "16", "--no-prefix-caching"], "peers") as stack:
        for cap in (1, 16):
            ns = argparse.Namespace(max_num_seqs=cap, orca_max_len=256)
            s, _ = run_policy(stack, tok, prompts, Paged(), ns)
            result["runs"][f"pagedkv (batch cap {cap})"] = s
    rows = [[k, f"{s['requests_per_s']:.3f}", f"{s['output_tokens_per_s']:.1f}", fmt(s["mean_batch"], ".1f"),
             fmt(s["ttft_median_s"]), fmt(s["tpot_median_s"] and 1e3 * s["tpot_median_s"], ".0f"), f"{s['wall_s']:.1f}"]
            for k, s in result["runs"].items()]
    table(f"Speed peers, {n} requests, same GGUF, {threads} threads",
          ["system", "req/s", "out tok/s", "mean batch", "TTFT p50 s", "TPOT p50 ms", "wall s"], rows)
    write_result("bench_peers", result)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.bar(list(result["runs"]), [s["output_tokens_per_s"] for s in result["runs"].values()])
        ax.set_ylabel("output tokens / s")
        ax.set_title("Speed peers (same prompts, same GGUF)")
        save_plot(fig, "bench_peers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
