"""GPU check, pool sizing: a stack whose pool ``--gpu-memory-utilization`` sized, as vLLM's.

On a GPU (scripts/gpu_check.py's services phase, after the other stacks have stopped):

1. a memory service with ``--gpu-memory-utilization 0.5`` and one worker, both at
   ``--max-num-batched-tokens 512`` and ``--log-level info``:
   - GetStats' ``sizing`` has this device's total (``torch.cuda.mem_get_info`` here), the check
     model's weights at bfloat16 (its safetensors' elements x 2: a float32 checkpoint runs in
     bfloat16 on a GPU) and the activation reserve of ``pagedkv.config.gpu_sizing``;
   - the pool holds exactly ``(floor(0.5 x total) - (weights + reserve)) // block bytes`` blocks, and
     the memory service logged that capacity (``pool_capacity``);
   - the worker ran its profile step at 512 tokens (``profile_run``: its measured peak) without a
     ``profile_over_budget`` warning: weights and measured peak within the share the memory service
     set aside, which checks the estimate on a real device;
   - the stack answers a prompt;
2. the refusals: at ``--gpu-memory-utilization 0.001`` the memory service exits naming its terms;
   at 0.97 a worker whose ``--max-num-batched-tokens 65536`` step cannot fit in what is left refuses
   to start, saying that its largest step ran out of device memory.

The dry run (cpu) checks what a CPU can: a cpu memory service refuses ``--gpu-memory-utilization``,
and the budget's arithmetic (``memory_service.sizing.plan_pool``) on the check's model over a fake
141 GiB device gives the formula's blocks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
#: The step the stack's reserve and its worker's profile run are for.
TOKENS = 512


def _events(log: str, event: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        if f'"event": "{event}"' in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                pass
    return out


def expected(model: Path, total: int, utilization: float, workers: int = 1) -> tuple[int, int, int]:
    """(weight bytes, reserve bytes, pool bytes) of the check's model at bfloat16, by the formula."""
    from pagedkv.config import BFLOAT16
    from pagedkv.config.gpu_sizing import activation_reserve
    from pagedkv.model.weight_bytes import count_weights, read_model_config

    weights = count_weights(model).nbytes(BFLOAT16.itemsize)
    reserve = activation_reserve(read_model_config(model), TOKENS, BFLOAT16).total_bytes
    return weights, reserve, int(utilization * total) - workers * (weights + reserve)


def run(report: Callable[[str, bool, str], None], device: str, model: Path, env: dict[str, str], work: Path) -> None:
    """The checks of the module's list for ``device`` ("cuda", or "cpu": the dry run)."""
    _refused_memory_service(report, device, model, env, work)
    if device != "cuda":
        _fake_device_arithmetic(report, model)
        return
    _sized_stack(report, model, env, work)
    _worker_refuses(report, model, env, work)


def _refused_memory_service(report, device: str, model: Path, env: dict[str, str], work: Path) -> None:
    from client.ops.stack import ServiceProcess

    util, want = ("0.001", "no room for the pool") if device == "cuda" else ("0.5", "sizes a GPU pool")
    name = f"pool sizing: --gpu-memory-utilization {util} on {device} is refused"
    try:
        svc = ServiceProcess.pagedkv(["memory", "--device", device, "--gpu-memory-utilization", util, "--model",
                                      str(model), "--grace", "0"], work, f"sizing-refused-{device}", env=env,
                                     cwd=ROOT, timeout=120)
        svc.stop()
        report(name, False, "the memory service started")
    except RuntimeError as e:
        report(name, want in str(e), str(e)[-600:])


def _fake_device_arithmetic(report, model: Path) -> None:
    import memory_service.sizing as sizing
    from memory_service.main import build_parser
    from memory_service.spec import MemorySpec
    from pagedkv.model.source import resolve_model

    total = 141 * GiB
    sizing.device_memory = lambda index: (total, total)
    spec = MemorySpec.from_args(build_parser().parse_args(
        ["--device", "cuda", "--max-num-batched-tokens", str(TOKENS), "--model", str(model)])).pool
    plan = sizing.plan_pool(spec, resolve_model(str(model), files="config"))
    weights, reserve, pool = expected(model, total, 0.9)
    z = plan.sizing
    report("pool sizing: the budget on a fake 141 GiB device (cpu)",
           (z.weight_bytes, z.reserve_bytes, z.requested_bytes) == (weights, reserve, pool)
           and plan.layout.num_blocks == pool // plan.layout.block_nbytes,
           f"{plan.layout.num_blocks} blocks; weights {z.weight_bytes} B ({z.weights_from}), "
           f"reserve {z.reserve_bytes} B")


