"""Decode steps eager vs in CUDA graphs, on the GPU: per-token latency at batch 1, throughput at 64.

Two models with seeded random weights, bf16, on a plain CUDA pool (the kernels and the forward a
worker runs; no services): a SmolLM2-135M-shaped model (30 layers, 9/3 heads of 64, vocabulary
49152) and one Llama-3-8B-shaped layer (32/8 heads of 128, hidden 4096, SwiGLU 14336, vocabulary
128256). Each decode step (every sequence at the same context, blocks shuffled over the pool)
runs twice:

- **eager**: the worker's eager path, ``model(*inputs.model_args(pool))``, autotuned kernels;
- **graphs**: `compute_service.model.decode_graphs.DecodeGraphs`, the step copied into its
  bucket and the captured graph replayed.

Times are wall-clock per step (launch to completion: the host's launch cost is the point), median
of ``--reps`` after a warm-up. Both paths' greedy tokens must agree (they differ only in the
decode kernel's tuning candidate, so the logits agree to bf16 rounding, not bit for bit).

    python benchmarks/bench_decode_graphs.py [--quick] [--reps 30]

Prints a table, writes benchmarks/results/bench_decode_graphs.json and a plot. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import fmt, machine, pyplot, save_plot, table, write_result

from compute_service.model.decode_graphs import DecodeGraphs
from compute_service.model.llama import LlamaForPagedLM
from compute_service.step_inputs import build_step_inputs
from compute_service.weights.source import ModelConfig
from pagedkv.compute.v1 import compute_service_pb2 as pb

BLOCK = 16
#: name -> (layers, hidden, intermediate, q heads, kv heads, head_dim, vocabulary)
SHAPES = {
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152),
    "llama3-8b 1 layer": (1, 4096, 14336, 32, 8, 128, 128256),
}


def random_model(name: str, device: str) -> LlamaForPagedLM:
    """A model of ``SHAPES[name]`` with seeded N(0, 0.02) weights (norms 1), bf16 on ``device``."""
    layers, d, inter, hq, hkv, dh, vocab = SHAPES[name]
    c = ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_layers=layers, num_q_heads=hq,
                    num_kv_heads=hkv, head_dim=dh, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                    max_position_embeddings=16384, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(),
                    name=name, source="random")
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"embed": (vocab, d), "norm": (d,)}
    for i in range(layers):
        shapes |= {f"layers.{i}.{k}": s for k, s in {
            "attn_norm": (d,), "wq": (hq * dh, d), "wk": (hkv * dh, d), "wv": (hkv * dh, d), "wo": (d, hq * dh),
            "mlp_norm": (d,), "w_gate": (inter, d), "w_up": (inter, d), "w_down": (d, inter)}.items()}  # fmt: skip
    weights = {k: (torch.ones(s, device=device) if len(s) == 1 else
                   torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) * 0.02) for k, s in shapes.items()}
    return LlamaForPagedLM(c, weights, device, torch.bfloat16)


def decode_request(seqs: int, context: int, vocab: int, num_blocks: int) -> pb.StepRequest:
    """A decode step: ``seqs`` sequences at ``context`` tokens each, blocks shuffled over the pool."""
    per = -(-context // BLOCK)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    return pb.StepRequest(sequences=[
        pb.StepSequence(seq_id=i, token_ids=[(i * 31) % vocab], positions=[context - 1],
                        block_ids=order[i * per:(i + 1) * per], output_index=0) for i in range(seqs)])


def wall(fn, reps: int) -> float:
    """Median wall seconds of ``fn`` to completion on the device, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bench(name: str, batches: list[int], contexts: list[int], reps: int) -> list[dict]:
    model = random_model(name, "cuda")
    c = model.config
    rows = []
    num_blocks = max(batches) * -(-max(contexts) // BLOCK) + 8
    pool = torch.randn(num_blocks, c.num_layers, 2, BLOCK, c.num_kv_heads, c.head_dim, device="cuda",
                       dtype=torch.bfloat16)
    graphs = DecodeGraphs(model, pool, max_size=max(batches), max_blocks=-(-max(contexts) // BLOCK))
    capture_s = graphs.capture_all()
    for seqs in batches:
        for ctx in contexts:
            request = decode_request(seqs, ctx, c.vocab_size, num_blocks)

            def inputs(request=request):
                return build_step_inputs(request, block_size=BLOCK, num_blocks=num_blocks, vocab_size=c.vocab_size,
                                         device="cuda")

            def eager(inputs=inputs):
                return model(*inputs().model_args(pool))

            def replay(inputs=inputs):
                return graphs.run(inputs())

            same = bool(torch.equal(eager().argmax(-1), replay().argmax(-1)))
            t_eager, t_graph = wall(eager, reps), wall(replay, reps)
            rows.append({"model": name, "seqs": seqs, "context": ctx, "eager_ms": t_eager * 1e3,
                         "graphs_ms": t_graph * 1e3, "speedup": t_eager / t_graph,
                         "eager_tok_s": seqs / t_eager, "graphs_tok_s": seqs / t_graph, "greedy_equal": same,
                         "capture_s": capture_s})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="context 1024 only")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_graphs needs a CUDA device (CUDA graphs); nothing measured", file=sys.stderr)
        return []
    contexts = [1024] if args.quick else [1024, 4096]
    rows = []
    for m in args.models:
        rows += bench(m, [1, 64], contexts, args.reps)
        torch.cuda.empty_cache()  # the model, pool and graphs of the last are gone
    table(f"Decode step, eager vs CUDA graphs ({torch.cuda.get_device_name()}, bf16)",
                ["model", "seqs", "context", "eager ms", "graphs ms", "speedup", "eager tok/s", "graphs tok/s",
                 "greedy equal"],
                [[r["model"], r["seqs"], r["context"], fmt(r["eager_ms"], ".3f"), fmt(r["graphs_ms"], ".3f"),
                  fmt(r["speedup"]), fmt(r["eager_tok_s"], ".0f"), fmt(r["graphs_tok_s"], ".0f"), r["greedy_equal"]]
                 for r in rows])
    write_result("bench_decode_graphs", {"machine": machine(), "rows": rows})
    plt = pyplot()
    if plt is not None and rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['model']}\nb{r['seqs']} ctx{r['context']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["eager_ms"] for r in rows], 0.4, label="eager")
        ax.bar([i + 0.2 for i in x], [r["graphs_ms"] for r in rows], 0.4, label="CUDA graphs")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("ms per decode step")
        ax.legend()
        save_plot(fig, "bench_decode_graphs")
    return rows


if __name__ == "__main__":
    main()
