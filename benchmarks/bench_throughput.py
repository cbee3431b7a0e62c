"""Throughput under one fixed KV budget, real model through the services (the vLLM paper, §6.2).

The same requests run four ways on SmolLM2-135M on this CPU (or, with ``--device cuda``, a GPU):

- ``pagedkv``: continuous batching with blocks on demand (client.engine.reservation.Paged, the default);
- ``orca-max``: the same services and scheduler, but each request reserves ``--orca-max-len``
  tokens of contiguous KV at admission (the paper's Orca-Max);
- ``orca-oracle``: each request reserves exactly prompt + max_tokens (Orca-Oracle);
- ``hf-generate``: Hugging Face transformers ``generate`` (dense cache, greedy, fp32) in static
  batches of the same max batch, in arrival order; a batch runs until its longest request is
  done, and only the tokens each request asked for are counted.

Requests: ``--num-requests`` prompts cut from the project's docs with ShareGPT-like length shape
(log-normal, the paper's means 161 / 338) scaled by ``--scale`` (default 0.25, so mean ~40 prompt
/ ~85 output tokens: the paper's lengths do not fit a few minutes on 2 CPU cores), prompt <=
``--max-prompt`` (128) and output <= ``--max-output`` (128) tokens; greedy, ignore_eos, so every
policy computes the same tokens. All requests arrive at t = 0 (offline throughput); TTFT therefore
includes queueing.

Budget (documented, not tuned per policy): the pool holds ``--max-num-seqs`` (16) requests of
the trace's mean final length, i.e. just enough for pagedkv to run its batch cap on an average
mix. Paged runs can still preempt when long requests meet. ``--orca-max-len`` (default
``--max-prompt`` + ``--max-output``, 256) is the largest prompt + output the trace allows, not the
model's 8192-token context: reserving 8192 would be the flattering choice. The paper's own setting,
full ShareGPT lengths in sequences of at most 2048 tokens with Orca-Max reserving 2048, is
``--paper`` (``--scale 1 --max-prompt 1024 --max-output 1024``; ``make bench-paper`` adds
``--skip-hf``: about 10 minutes on 2 CPU cores). The memory service runs with prefix caching off,
so no policy reuses another's prompts. ``--threads`` sets the torch threads of the worker and of
the transformers run alike (default: torch's default, one per core); when other jobs load the
machine, OpenMP threads that spin on oversubscribed cores slow both a lot, and 1 is fairer.

Goals (issue 7): pagedkv >= 2x the contiguous policy's throughput under the same budget, and
ahead of transformers generate at equal batch.

    python benchmarks/bench_throughput.py [--quick] [--num-requests 32] [--skip-hf]
    python benchmarks/bench_throughput.py --device cuda [--model DIR]   # on a GPU node

``--model`` takes any model source the services take ("smollm2", a .gguf file, a Hugging Face
directory); its tokenizer cuts the prompts. On a GPU the KV pool and the transformers baseline
are bfloat16 (the services' default there); on CPU both are fp32.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import (
    DATASETS,
    Stack,
    fmt,
    machine,
    median,
    pct,
    pyplot,
    run_engine,
    save_plot,
    table,
    write_result,
)
from prompts import trace_prompts

from client.engine.reservation import OrcaMax, OrcaOracle, Paged, ReservationPolicy
from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from pagedkv.model.tokenizer import load_tokenizer

#: Policy name -> the reservation policy of a run, from the parsed arguments.
POLICIES = {"pagedkv": lambda args: Paged(), "orca-max": lambda args: OrcaMax(args.orca_max_len),
            "orca-oracle": lambda args: OrcaOracle()}


def summarize(name: str, wall: float, reqs: list[tuple[float, float, float, int]], batches: list[int]) -> dict:
    """``reqs``: (ttft, tpot, e2e, output tokens) per request; ``batches``: requests per decode step."""
    out_tokens = sum(r[3] for r in reqs)
    return {"policy": name, "wall_s": wall, "requests_per_s": len(reqs) / wall,
            "output_tokens_per_s": out_tokens / wall,
            "mean_batch": sum(batches) / len(batches) if batches else None,
            "ttft_median_s": median([r[0] for r in reqs]), "ttft_p99_s": pct([r[0] for r in reqs], 0.99),
            "tpot_median_s": median([r[1] for r in reqs]), "tpot_p99_s": pct([r[1] for r in reqs], 0.99),
            "e2e_median_s": median([r[2] for r in reqs]), "output_tokens": out_tokens}


def run_policy(stack: Stack, tok, prompts, policy: ReservationPolicy, args) -> tuple[dict, dict]:
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512, reservation=policy)
    engine = stack.engine(cfg, tok)
    try:
        w = prompts[0][0][:8]
        run_engine(engine, [Request(w, w, SamplingParams(max_tokens=4, temperature=0))])  # warm up
        engine.traces.clear()
        preempt0 = engine.preemptions
        reqs = [Request(ids, ids, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)) for ids, o in prompts]
        wall = run_engine(engine, reqs)
        for r in reqs:
            assert r.error is None, r.error
            assert len(r.seqs[0].generated) == r.params.max_tokens
        rows = [(r.metrics.ttft, r.metrics.tpot(r.params.max_tokens), r.metrics.finished - r.metrics.arrival,
                 r.params.max_tokens) for r in reqs]
        # Batch size of steps that decode (one token per running request); prefill-only steps excluded.
        batches = [len(t.request_ids) for t in engine.traces]
        s = summarize(policy.name, wall, rows, batches)
        s["max_batch"] = max(batches)
        s["preemptions"] = engine.preemptions - preempt0
        s["steps"] = len(engine.traces)
        s["model_seconds"] = sum(t.model_seconds for t in engine.traces)
        series = {"t": [t.step for t in engine.traces], "batch": batches}
        return s, series
    finally:
        engine.close()


def run_hf(prompts, args, pad_id: int) -> dict:
    """transformers generate, static batches of ``max_num_seqs`` in order, left padding, greedy."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    from pagedkv.runtime.paths import smollm2_gguf_path

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    source = smollm2_gguf_path() if args.model == "smollm2" else Path(args.model)
    if source.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model.to(device).eval()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_s = time.perf_counter() - t0

    class Clock(StoppingCriteria):
        """Records when each generated token of the batch is ready."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.time())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(batch):
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        m = max(o for _, o in batch)
        clock = Clock()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                                 do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]))
        assert out.shape[1] == width + m
        return clock.times

    generate([(prompts[0][0][:8], 4)])  # warm up
    start = time.time()
    rows, batches = [], []
    for i in range(0, len(prompts), args.max_num_seqs):
        batch = prompts[i:i + args.max_num_seqs]
        times = generate(batch)
        for _, o in batch:
            # A request is done when its own token o is out (it cannot leave the batch earlier).
            tpot = (times[o - 1] - times[0]) / (o - 1) if o > 1 else None
            rows.append((times[0] - start, tpot, times[o - 1] - start, o))
        batches += [len(batch)] * len(times)
    wall = time.time() - start
    s = summarize("hf-generate", wall, rows, batches)
    s["max_batch"] = max(batches)
    s["load_s"] = load_s
    s["computed_tokens"] = sum(len(b) * max(o for _, o in b) for b in
                               (prompts[i:i + args.max_num_seqs] for i in range(0, len(prompts), args.max_num_seqs)))
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 requests at scale 0.2")
    ap.add_argument("--num-requests", type=int, default=None, help="requests (default 32; quick 10)")
    ap.add_argument("--scale", type=float, default=None,
                    help="length scale vs the paper's ShareGPT means (default 0.25; quick 0.2; --paper 1)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="batch cap for every policy and HF's static batch")
    ap.add_argument("--max-prompt", type=int, default=None,
                    help="prompt length cap, tokens (default 128; --paper 1024)")
    ap.add_argument("--max-output", type=int, default=None,
                    help="output length cap, tokens (default 128; --paper 1024)")
    ap.add_argument("--paper", action="store_true",
                    help="the vLLM paper's setting: full lengths, sequences <= 2048 tokens, Orca-Max reserving 2048")
    ap.add_argument("--orca-max-len", type=int, default=None,
                    help="tokens orca-max reserves per request (default max-prompt + max-output)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="pool size (default: max_num_seqs x mean final length)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the worker and of transformers")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the services' and transformers' device")
    ap.add_argument("--model", default="smollm2",
                    help="model source: 'smollm2', a .gguf file or a Hugging Face directory")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="policies to run, in this order (comma-separated; default all: %(default)s)")
    ap.add_argument("--result-name", default="bench_throughput",
                    help="results file stem (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    cap = 1024 if args.paper else 128
    args.max_prompt = cap if args.max_prompt is None else args.max_prompt
    args.max_output = cap if args.max_output is None else args.max_output
    if args.max_prompt < 4 or args.max_output < 2:
        ap.error("--max-prompt must be >= 4 and --max-output >= 2 (the trace's shortest request)")
    if (args.num_requests is not None and args.num_requests < 1) or (args.scale is not None and args.scale <= 0):
        ap.error("--num-requests must be >= 1 and --scale > 0")
    if not args.result_name or Path(args.result_name).name != args.result_name:
        ap.error(f"--result-name is a file stem, not a path: {args.result_name!r}")
    if args.orca_max_len is None:
        args.orca_max_len = args.max_prompt + args.max_output
    if args.orca_max_len < 1:
        ap.error("--orca-max-len must be >= 1")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not policies or any(x not in POLICIES for x in policies):
        ap.error(f"--policies takes a comma-separated subset of {', '.join(POLICIES)}, got {args.policies!r}")
    n = args.num_requests or (10 if args.quick else 32)
    scale = args.scale or (1.0 if args.paper else 0.2 if args.quick else 0.25)

    tok = load_tokenizer(args.model)
    prompts = trace_prompts(tok, "sharegpt", n, args.seed, scale=scale, max_prompt=args.max_prompt,
                            max_output=args.max_output)
    mean_final = sum(len(p) + o for p, o in prompts) / len(prompts)
    num_blocks = args.num_blocks or -(-round(args.max_num_seqs * mean_final) // args.block_size)
    budget = num_blocks * args.block_size
    print(f"{n} requests, mean prompt {sum(len(p) for p, _ in prompts) / n:.0f} / output "
          f"{sum(o for _, o in prompts) / n:.0f} tokens; KV budget {num_blocks} blocks x {args.block_size} = {budget} "
          f"tokens; batch cap {args.max_num_seqs}; orca-max reserves {args.orca_max_len}", flush=True)
    result = {
        "machine": machine(),
        "config": {
            "num_requests": n,
            "scale": scale,
            "dataset_means": DATASETS["sharegpt"],
            "max_num_seqs": args.max_num_seqs,
            "orca_max_len": args.orca_max_len,
            "block_size": args.block_size,
            "num_blocks": num_blocks,
            "budget_tokens": budget,
            "threads": args.threads,
            "device": args.device,
            "model": args.model,
            "max_prompt": args.max_prompt,
            "max_output": args.max_output,
            "prompt_lens": [len(p) for p, _ in prompts],
            "output_lens": [o for _, o in prompts],
        },
        "runs": {},
    }
    series = {}
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the worker process inherits it
    with Stack(
        ["--num-blocks", str(num_blocks), "--block-size", str(args.block_size), "--no-prefix-caching"],
        "throughput",
        device=args.device,
        model=args.model,
    ) as stack:
        for name in policies:
            s, series[name] = run_policy(stack, tok, prompts, POLICIES[name](args), args)
            result["runs"][name] = s
            print(
                f"  {name:<12} {s['wall_s']:7.1f} s  {s['output_tokens_per_s']:7.1f} tok/s  mean batch "
                f"{s['mean_batch']:.1f}",
                flush=True,
            )
    if not args.skip_hf:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        s = run_hf(prompts, args, pad)
        result["runs"]["hf-generate"] = s
        print(f"  {'hf-generate':<12} {s['wall_s']:7.1f} s  {s['output_tokens_per_s']:7.1f} tok/s", flush=True)
    rows = []
    for name, s in result["runs"].items():
        rows.append(
            [
                name,
                f"{s['requests_per_s']:.3f}",
                f"{s['output_tokens_per_s']:.1f}",
                fmt(s["mean_batch"], ".1f"),
                s["max_batch"],
                fmt(s["ttft_median_s"]),
                fmt(s["ttft_p99_s"]),
                fmt(s["tpot_median_s"] and 1e3 * s["tpot_median_s"], ".0f"),
                fmt(s["tpot_p99_s"] and 1e3 * s["tpot_p99_s"], ".0f"),
                s.get("preemptions", "-"),
                f"{s['wall_s']:.1f}",
            ]
        )
    where = (
        f"{result['machine']['cores']} CPU cores, fp32"
        if args.device == "cpu"
        else f"{result['machine'].get('gpu') or args.device}, bf16"
    )
    model_name = "SmolLM2-135M" if args.model == "smollm2" else Path(args.model).name
    table(
        f"Throughput, {n} ShareGPT-like requests (scale {scale}), KV budget {budget} tokens, batch cap "
        f"{args.max_num_seqs}, {model_name} on {where}",
        [
            "policy",
            "req/s",
            "out tok/s",
            "mean batch",
            "max batch",
            "TTFT p50 s",
            "TTFT p99 s",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "preempt",
            "wall s",
        ],
        rows,
    )
    runs = result["runs"]
    goals = {}
    paged = runs["pagedkv"]["output_tokens_per_s"] if "pagedkv" in runs else None
    print()
    for other in ("orca-max", "orca-oracle"):
        if paged and other in runs:
            goals[f"vs_{other.replace('-', '_')}"] = ratio = paged / runs[other]["output_tokens_per_s"]
            print(f"goal: >= 2x the contiguous policy: {ratio:.2f}x {other} ({'met' if ratio >= 2 else 'MISSED'})")
    if paged and "hf-generate" in runs:
        goals["vs_hf_generate"] = paged / runs["hf-generate"]["output_tokens_per_s"]
        print(
            f"goal: ahead of transformers generate at batch {args.max_num_seqs}: {goals['vs_hf_generate']:.2f}x "
            f"({'met' if goals['vs_hf_generate'] > 1 else 'MISSED'})"
        )
    result["goals"] = goals
    write_result(args.result_name, result)
    plot(result, series, args.result_name)
    return 0


def plot(result: dict, series: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(runs)
    a.bar(
        names,
        [runs[k]["output_tokens_per_s"] for k in names],
        color=["tab:green", "tab:red", "tab:orange", "tab:gray"][: len(names)],
    )
    a.set_ylabel("output tokens / s")
    a.set_title(f"KV budget {result['config']['budget_tokens']} tokens, batch cap {result['config']['max_num_seqs']}")
    for k, v in series.items():
        b.plot(v["batch"], label=k, lw=1)
    b.set_xlabel("engine step")
    b.set_ylabel("requests in the batch")
    b.legend()
    save_plot(fig, name)


if __name__ == "__main__":
    raise SystemExit(main())
