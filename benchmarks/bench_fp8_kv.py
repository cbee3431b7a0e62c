"""FP8 KV cache, measured: what it holds, and what it costs in quality, on our own pool and kernels.

The pool stores keys and values in OCP float8 e4m3fn with static scales per (layer, KV head)
(``--kv-cache-dtype fp8``; vLLM's fp8 KV cache with one scale per KV head), calibrated the way a
worker does it (``compute_service.kv_calibration``: one prefill of a fixed text, amax x headroom /
448). The model's weights stay float32 throughout; only the KV cache's dtype changes:
float32 (the reference), bfloat16, fp8.

- ``capacity``: a memory service per dtype with the same ``--kv-cache-memory``; GetStats' token
  capacity and bytes per token.
- ``perplexity``: SmolLM2-135M on ``benchmarks/corpus.txt`` in windows of 512 tokens, each window
  one sequence written to the paged cache and attended through it (the worker's model and
  kernels, in this process: logits never leave it).
- ``greedy agreement``: the benchmark trace's prompts (ShareGPT-like lengths cut from the corpus,
  ``prompts.trace_prompts``), greedy decoding batched as the worker runs it, compared with the
  float32-KV run: the share of requests whose output (to the first EOS) is identical, the share
  whose first 16 tokens are, and the mean matching prefix in tokens.
- ``attention error``: per layer, the attention output of the corpus's first window with the
  layer's real queries, keys and values (captured from the float32 run) through
  ``reshape_and_cache`` + ``paged_attention`` on a cache of each dtype, against a dense float64
  attention over the unquantized keys and values: relative error ||o - ref|| / ||ref||.

    python benchmarks/bench_fp8_kv.py [--quick] [--prompts 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from common import ROOT, fmt, machine, pyplot, save_plot, table, write_result
from prompts import corpus_ids, trace_prompts

import kernels
from client.ops.stack import LocalStack
from compute_service.kv_calibration import calibrate, calibration_sequences, scale_rows
from compute_service.model.llama import LlamaForPagedLM
from compute_service.model.packed_forward import packed_forward
from compute_service.weights.source import load_model_source
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.model.tokenizer import load_tokenizer

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": kernels.FP8_DTYPE}
BLOCK = 16
WINDOW = 512
#: Tokens compared at the start of each greedy output (the end-to-end test's bound is on these).
FIRST = 16


class PagedRun:
    """One in-process paged KV pool of a dtype, and forwards of the model over it."""

    def __init__(self, model: LlamaForPagedLM, dtype: torch.dtype, num_blocks: int, scales=None):
        c = model.config
        self.model, self.scales = model, scales
        self.pool = torch.zeros(num_blocks, c.num_layers, 2, BLOCK, c.num_kv_heads, c.head_dim, dtype=dtype)
        self.next_block = 0

    def table(self, tokens: int) -> list[int]:
        """Fresh blocks for a sequence of up to ``tokens`` tokens."""
        n = -(-tokens // BLOCK)
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def forward(self, batch: list[tuple[list[int], int, list[int]]], all_rows: bool = False) -> torch.Tensor:
        """``packed_forward`` over this pool: (block table, tokens cached, new tokens) per sequence."""
        return packed_forward(self.model, self.pool, batch, self.scales, all_rows)


def perplexity(model, dtype, scales, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    run = PagedRun(model, dtype, len(windows) * (WINDOW // BLOCK), scales)
    for w in windows:
        logits = run.forward([(run.table(len(w)), 0, w)], all_rows=True)[:-1]
        target = torch.tensor(w[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += len(w) - 1
    return math.exp(nll / count)


def greedy(model, dtype, scales, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """Greedy outputs (cut after the first EOS), prefilled 8 prompts per step, decoded all at once."""
    run = PagedRun(model, dtype, sum(-(-(len(p) + max_tokens) // BLOCK) for p in prompts), scales)
    tables = [run.table(len(p) + max_tokens) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for i in range(0, len(prompts), 8):
        logits = run.forward([(tables[j], 0, prompts[j]) for j in range(i, min(i + 8, len(prompts)))])
        for j, row in enumerate(logits.argmax(-1).tolist()):
            outs[i + j].append(row)
    for _ in range(max_tokens - 1):
        logits = run.forward([(tables[j], len(p) + len(outs[j]) - 1, [outs[j][-1]]) for j, p in enumerate(prompts)])
        for j, t in enumerate(logits.argmax(-1).tolist()):
            outs[j].append(t)
    return [o[: next((i + 1 for i, t in enumerate(o) if t in eos), len(o))] for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    n = len(ref)
    return {"identical": sum(a == b for a, b in zip(ref, got)) / n,
            "first16": sum(a[:FIRST] == b[:FIRST] for a, b in zip(ref, got)) / n,
            "mean_prefix": sum(common(a, b) for a, b in zip(ref, got)) / n,
            "mean_length": sum(map(len, ref)) / n}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal float64 attention of one sequence: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    s = s.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def attention_errors(model, window: list[int], k_scale, v_scale) -> dict[str, list[float]]:
    """Per layer and KV dtype: relative error of paged attention vs dense float64 over the real q, k, v."""
    captured = []
    hooks = [layer.attn.paged.register_forward_hook(lambda m, a, o: captured.append([t.clone() for t in a[:3]]))
             for layer in model.layers]
    try:
        PagedRun(model, torch.float32, WINDOW // BLOCK).forward([(list(range(WINDOW // BLOCK)), 0, window)])
    finally:
        for h in hooks:
            h.remove()
    n = len(window)
    tables = torch.arange(-(-n // BLOCK), dtype=torch.int32)[None]
    qsl, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    plan = kernels.plan_attention(tables, qsl, lens, BLOCK)
    scale = model.config.head_dim**-0.5
    out: dict[str, list[float]] = {d: [] for d in KV_DTYPES}
    for layer, (q, k, v) in enumerate(captured):
        ref = dense_attention(q, k, v, scale)
        for name, dtype in KV_DTYPES.items():
            cache = torch.zeros(2, tables.shape[1], BLOCK, *k.shape[1:], dtype=dtype)
            kw = {"k_scale": k_scale[layer], "v_scale": v_scale[layer]} if name == "fp8" else {}
            kernels.reshape_and_cache(k, v, cache[0], cache[1], torch.arange(n), **kw)
            o = kernels.paged_attention(q.contiguous(), cache[0], cache[1], plan, scale, **kw)
            out[name].append(float((o.double() - ref).norm() / ref.norm()))
    return out


def capacity(memory: str) -> dict[str, dict]:
    """GetStats of a memory service per KV dtype, each with ``--kv-cache-memory memory``."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        for name in KV_DTYPES:
            args = ["--kv-cache-memory", memory, "--block-size", str(BLOCK), "--kv-cache-dtype", name,
                    "--admin-token-file", str(Path(tmp) / f"{name}.token")]
            with LocalStack(args, num_workers=0, name=f"fp8-{name}", cwd=ROOT, run_dir=Path(tmp)) as s:
                import grpc

                with grpc.insecure_channel(s.memory.address) as ch:
                    st = mpb_grpc.MemoryServiceStub(ch).GetStats(mpb.GetStatsRequest(), timeout=10)
            out[name] = {"token_capacity": st.token_capacity, "bytes_per_token": st.kv_bytes_per_token,
                         "blocks": st.total_blocks, "pool_bytes": st.pool_bytes, "dtype": st.kv_cache_dtype}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, 4 perplexity windows")
    ap.add_argument("--prompts", type=int, default=64, help="trace prompts for greedy agreement (default 64)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    ap.add_argument("--windows", type=int, default=0, help="perplexity windows (default: the whole corpus)")
    ap.add_argument("--memory", default="64MiB", help="--kv-cache-memory of the capacity services (default 64MiB)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.windows = 16, 32, 4
    torch.manual_seed(0)
    cap = capacity(args.memory)
    table(f"KV capacity of a {args.memory} pool (GetStats)", ["kv dtype", "bytes/token", "tokens", "x float32"],
          [[n, c["bytes_per_token"], c["token_capacity"], fmt(c["token_capacity"] / cap["float32"]["token_capacity"])]
           for n, c in cap.items()])

    config, weights = load_model_source("smollm2")
    model = LlamaForPagedLM(config, weights, "cpu", torch.float32)
    tok = load_tokenizer("smollm2")
    k_scale, v_scale = calibrate(model, calibration_sequences("smollm2"))
    scales = {"float32": None, "bfloat16": None, "fp8": scale_rows(k_scale, v_scale)}

    ids = corpus_ids(tok)
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    windows = windows[: args.windows] if args.windows else windows
    ppl = {n: perplexity(model, d, scales[n], windows) for n, d in KV_DTYPES.items()}

    prompts = [p for p, _ in trace_prompts(tok, "sharegpt", args.prompts, seed=0, max_prompt=WINDOW)]
    eos = set(config.eos_token_ids)
    outs = {n: greedy(model, d, scales[n], prompts, args.max_tokens, eos) for n, d in KV_DTYPES.items()}
    agree = {n: agreement(outs["float32"], outs[n]) for n in KV_DTYPES}
    errors = attention_errors(model, windows[0], k_scale, v_scale)

    rows = [[n, fmt(ppl[n], ".4f"), fmt(100 * (ppl[n] / ppl["float32"] - 1), "+.2f") + "%",
             fmt(100 * agree[n]["identical"], ".1f") + "%", fmt(100 * agree[n]["first16"], ".1f") + "%",
             fmt(agree[n]["mean_prefix"], ".1f"), fmt(max(errors[n]),
                                                      ".2e"), fmt(sum(errors[n]) / len(errors[n]), ".2e")]
            for n in KV_DTYPES]
    table(f"KV dtype quality, SmolLM2-135M fp32 weights ({len(windows)} windows of {WINDOW} for perplexity; "
          f"{len(prompts)} trace prompts x {args.max_tokens} greedy tokens vs the float32-KV run)",
          ["kv dtype", "perplexity", "vs fp32", "identical", f"first {FIRST}", "mean prefix", "attn err max",
           "attn err mean"], rows)
    write_result("bench_fp8_kv", {
        "machine": machine(), "args": vars(args), "capacity": cap, "perplexity": ppl, "agreement": agree,
        "attention_error_per_layer": errors, "k_scale": k_scale.tolist(), "v_scale": v_scale.tolist(),
        "windows": len(windows), "prompts": len(prompts)})

    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for n in ("bfloat16", "fp8"):
            a.semilogy(range(len(errors[n])), errors[n], marker="o", ms=3, label=f"{n} KV")
        a.set(xlabel="layer", ylabel="relative error vs float64", title="Attention output error per layer")
        a.legend()
        names = list(KV_DTYPES)
        b.bar(names, [cap[n]["token_capacity"] / 1000 for n in names], color=["#888", "#59c", "#c73"])
        b.set(ylabel=f"thousand tokens in {args.memory}", title="Capacity and perplexity")
        for i, n in enumerate(names):
            b.text(i, cap[n]["token_capacity"] / 1000, f"ppl {ppl[n]:.3f}", ha="center", va="bottom")
        save_plot(fig, "bench_fp8_kv")


if __name__ == "__main__":
    main()
