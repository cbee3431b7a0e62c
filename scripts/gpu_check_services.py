"""scripts/gpu_check.py's services phase: the stack on the device under test, checked against the CPU.

Each check reports through :data:`report` (set by scripts/gpu_check.py to its results writer) in
the order of what a first GPU run must establish first (issue "GPU-ready", items 1-4):

1. **receipts after the writes, read by another worker**: a memory service and two workers on the
   device; a prompt prefilled in several chunks on worker 0, then the same prompt on worker 1 (a
   client of its own): it must hit worker 0's blocks in the prefix cache and give worker 0's
   tokens, and the hit blocks' bytes (mapped through the worker socket, as a worker maps them) are
   the same before and after worker 1 read them;
2. **the stack against the CPU**: greedy tokens (fp32 pool and model, so the comparison is exact)
   equal a CPU stack's on the same seeded random model, with penalties too; n=2 (fork and
   copy-on-write) repeats the greedy answer; the pool handle travels only over the worker socket
   and a Step without a grant writes nothing; `pagedkv serve` over the stack answers the same
   tokens; nothing leaks;
3. bf16 and fp8 stacks generate (on a GPU), and a worker drops its mapping when the memory service
   stops first.

The dry run (``--dry-run``) serves a 2-layer model of SmolLM2's vocabulary instead of the
30-layer one, so that the whole phase runs on a CPU in well under a minute.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported at run time only once the source tree is on sys.path
    from client.ops.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent


def _print(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}".rstrip(), flush=True)


#: Where each check's result goes: ``report(name, ok, detail)``; scripts/gpu_check.py sets it.
report: Callable[[str, bool, str], None] = _print

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    (
        "Explain in three sentences why an operating system divides memory into pages, "
        "and what a page table is for. Use simple words."
    ),
]
MAX_TOKENS = 24
#: A greedy difference where the CPU's top two logprobs are closer than this is a rounding tie.
NEAR_TIE = 1e-2

# ---------------------------------------------------------------------------------------------
# The stacks under check (a LocalStack each)


def start_stack(
    name: str, device: str, model: Path, env: dict[str, str], work: Path, dtype: str | None, workers: int = 1
) -> LocalStack:
    """A started `LocalStack` on free loopback ports: a memory service (256 blocks of 16 tokens,
    `--kv-cache-dtype dtype` when given) and ``workers`` workers, all on `device` with `model`; logs
    under `work`."""
    from client.ops.stack import LocalStack  # imported once the source tree is on sys.path

    mem_args = ["--num-blocks", "256", "--block-size", "16", "--max-blocks-per-lease", "none",  # one client: the pool
                *(["--kv-cache-dtype", dtype] if dtype else [])]
    return LocalStack(
        mem_args,
        device=device,
        model=str(model),
        host="127.0.0.1",
        run_dir=work,
        name=name,
        env=env,
        cwd=ROOT,
        num_workers=workers,
    ).start()


def descriptor(stack: LocalStack):
    """The memory service's PoolDescriptor."""
    import grpc

    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    with grpc.insecure_channel(stack.memory_address) as ch:
        return (
            mpb_grpc.MemoryServiceStub(ch)
            .GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=10)
            .pool
        )


def used_blocks(stack: LocalStack) -> int:
    """Blocks the memory service holds for live sequences."""
    import grpc

    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    with grpc.insecure_channel(stack.memory_address) as ch:
        return (
            mpb_grpc.MemoryServiceStub(ch)
            .GetStats(mpb.GetStatsRequest(), timeout=10)
            .used_blocks
        )


#: Penalties (vLLM's semantics, applied on the worker: compute_service.penalties) of the penalised run.
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def generate(
    stack: LocalStack,
) -> tuple[list[list[int]], list[list[dict[int, float]]], list[list[int]], float, list[list[int]]]:
    """(greedy tokens per prompt, their top-2 logprobs, the n=2 greedy samples of prompt 0, seconds,
    greedy tokens per prompt with `PENALTIES`)."""
    from client import Client, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    t = time.perf_counter()
    with Client(stack.memory_address, stack.worker_addresses) as llm:
        outs = llm.generate(messages, greedy)
        (forked,) = llm.generate(
            [[{"role": "user", "content": PROMPTS[0]}]],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
        )
        secs = time.perf_counter() - t
        penalised = llm.generate(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                          **PENALTIES))
    return (
        [o.outputs[0].token_ids for o in outs],
        [o.outputs[0].logprobs for o in outs],
        [o.token_ids for o in forked.outputs],
        secs,
        [o.outputs[0].token_ids for o in penalised],
    )


