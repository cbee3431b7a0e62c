"""Compute worker decode speed on CPU, against transformers' dense forward (issue 4, "Speed").

For each (batch, context): a real memory service and compute worker run as their own processes
(as `pagedkv up` starts them), and this process drives them as the engine does, with the lease's
secret on every memory-service call and each sequence's grant on every Step. Every sequence gets
its own random prompt of `context` tokens, prefilled with real Steps (chunked prefill: several
sequences per Step, up to PREFILL_CHUNK tokens; a chunk is allocated or appended with its token
ids, stepped with its grant, and the Step's receipts are handed in with CommitComputedTokens, the
only way positions become readable by later steps). Then it times decode steps as the engine runs
them: AppendSlots (one token per sequence, with its id) + Step (greedy) + CommitComputedTokens
(the step's receipts; its reply carries the next step's grants). The commit is part of a step's
cost since grants and receipts (docs/security.md).

Columns:
- pagedkv tok/s: batch / median(AppendSlots + Step + CommitComputedTokens wall time), seen by
  the client; `append ms` and `commit ms` are the two memory-service calls' medians.
- transformers tok/s: batch / median(forward + argmax) of `LlamaForCausalLM` (same GGUF, fp32)
  over a `DynamicCache` holding `context` positions per sequence, in this process. Its steps
  alternate with the worker's (one each, in turn), so drift in the machine's speed hits both.
- model ms: the worker's reported model time; attention ms: attention's share of a model forward
  (plan + cache writes + paged attention, timed in this process on the same batch and pool,
  mapped here through the memory service's worker socket as a worker maps it (same uid), by
  wrapping the kernels the model calls); RPC ms: Step wall - the worker's step_seconds (gRPC,
  protobuf, the request's parsing, validation and grant checks are inside step_seconds; this is
  the transport).

The worker's projections run through oneDNN's packed matmul and its decode attention through the
native CPU kernel; `--no-packed-linear` (F.linear, as transformers) and `--no-native` (gather +
SDPA) turn each off in the worker and in this process, to show what each is worth.

Usage: `python benchmarks/bench_worker.py [--quick] [--out PATH] [--steps N]`. Prints a table and
writes JSON (default benchmarks/results/bench_worker.json) with the machine (CPU, cores, torch).
Timing on a shared machine is noisy: warm-up steps, then medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch
from common import machine

import kernels
from client.ops.stack import LocalStack
from compute_service.pool_map import map_pool
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_worker.json"
BLOCK_SIZE = 16
PREFILL_CHUNK = 512  # tokens per prefill Step
WARMUP_STEPS = 3
_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


class PagedRun:
    """Sequences of one (batch, context) case, driven as the engine drives them.

    Every call carries the lease's secret; every Step sequence carries the grant of its latest
    memory-service reply (AllocateSequences, AppendSlots, CommitComputedTokens), and after every
    Step the workers' receipts go back in one CommitComputedTokens, whose grants the next step uses.
    """

    def __init__(self, memory, worker, lease: mpb.CreateLeaseResponse, batch: int, ctx: int, generation: int):
        self.memory, self.worker = memory, worker
        self.lease, self.batch, self.ctx, self.generation = lease.lease_id, batch, ctx, generation
        self.md = ((LEASE_SECRET_METADATA, lease.lease_secret),)  # the lease's secret, on every call on it
        gen = torch.Generator().manual_seed(batch * 100_003 + ctx)  # a prompt per sequence, none shared
        self.prompts = [torch.randint(100, 40000, (ctx,), generator=gen).tolist() for _ in range(batch)]
        self.seq_ids: list[int | None] = [None] * batch
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.grants: list[grant_pb2.StepGrant | None] = [None] * batch
        self.lengths = [0] * batch  # positions proven computed (receipts handed in)
        self.last_tokens = [0] * batch
        self.step_no = 0
        self.prefill_steps = 0

    def _index(self) -> dict[int, int]:
        return {s: i for i, s in enumerate(self.seq_ids) if s is not None}

    def _take_grants(self, grants) -> None:
        index = self._index()
        for g in grants:
            self.grants[index[g.seq_id]] = g

    def _commit(self, results) -> None:
        """Hand in the step's receipts: its positions become readable; keep the fresh grants."""
        resp = self.memory.CommitComputedTokens(
            mpb.CommitComputedTokensRequest(lease_id=self.lease, receipts=[r.receipt for r in results]),
            metadata=self.md)
        if resp.skipped:
            raise RuntimeError(f"CommitComputedTokens skipped {resp.skipped} receipts (stale: a sequence changed)")
        self._take_grants(resp.grants)
        index = self._index()
        for r in results:
            self.lengths[index[r.seq_id]] = r.receipt.end

    def _seq(self, i: int, tokens: list[int], sample: bool, output_index: int) -> cpb.StepSequence:
        """Sequence ``i``'s entry in a Step: ``tokens`` at the positions its grant makes writable next."""
        g = self.grants[i]
        return cpb.StepSequence(
            seq_id=self.seq_ids[i], token_ids=tokens,
            positions=range(g.readable_tokens, g.readable_tokens + len(tokens)),
            block_ids=self.tables[i], skip_sampling=not sample, output_index=output_index, grant=g)  # fmt: skip

    def fill(self) -> None:
        """Prefill every sequence's prompt with real Steps of up to PREFILL_CHUNK tokens each (several
        sequences per Step, a long prompt over several), as the engine's chunked prefill: each chunk
        is allocated (first chunk) or appended (later ones) with its token ids, stepped with the
        grants, and its receipts committed."""
        while True:
            budget, plan = PREFILL_CHUNK, []  # (sequence index, tokens this step)
            for i in range(self.batch):
                n = min(self.ctx - self.lengths[i], budget)
                if n > 0:
                    plan.append((i, n))
                    budget -= n
                if budget == 0:
                    break
            if not plan:
                return
            new = [(i, n) for i, n in plan if self.seq_ids[i] is None]
            old = [(i, n) for i, n in plan if self.seq_ids[i] is not None]
            if new:  # the whole prompt goes along (the prefix-cache lookup); num_tokens is this chunk
                resp = self.memory.AllocateSequences(
                    mpb.AllocateSequencesRequest(
                        lease_id=self.lease,
                        sequences=[mpb.SequenceAllocation(num_tokens=n, token_ids=self.prompts[i]) for i, n in new],
                    ),
                    metadata=self.md,
                )
                for (i, _), t, g in zip(new, resp.sequences, resp.grants):
                    self.seq_ids[i], self.tables[i], self.grants[i] = t.seq_id, list(t.block_ids), g
            if old:
                self._append([(i, n, self.prompts[i][self.lengths[i] : self.lengths[i] + n]) for i, n in old])
            seqs = []
            for i, _ in plan:
                g = self.grants[i]  # a cached prefix starts later: the grant says where
                seqs.append(self._seq(i, self.prompts[i][g.readable_tokens : g.write_end], g.write_end == self.ctx, 0))
            out = self.worker.Step(cpb.StepRequest(pool_generation=self.generation, sequences=seqs))
            self._commit(out.results)
            index = self._index()
            for r in out.results:
                if r.HasField("token_id"):
                    self.last_tokens[index[r.seq_id]] = r.token_id
            self.prefill_steps += 1

    def _append(self, appends: list[tuple[int, int, list[int]]]) -> list[cpb.BlockCopy]:
        """AppendSlots of (sequence index, tokens, their ids); updates tables and grants, returns the copies."""
        resp = self.memory.AppendSlots(
            mpb.AppendSlotsRequest(
                lease_id=self.lease,
                appends=[mpb.SlotAppend(seq_id=self.seq_ids[i], num_tokens=n, token_ids=ids) for i, n, ids in appends],
            ),
            metadata=self.md,
        )
        index = self._index()
        for u in resp.updates:  # only the tables that changed come back
            self.tables[index[u.seq_id]][u.first_changed :] = list(u.block_ids)
        self._take_grants(resp.grants)
        return [cpb.BlockCopy(src=c.src, dst=c.dst) for c in resp.copies]

    def decode_step(self) -> dict:
        """One decode step as the engine runs it: AppendSlots (one token per sequence, with its id),
        Step (greedy, every sequence with its grant), CommitComputedTokens (the step's receipts);
        returns each part's wall time in seconds and the worker's model / step time."""
        t0 = time.perf_counter()
        copies = self._append([(i, 1, [self.last_tokens[i]]) for i in range(self.batch)])
        t1 = time.perf_counter()
        seqs = [self._seq(i, [self.last_tokens[i]], True, self.step_no + 1) for i in range(self.batch)]
        req = cpb.StepRequest(pool_generation=self.generation, sequences=seqs, copies=copies)
        t2 = time.perf_counter()
        out = self.worker.Step(req)
        t3 = time.perf_counter()
        self._commit(out.results)
        t4 = time.perf_counter()
        index = self._index()
        for r in out.results:
            self.last_tokens[index[r.seq_id]] = r.token_id
        self.step_no += 1
        self.last_request = req
        return {
            "append": t1 - t0,
            "build": t2 - t1,
            "step_wall": t3 - t2,
            "commit": t4 - t3,
            "model": out.model_seconds,
            "step": out.step_seconds,
        }

    def free(self) -> None:
        self.memory.FreeSequences(mpb.FreeSequencesRequest(lease_id=self.lease, seq_ids=self.seq_ids), metadata=self.md)