def _stats(address: str):
    import grpc

    from pagedkv.memory.v1 import memory_service_pb2 as mpb
    from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc

    with grpc.insecure_channel(address) as ch:
        return mpb_grpc.MemoryServiceStub(ch).GetStats(mpb.GetStatsRequest(), timeout=10)


def _sized_stack(report, model: Path, env: dict[str, str], work: Path) -> None:
    import torch

    from client import Client, SamplingParams
    from client.ops.stack import LocalStack
    from pagedkv.memory.v1 import memory_service_pb2 as mpb

    batch = ["--max-num-batched-tokens", str(TOKENS), "--log-level", "info"]
    stack = None
    try:
        memory = ["--gpu-memory-utilization", "0.5", "--max-blocks-per-lease", "none", "--grace", "0", *batch]
        stack = LocalStack(memory, worker_args=batch, device="cuda", model=str(model), host="127.0.0.1", run_dir=work,
                           name="sizing", env=env, cwd=ROOT).start()
        total = torch.cuda.mem_get_info(0)[1]
        s = _stats(stack.memory_address)
        z = s.sizing
        weights, reserve, pool = expected(model, total, 0.5)
        block = s.pool_bytes // max(1, s.total_blocks)
        report("pool sizing: GetStats has the device, the weights and the reserve",
               z.source == mpb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION and z.device_total_bytes == total
               and (z.utilization, z.workers_per_device, z.max_num_batched_tokens) == (0.5, 1, TOKENS)
               and (z.weight_bytes, z.reserve_bytes, z.requested_bytes) == (weights, reserve, pool),
               f"total {z.device_total_bytes} (here {total}), weights {z.weight_bytes} (want {weights}, "
               f"{z.weights_from}), reserve {z.reserve_bytes} (want {reserve}), pool {z.requested_bytes} (want {pool})")
        logged = _events(stack.memory.log(), "pool_capacity")
        report("pool sizing: the pool holds the formula's blocks, logged at start",
               s.total_blocks == pool // block and len(logged) == 1 and logged[0]["num_blocks"] == s.total_blocks
               and logged[0]["token_capacity"] == s.token_capacity and logged[0]["sizing"] == "gpu_memory_utilization",
               f"{s.total_blocks} blocks of {block} B ({s.token_capacity} tokens, {s.pool_bytes / GiB:.2f} GiB); "
               f"logged {logged}")
        wlog = stack.workers[0].log()
        prof, over = _events(wlog, "profile_run"), _events(wlog, "profile_over_budget")
        p = prof[0] if prof else {}
        report("pool sizing: the worker's profile run fits the share set aside",
               len(prof) == 1 and p.get("tokens") == TOKENS and p.get("peak_bytes", 0) > 0 and not over
               and p.get("weight_bytes", 0) + p.get("peak_bytes", 0) <= weights + reserve,
               f"measured weights {p.get('weight_bytes')} + peak {p.get('peak_bytes')} vs estimate {weights} + "
               f"{reserve}; free after {p.get('free_bytes')}; warnings {over}")
        with Client(stack.memory_address, stack.worker_addresses) as llm:
            (out,) = llm.generate(["The pool is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        report("pool sizing: the sized stack generates", len(out.outputs[0].token_ids) == 8,
               f"{out.outputs[0].token_ids}")
    except Exception as e:  # noqa: BLE001 - a failed stack is a failed check, with its log
        report("pool sizing: a stack sized by --gpu-memory-utilization 0.5 runs", False,
               f"{type(e).__name__}: {str(e)[-1500:]}")
    finally:
        if stack is not None:
            stack.stop()


def _worker_refuses(report, model: Path, env: dict[str, str], work: Path) -> None:
    from client.ops.stack import LocalStack

    name = "pool sizing: a worker whose largest step does not fit refuses to start"
    stack = None
    try:
        stack = LocalStack(["--gpu-memory-utilization", "0.97", "--grace", "0"],
                           worker_args=["--max-num-batched-tokens", "65536"], device="cuda", model=str(model),
                           host="127.0.0.1", run_dir=work, name="sizing-short", env=env, cwd=ROOT, timeout=120)
        stack.start()
        report(name, False, "the worker started")
    except RuntimeError as e:
        report(name, "ran out of device memory" in str(e) and "--max-num-batched-tokens 65536" in str(e),
               str(e)[-800:])
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":  # python scripts/gpu_check_sizing.py MODEL_DIR [cuda|cpu]
    sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
    run(lambda n, ok, d="": print(f"{'PASS' if ok else 'FAIL'}  {n}  {d}"), sys.argv[2] if len(sys.argv) > 2 else
        "cpu", Path(sys.argv[1]), {}, Path(sys.argv[1]).parent)