def health(address: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(
    label: str, tok: list[list[int]], ref: list[list[int]], ref_lps: list[list[dict[int, float]]]
) -> None:
    """Report, per prompt, whether the greedy tokens equal the CPU reference's.

    A random model can put two logits within rounding of each other, so a first difference at a
    position where the reference's top two logprobs are closer than NEAR_TIE passes (and says so).
    """
    for i, (a, b) in enumerate(zip(tok, ref)):
        diff = first_difference(a, b)
        name = f"greedy tokens equal, {label} vs cpu, prompt {i}"
        if diff is None:
            report(name, True, f"{len(a)} tokens")
            continue
        lps = ref_lps[i] or []
        top = sorted(lps[diff].values(), reverse=True) if diff < len(lps) else []
        gap = top[0] - top[1] if len(top) > 1 else float("inf")
        report(
            name,
            gap < NEAR_TIE,
            f"first difference at token {diff}: {a[diff : diff + 4]} vs {b[diff : diff + 4]}; "
            f"cpu top-2 logprob gap {gap:.2g} ({'a near tie' if gap < NEAR_TIE else 'not a tie'})",
        )


def run(device: str, model: Path, env: dict[str, str], work: Path, over_budget: Callable[[], bool]) -> None:
    """The phase's checks in priority order (the module's list); ``over_budget()`` is asked before
    each costly one, which is then skipped and reported as such."""
    label = "cuda" if device == "cuda" else "cpu (as the device under test)"
    runs = {}
    for name, dev in (("test", device), ("reference", "cpu")):
        if over_budget():
            report(f"{name} stack ({dev})", False, "skipped: the phase's time budget is spent")
            continue
        stack = None
        try:
            stack = start_stack(name, dev, model, env, work, dtype="float32", workers=2 if name == "test" else 1)
            if name == "test":
                check_receipts_read_by_another_worker(stack)
            runs[name] = generate(stack)
            if name == "test":
                check_pool_handle(stack, device)
                check_serve(stack, env, work, runs[name][0][0])
            report(f"{name} stack: nothing leaked", used_blocks(stack) == 0, f"used_blocks={used_blocks(stack)}")
            if name == "reference":
                check_producer_exit(stack)
        except Exception as e:  # noqa: BLE001 - a failed stack is a failed check, with its log
            report(f"{name} stack ({dev}) runs", False, f"{type(e).__name__}: {str(e)[-1500:]}")
        finally:
            if stack is not None:
                stack.stop()
    if len(runs) < 2:
        return
    (tok, _, forked, secs, pen), (ref, ref_lps, _, ref_secs, ref_pen) = runs["test"], runs["reference"]
    report(
        "reference top-2 logprobs present",
        all(len(lp or []) == len(t) and all(len(d) >= 2 for d in lp) for lp, t in zip(ref_lps, ref)),
        "",
    )
    compare_greedy(label, tok, ref, ref_lps)
    diffs = [first_difference(a, b) for a, b in zip(pen, ref_pen)]
    report(
        f"greedy with penalties on {label} equals the cpu reference (penalties on the worker's device)",
        all(d is None for d in diffs) and pen != tok,
        f"first differences {diffs}; penalties change the tokens: {pen != tok}",
    )
    report(
        "n=2 greedy samples (fork + copy-on-write) repeat the greedy answer",
        all(s == tok[0] for s in forked) and len(forked) == 2,
        f"{[len(s) for s in forked]}",
    )
    print(f"# generation: {secs:.1f} s on {device}, {ref_secs:.1f} s on the cpu reference", flush=True)
    if device != "cuda":
        return
    for dtype in ("bf16", "fp8"):
        if over_budget():
            report(f"{dtype} stack generates", False, "skipped: the phase's time budget is spent")
            continue
        check_dtype_stack(dtype, model, env, work, ref)


def check_receipts_read_by_another_worker(stack: LocalStack) -> None:
    """A prompt prefilled in chunks on worker 0 is read from the prefix cache by worker 1 (item 1 of
    the GPU issue: a receipt signed before the device finished would let worker 1 read blocks still
    being written). Worker 1 must hit, give worker 0's tokens, and leave the hit blocks' bytes as
    they were (mapped through the worker socket, as a worker maps them)."""
    import grpc
    import torch

    from client import Client, SamplingParams
    from compute_service.pool_map import map_pool
    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    prompt = " ".join([PROMPTS[2]] * 3)  # ~100 tokens: prefilled in chunks of 16
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    name = "receipts: worker 1 reads worker 0's chunked prefill from the prefix cache"
    with Client(stack.memory_address, stack.worker_addresses[:1], max_num_batched_tokens=16) as first:
        (a,) = first.generate([prompt], greedy)
    cached = []
    with grpc.insecure_channel(stack.memory_address) as ch:
        events = mpb_grpc.MemoryServiceStub(ch).StreamKvEvents(mpb.StreamKvEventsRequest(from_sequence_number=1),
                                                               timeout=3)
        try:
            for e in events:
                if e.HasField("block_stored"):
                    cached.append(e.block_stored.block_id)
                elif e.HasField("block_removed") or e.HasField("all_cleared"):
                    cached = []  # a fresh stack evicts nothing here; if it did, compare nothing
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
    mapped = map_pool(descriptor(stack))
    try:
        before = mapped.tensor[cached].cpu().clone() if cached else None
        with Client(stack.memory_address, stack.worker_addresses[1:2]) as second:
            (b,) = second.generate([prompt], greedy)
        after = mapped.tensor[cached].cpu() if cached else None
    finally:
        mapped.close()
    same = before is not None and torch.equal(before, after) and bool(before.count_nonzero())
    hit = b.num_cached_tokens or 0
    report(name, hit >= 16 and len(cached) > 0 and b.outputs[0].token_ids == a.outputs[0].token_ids and same,
           f"{len(cached)} blocks cached by worker 0, worker 1 hit {hit} tokens, tokens equal: "
           f"{b.outputs[0].token_ids == a.outputs[0].token_ids}, hit blocks' bytes unchanged: {same}")


def check_dtype_stack(dtype: str, model: Path, env: dict[str, str], work: Path, ref: list[list[int]]) -> None:
    """A bf16 stack (the default dtype on a GPU) or an fp8 pool (bf16 model: the worker calibrates
    the scales on the GPU and sets them on the memory service) generates; agreement with the fp32
    reference is informational."""
    import grpc

    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    name = f"{dtype} stack generates"
    stack = None
    try:
        stack = start_stack(dtype, "cuda", model, env, work, dtype="fp8" if dtype == "fp8" else None)
        if dtype == "fp8":
            with grpc.insecure_channel(stack.memory_address) as ch:
                desc = mpb_grpc.MemoryServiceStub(ch).GetPoolDescriptor(mpb.GetPoolDescriptorRequest(),
                                                                        timeout=10).pool
            scales = list(desc.kv_scales.k_scale) + list(desc.kv_scales.v_scale)
            report("fp8 pool: the worker calibrated its scales on the GPU",
                   desc.layout.dtype == "fp8_e4m3" and bool(scales) and all(x > 0 for x in scales),
                   f"source {desc.kv_scales.source!r}, {len(scales)} scales, max {max(scales, default=0):.4g}")
        got, _, _, secs, _ = generate(stack)
        agree = sum(len(a) if (d := first_difference(a, b)) is None else d for a, b in zip(got, ref))
        report(name, all(len(t) == MAX_TOKENS for t in got),
               f"{secs:.1f} s; {agree}/{sum(map(len, ref))} leading tokens agree with fp32 (informational)")
        report(f"{dtype} stack: nothing leaked", used_blocks(stack) == 0, f"used_blocks={used_blocks(stack)}")
    except Exception as e:  # noqa: BLE001 - a failed stack is a failed check, with its log
        report(name, False, f"{type(e).__name__}: {str(e)[-1500:]}")
    finally:
        if stack is not None:
            stack.stop()


def check_pool_handle(stack: LocalStack, device: str) -> None:
    """The pool's handle travels only over the worker socket, and a worker steps only with a grant.

    GetPoolDescriptor (anyone) has the layout and the socket's path, no handle; the socket gives
    this process (same uid) the handle (a CUDA pool: the 64-byte IPC handle and the GPU's UUID; a
    cpu pool: the pool's memfd), the epoch table's read-only fd and a 32-byte plane key; mapping
    the pool through it here, a third process, shows the K/V the worker wrote (the prompts' full
    blocks stay in the prefix cache after the run). A Step whose sequence carries no grant is
    PERMISSION_DENIED and writes nothing (the mapped block it names is unchanged).
    """
    import grpc

    from compute_service.pool_map import map_pool
    from pagedkv.compute.v1 import compute_service_pb2 as cpb
    from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.runtime.pool_socket import receive_handle

    cuda = device == "cuda"
    label = "cuda pool" if cuda else "cpu pool"
    desc = descriptor(stack)
    report(
        f"{label}: GetPoolDescriptor carries no handle",
        desc.backend == (mpb.POOL_BACKEND_CUDA if cuda else mpb.POOL_BACKEND_CPU) and not desc.cuda_ipc_handle
        and not desc.cuda_device_uuid and not desc.shm_path and bool(desc.worker_socket),
        f"backend={mpb.PoolBackend.Name(desc.backend)} worker_socket={desc.worker_socket}",
    )
    handle = receive_handle(desc.worker_socket)
    try:
        got = handle.descriptor
        if cuda:
            ok = len(got.cuda_ipc_handle) == 64 and got.cuda_device_uuid.startswith("GPU-") \
                and sorted(handle.fds) == ["epochs"]
        else:
            ok = sorted(handle.fds) == ["epochs", "pool"]
        report(
            f"{label}: the worker socket hands over the {'IPC handle' if cuda else 'pool memfd'}, epochs and plane key",
            ok and got.generation == desc.generation and len(handle.plane_key) == 32,
            f"uuid={got.cuda_device_uuid or '-'} fds={sorted(handle.fds)} worker={stack.workers[0].info['device']}",
        )
    finally:
        handle.close()
    mapped = map_pool(desc)
    try:
        epochs = mapped.epochs
        nonzero = int(mapped.tensor.count_nonzero())
        report(
            f"{label} mapped through the socket by a third process sees the worker's K/V",
            mapped.tensor.is_cuda == cuda and nonzero > 0 and epochs.shape == (desc.layout.num_blocks,)
            and not epochs.flags.writeable,
            f"device={mapped.tensor.device} nonzero={nonzero} epochs[:4]={epochs[:4].tolist()} nbytes={desc.nbytes}",
        )
        block = desc.layout.num_blocks - 1
        before = mapped.tensor[block].clone()
        step = cpb.StepRequest(pool_generation=desc.generation, sequences=[cpb.StepSequence(
            seq_id=1, token_ids=[1], positions=[0], block_ids=[block])])
        with grpc.insecure_channel(stack.worker_addresses[0]) as ch:
            try:  # refused alone: the call answers, the sequence's result carries the error
                (result,) = cpb_grpc.ComputeServiceStub(ch).Step(step, timeout=60).results
                code = grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == result.error.code)).name \
                    if result.HasField("error") else "OK (computed)"
            except grpc.RpcError as e:
                code = e.code().name
        same = bool((mapped.tensor[block] == before).all())
        report(f"{label}: a Step without a grant is refused and writes nothing",
               code == "PERMISSION_DENIED" and same, f"code={code}, block {block} unchanged={same}")
    finally:
        mapped.close()