def attention_share(model, pool, request: cpb.StepRequest, reps: int) -> dict:
    """Re-run the last decode Step's batch in this process (rewriting the same K/V into the same
    slots) with the kernels the model calls wrapped by timers (the step's attention plan is
    built once per forward, as the worker does); medians in seconds."""
    from compute_service.step_inputs import build_step_inputs

    lay = pool.descriptor.layout
    inputs = build_step_inputs(
        request, block_size=lay.block_size, num_blocks=lay.num_blocks,
        vocab_size=model.config.vocab_size, device=model.device,
    )  # fmt: skip
    spent = {"plan": 0.0, "cache_write": 0.0, "attention": 0.0}
    originals = {
        "plan": kernels.plan_attention,
        "cache_write": kernels.reshape_and_cache,
        "attention": kernels.paged_attention,
    }
    names = {"plan": "plan_attention", "cache_write": "reshape_and_cache",
             "attention": "paged_attention"}  # fmt: skip

    def timed(key):
        fn = originals[key]

        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            spent[key] += time.perf_counter() - t
            return r

        return wrapper

    plain, wrapped = [], {k: [] for k in spent}
    for _ in range(2):
        model(*inputs.model_args(pool.tensor))  # warm-up
    for _ in range(reps):
        t = time.perf_counter()
        model(*inputs.model_args(pool.tensor))
        plain.append(time.perf_counter() - t)
    try:
        for key in spent:
            setattr(kernels, names[key], timed(key))
        for _ in range(reps):
            for key in spent:
                spent[key] = 0.0
            model(*inputs.model_args(pool.tensor))
            for key, seconds in spent.items():
                wrapped[key].append(seconds)
    finally:
        for key in spent:
            setattr(kernels, names[key], originals[key])
    res = {k: statistics.median(v) for k, v in wrapped.items()}
    res["model_in_process"] = statistics.median(plain)
    return res


