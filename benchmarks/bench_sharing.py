"""KV blocks saved by copy-on-write sharing: parallel sampling and beam search (the vLLM paper, §6.3).

Real model through the services: each configuration runs a few prompts with parallel sampling
(n = 2, 4, 6; temperature 0.8, fixed seed) or beam search (width 2, 4, 6). After every engine
step the memory service's ListSequences for the engine's lease gives every live sequence's block
table; the blocks without sharing would be the sum of each sequence's blocks, the blocks in use
are the unique block ids. Saving = 1 - unique / sum, averaged over steps weighted by the blocks
a no-sharing system would hold (the paper's "memory saving"), beside the paper's figures
(OPT-13B on Alpaca: 6.1-9.8% parallel sampling, 37.6-55.2% beam search; ShareGPT: 16.2-30.5% and
44.3-66.3%).

Prompts: cut from the project's docs with Alpaca-like and ShareGPT-like lengths (the paper's
means, log-normal); outputs are capped at ``--max-tokens`` (64; 24 with ``--quick``) so the run
fits a few minutes on CPU: shorter outputs than the paper's mean favour sharing (the shared prompt
is a larger share of each sequence), so the ShareGPT-like figures are an upper estimate for these
prompts. Block size 16, prefix caching off (sharing here comes from forks only).

    python benchmarks/bench_sharing.py [--quick]
"""

from __future__ import annotations

import argparse
import collections

from common import Stack, machine, pyplot, save_plot, table, write_result
from prompts import trace_prompts

from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from pagedkv.model.tokenizer import load_tokenizer

PAPER = {("alpaca", "parallel"): (6.1, 9.8), ("alpaca", "beam"): (37.6, 55.2),
         ("sharegpt", "parallel"): (16.2, 30.5), ("sharegpt", "beam"): (44.3, 66.3)}


def measure(stack: Stack, tok, prompts, kind: str, width: int, max_tokens: int, seed: int) -> dict:
    """Run ``prompts`` together; per-step unique vs summed blocks of the engine's lease."""
    engine = stack.engine(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024), tok)
    try:
        lease = engine.lease.lease_id
        for i, (ids, _) in enumerate(prompts):
            if kind == "parallel":
                p = SamplingParams(n=width, temperature=0.8, seed=seed + 100 * i, max_tokens=max_tokens,
                                   ignore_eos=True)
            else:
                p = SamplingParams(num_beams=width, max_tokens=max_tokens)
            engine.add(Request(ids, ids, p))
        unique_sum = total_sum = 0
        per_step = []
        while engine.has_work():
            engine.step()
            seqs = engine.memory.sequences(lease)
            total = sum(len(s.block_ids) for s in seqs)
            unique = len({b for s in seqs for b in s.block_ids})
            if total:
                per_step.append(1 - unique / total)
                unique_sum += unique
                total_sum += total
        return {"saving": 1 - unique_sum / total_sum if total_sum else 0.0, "steps": len(per_step),
                "peak_saving": max(per_step, default=0.0), "per_step": per_step}
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 prompts per dataset, 24 new tokens, widths 2 and 6")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default 3; quick 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per sequence (default 64; quick 24)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n_prompts = args.num_prompts or (2 if args.quick else 3)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    widths = (2, 6) if args.quick else (2, 4, 6)
    tok = load_tokenizer("smollm2")
    result = {"machine": machine(), "config": {"num_prompts": n_prompts, "max_tokens": max_tokens, "widths": widths,
                                               "block_size": 16, "temperature": 0.8}, "runs": [], "paper": {
        f"{d}/{k}": v for (d, k), v in PAPER.items()}}
    curves = {}
    with Stack(["--num-blocks", "4096", "--block-size", "16", "--no-prefix-caching"], "sharing") as stack:
        for dataset in ("alpaca", "sharegpt"):
            prompts = trace_prompts(tok, dataset, n_prompts, args.seed, max_prompt=512)
            mean_prompt = sum(len(p) for p, _ in prompts) / len(prompts)
            for kind in ("parallel", "beam"):
                for w in widths:
                    r = measure(stack, tok, prompts, kind, w, max_tokens, args.seed)
                    curves[(dataset, kind, w)] = r.pop("per_step")
                    r.update(dataset=dataset, kind=kind, width=w, mean_prompt=mean_prompt)
                    result["runs"].append(r)
                    print(f"  {dataset:<9} {kind:<9} {w}  saving {100 * r['saving']:5.1f}%", flush=True)
    rows = []
    by = collections.defaultdict(list)
    for r in result["runs"]:
        lo, hi = PAPER[(r["dataset"], r["kind"])]
        by[(r["dataset"], r["kind"])].append(100 * r["saving"])
        rows.append([r["dataset"], "parallel sampling" if r["kind"] == "parallel" else "beam search", r["width"],
                     f"{r['mean_prompt']:.0f}", f"{100 * r['saving']:.1f}", f"{100 * r['peak_saving']:.1f}",
                     f"{lo}-{hi}"])
    table(f"KV blocks saved by sharing (block size 16, {max_tokens} new tokens, {n_prompts} prompts per run)",
          ["dataset", "kind", "width", "prompt tok", "saved % (avg)", "peak %", "paper %"], rows)
    result["summary"] = {f"{d}/{k}": {"measured_range": [min(v), max(v)], "paper_range": list(PAPER[(d, k)])}
                         for (d, k), v in by.items()}
    write_result("bench_sharing", result)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, dataset in zip(axes, ("alpaca", "sharegpt")):
            for kind, color in (("parallel", "tab:blue"), ("beam", "tab:red")):
                xs = [r["width"] for r in result["runs"] if r["dataset"] == dataset and r["kind"] == kind]
                ys = [100 * r["saving"] for r in result["runs"] if r["dataset"] == dataset and r["kind"] == kind]
                ax.plot(xs, ys, "o-", color=color, label=f"{kind} (measured)")
                lo, hi = PAPER[(dataset, kind)]
                ax.axhspan(lo, hi, color=color, alpha=0.15, label=f"{kind} (paper, OPT-13B)")
            ax.set_xlabel("n / beam width")
            ax.set_ylabel("KV blocks saved %")
            ax.set_title(f"{dataset}-like prompts")
            ax.legend(fontsize=8)
        save_plot(fig, "bench_sharing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