def check_serve(stack: LocalStack, env: dict[str, str], work: Path, expected: list[int]) -> None:
    """`pagedkv serve` attached to the stack under test: its greedy chat completion (HTTP, the
    OpenAI shape) equals the Client's tokens for the same prompt, /health is 200, nothing leaks."""
    import urllib.request

    from client.ops.stack import ServiceProcess

    svc = None
    try:
        svc = ServiceProcess(
            [sys.executable, "-m", "client.ops.cli", "serve", "--memory", stack.memory_address,
             "--workers", ",".join(stack.worker_addresses), "--port", "0"],
            work / "serve.ready.json", work / "serve.log", env=env, cwd=ROOT, timeout=180,
        )
        body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(f"http://{svc.address}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            got = json.load(r)["choices"][0]["token_ids"]
        report("pagedkv serve: greedy chat equals the Client's", got == expected,
               f"first difference at {first_difference(got, expected)}, {len(got)} tokens")
        with urllib.request.urlopen(f"http://{svc.address}/health", timeout=10) as r:
            report("pagedkv serve: /health", r.status == 200, str(r.status))
        report("pagedkv serve: nothing leaked", used_blocks(stack) == 0, f"used_blocks={used_blocks(stack)}")
    except Exception as e:  # noqa: BLE001 - a failed server is a failed check, with its log
        tail = svc.log_tail() if svc is not None else ""
        report("pagedkv serve runs", False, f"{type(e).__name__}: {str(e)[-800:]} {tail[-800:]}")
    finally:
        if svc is not None:
            svc.stop()


def check_producer_exit(stack: LocalStack) -> None:
    """Stop ``stack``'s memory service first: its worker must turn NOT_SERVING (mapping dropped) and live on."""
    name = "memory service exits first: worker drops the pool"
    try:
        before = health(stack.workers[0].address)
        code = stack.memory.stop()
        deadline, after = time.monotonic() + 20, before
        while time.monotonic() < deadline and after == "SERVING":
            time.sleep(0.2)
            after = health(stack.workers[0].address)
        alive = stack.workers[0].proc.poll() is None
        report(name, before == "SERVING" and after == "NOT_SERVING" and alive and code == 0,
               f"worker {before} -> {after}, worker alive={alive}, memory exit={code}")
    except Exception as e:  # noqa: BLE001
        report(name, False, f"{type(e).__name__}: {str(e)[-1500:]}")