class HfRun:
    """Dense decode steps of transformers' `LlamaForCausalLM`: `batch` sequences at `ctx`."""

    def __init__(self, hf, batch: int, ctx: int):
        from transformers import DynamicCache

        cfg = hf.config
        heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        gen = torch.Generator().manual_seed(1)
        self.hf, self.batch, self.ctx, self.step_no = hf, batch, ctx, 0
        self.cache = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(batch, heads, ctx, dim, generator=gen)
            v = torch.randn(batch, heads, ctx, dim, generator=gen)
            self.cache.update(k, v, layer)
        self.tokens = torch.randint(100, 40000, (batch, 1), generator=gen)

    def decode_step(self) -> float:
        """Seconds of one forward + greedy argmax."""
        pos = torch.full((self.batch, 1), self.ctx + self.step_no, dtype=torch.int64)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.hf(
                input_ids=self.tokens, position_ids=pos, past_key_values=self.cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            self.tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            seconds = time.perf_counter() - t
        self.step_no += 1
        return seconds


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batches 1/32, context 128, few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per case")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the worker and this process")
    ap.add_argument(
        "--no-packed-linear",
        action="store_true",
        help="the worker's projections through F.linear (MKL), as transformers', not oneDNN's packed matmul",
    )
    ap.add_argument(
        "--no-native", action="store_true", help="the worker's CPU attention on the torch path (gather + SDPA)"
    )
    args = ap.parse_args(argv)
    env = {}
    if args.no_packed_linear:
        env["PAGEDKV_PACKED_LINEAR"] = os.environ["PAGEDKV_PACKED_LINEAR"] = "0"
    if args.no_native:
        env["PAGEDKV_NATIVE_CPU"] = os.environ["PAGEDKV_NATIVE_CPU"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    batches = [1, 32] if args.quick else [1, 8, 32, 64]
    contexts = [128] if args.quick else [128, 512]
    steps = args.steps or (5 if args.quick else 10)
    longest = max(contexts) + WARMUP_STEPS + steps + 1
    num_blocks = max(batches) * -(-longest // BLOCK_SIZE) + 16

    from transformers import AutoModelForCausalLM

    from compute_service.model.llama import LlamaForPagedLM
    from compute_service.weights.source import load_model_source, smollm2_gguf_path

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_worker_") as tmp:
        tmp = Path(tmp)
        stack = LocalStack(
            [
                "--num-blocks",
                str(num_blocks),
                "--block-size",
                str(BLOCK_SIZE),
                "--lease-ttl",
                "600",
                "--admin-token-file",
                str(tmp / "admin-token"),
                "--max-blocks-per-lease",  # its one client takes the whole pool
                "none",
            ],
            run_dir=tmp,
            env=env,
            cwd=ROOT,
            timeout=180.0,
        ).start()
        memory, worker = stack.memory, stack.workers[0]
        try:
            mch = grpc.insecure_channel(memory.address, options=_OPTIONS)
            wch = grpc.insecure_channel(worker.address, options=_OPTIONS)
            mstub, wstub = mpb_grpc.MemoryServiceStub(mch), cpb_grpc.ComputeServiceStub(wch)
            desc = mstub.GetPoolDescriptor(mpb.GetPoolDescriptorRequest()).pool
            pool = map_pool(desc)
            lease = mstub.CreateLease(mpb.CreateLeaseRequest(ttl_seconds=86400.0))
            config, weights = load_model_source("smollm2")
            model = LlamaForPagedLM(config, weights)
            del weights
            gguf = smollm2_gguf_path()
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
            for ctx in contexts:
                for batch in batches:
                    run = PagedRun(mstub, wstub, lease, batch, ctx, desc.generation)
                    run.fill()
                    dense = HfRun(hf, batch, ctx)
                    # Interleaved step by step, so a machine that slows down or speeds up during
                    # the case weighs on both columns alike.
                    timings, hf_times = [], []
                    for _ in range(WARMUP_STEPS + steps):
                        timings.append(run.decode_step())
                        hf_times.append(dense.decode_step())
                    timings, hf_times = timings[WARMUP_STEPS:], hf_times[WARMUP_STEPS:]
                    del dense
                    share = attention_share(model, pool, run.last_request, reps=max(5, steps))
                    run.free()
                    rows.append(make_row(batch, ctx, timings, share, hf_times))
                    rows[-1]["prefill_steps"] = run.prefill_steps
                    print_row(rows[-1], header=len(rows) == 1)
            mstub.ReleaseLease(
                mpb.ReleaseLeaseRequest(lease_id=lease.lease_id),
                metadata=((LEASE_SECRET_METADATA, lease.lease_secret),),
            )
            pool.close()
        except Exception:
            for svc in (memory, worker):  # the services' logs go with the temporary directory
                print(f"--- {svc.log_path.name} ---\n{svc.log_tail()}")
            raise
        finally:
            stack.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **machine(),
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "block_size": BLOCK_SIZE,
        "packed_linear": not args.no_packed_linear,
        "native_cpu_kernels": not args.no_native and kernels.cpu.native.available(),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"machine: {meta['cpu']}, {meta['cores']} cores, torch {meta['torch']}")
    print(f"wrote {args.out}")
    return rows


def make_row(batch: int, ctx: int, timings: list[dict], share: dict, hf_times: list[float]):
    col = {k: [t[k] for t in timings] for k in timings[0]}
    client = [t["append"] + t["build"] + t["step_wall"] + t["commit"] for t in timings]
    rpc = [t["step_wall"] - t["step"] for t in timings]
    step_wall = statistics.median(col["step_wall"])
    attn = share["plan"] + share["cache_write"] + share["attention"]
    paged_tps = batch / statistics.median(client)
    hf_tps = batch / statistics.median(hf_times)
    return {
        "batch": batch,
        "context": ctx,
        "pagedkv_tok_s": paged_tps,
        "transformers_tok_s": hf_tps,
        "ratio": paged_tps / hf_tps,
        "client_step_ms": median_ms(client),
        "append_ms": median_ms(col["append"]),
        "commit_ms": median_ms(col["commit"]),
        "step_wall_ms": step_wall * 1e3,
        "worker_step_ms": median_ms(col["step"]),
        "model_ms": median_ms(col["model"]),
        "model_in_process_ms": share["model_in_process"] * 1e3,
        "attention_ms": attn * 1e3,
        "attention_kernel_ms": share["attention"] * 1e3,
        "cache_write_ms": share["cache_write"] * 1e3,
        "plan_ms": share["plan"] * 1e3,
        "attention_pct_of_model": 100 * attn / share["model_in_process"],
        "rpc_ms": median_ms(rpc),
        "rpc_pct_of_step": 100 * statistics.median(rpc) / step_wall,
        "transformers_step_ms": median_ms(hf_times),
    }


TABLE = [
    ("batch", "batch", "{:d}"), ("context", "ctx", "{:d}"),
    ("pagedkv_tok_s", "pagedkv tok/s", "{:.1f}"), ("transformers_tok_s", "hf tok/s", "{:.1f}"),
    ("ratio", "ratio", "{:.2f}"), ("model_ms", "model ms", "{:.1f}"),
    ("attention_ms", "attn ms", "{:.2f}"), ("attention_pct_of_model", "attn %", "{:.1f}"),
    ("rpc_ms", "RPC ms", "{:.2f}"), ("rpc_pct_of_step", "RPC %", "{:.1f}"),
    ("append_ms", "append ms", "{:.2f}"), ("commit_ms", "commit ms", "{:.2f}"),
]  # fmt: skip


def print_row(row: dict, header: bool) -> None:
    if header:
        print(" | ".join(f"{h:>13}" for _, h, _ in TABLE))
    print(" | ".join(f"{f.format(row[k]):>13}" for k, _, f in TABLE), flush=True)


if __name__ == "__main__":
    main()
