"""GPU check, host tier: offload and reload copies between a CUDA pool and its page-locked host tier.

A pool owner process (scripts/gpu_check_pools.py: the memory service's side, its
`memory_service.pool.CudaPool` with a host tier, served on a worker socket) and this process as
the worker: it maps both tiers through the socket (`compute_service.pool_map.map_pool`: CUDA IPC
for the pool, the host memfd ``cudaHostRegister``ed), fills N device blocks with random bytes,
and moves them with the worker's own path, a step whose signed grant names the copies
(`check_grants` -> its copy plan -> `compute_service.worker.do_copies`):

- offload device blocks [0, N) -> host blocks [0, N), then reload host [0, N) -> device blocks
  [N, 2N): every byte equal each way;
- GB/s each way, for N consecutive blocks (merged into one copy) and for N scattered ones (one
  copy per block), best of a few repeats; the ratios are figures, not checks.

`run(report, device="cpu")` does the same on a cpu pool (checks this file without a GPU).
SmolLM2's block layout (30 layers, 3 KV heads, head_dim 64, 16 tokens: 360 KiB in bf16); about
10 s with N = 512 (180 MiB each way).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def _step(mapped, pairs, src_medium, dst_medium):
    """The copy plan of a one-sequence step whose signed grant names ``pairs`` (``check_grants``)."""
    from compute_service.grant_check import check_grants
    from pagedkv.compute.v1 import compute_service_pb2 as cpb
    from pagedkv.grant.v1 import grant_pb2
    from pagedkv.runtime.grants import sign_grant, token_digest

    ep, hep = mapped.epochs, mapped.host_epochs

    def epoch(i, medium):
        return int((hep if medium == grant_pb2.MEDIUM_HOST else ep)[i])

    copies = [grant_pb2.GrantedCopy(src=s, src_epoch=epoch(s, src_medium), dst=d, dst_epoch=epoch(d, dst_medium),
                                    src_medium=src_medium, dst_medium=dst_medium) for s, d in pairs]
    last = mapped.descriptor.layout.num_blocks - 1
    grant = sign_grant(mapped.plane_key, grant_pb2.StepGrant(
        pool_generation=mapped.generation, seq_id=1, block_ids=[last], block_epochs=[int(ep[last])], readable_tokens=0,
        write_end=1, token_digest=token_digest([1]), copies=copies, expires_at=time.time() + 600))
    request = cpb.StepRequest(pool_generation=mapped.generation, sequences=[cpb.StepSequence(
        seq_id=1, token_ids=[1], positions=[0], block_ids=[last], grant=grant)])
    return check_grants(request, mapped.plane_key, mapped.generation, ep, host_epochs=hep).plan


def _timed(fn, sync, repeats: int) -> float:
    """Best seconds of ``repeats`` runs of ``fn`` (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def run(report: Callable[[str, bool, str], None], device: str = "cuda", blocks: int | None = None,
        env: dict[str, str] | None = None, work: Path | None = None, repeats: int = 3) -> None:
    """The host-tier section (see the module docstring); ``report(name, ok, detail)`` per check."""
    import torch
    from gpu_check_pools import Owner

    from compute_service.pool_map import map_pool
    from compute_service.worker import do_copies
    from pagedkv.grant.v1 import grant_pb2

    cuda = device == "cuda"
    blocks = blocks or (512 if cuda else 32)
    label = f"host tier ({'cuda' if cuda else 'cpu'} pool, {blocks} blocks)"
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"), *sys.path])}
    sock = str(Path(work or "/tmp") / f"tiers-{os.getpid()}.sock")
    owner = Owner(device, 2 * blocks + 1, "bfloat16" if cuda else "float32", sock, env, host_blocks=blocks,
                  pool_id="tiers")
    mapped = None
    try:
        if owner.descriptor is None:
            report(f"{label}: pool owner starts", False, f"exit code {owner.proc.poll()}")
            return
        mapped = map_pool(owner.descriptor)
        pool, host = mapped.tensor, mapped.host_tensor
        pinned = host is not None and host.is_pinned() if cuda else host is not None
        report(f"{label}: mapped through the socket{', host memory page-locked' if cuda else ''}",
               pinned and tuple(host.shape) == (blocks, *pool.shape[1:]) and host.dtype == pool.dtype
               and mapped.all_epochs.shape == (2 * blocks + 1 + blocks,),
               f"pool={tuple(pool.shape)} {pool.dtype} on {pool.device}, host={tuple(host.shape)} "
               f"block={mapped.descriptor.block_nbytes} B")
        gen = torch.Generator(device=pool.device).manual_seed(0)
        as_int = torch.int16 if pool.element_size() == 2 else torch.int32
        info = torch.iinfo(as_int)
        original = torch.randint(info.min, info.max, (blocks, *pool.shape[1:]), generator=gen, device=pool.device,
                                 dtype=as_int).view(pool.dtype)
        pool[:blocks].copy_(original)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        dev, hst = grant_pb2.MEDIUM_DEVICE, grant_pb2.MEDIUM_HOST
        offload = _step(mapped, [(b, b) for b in range(blocks)], dev, hst)
        reload = _step(mapped, [(h, blocks + h) for h in range(blocks)], hst, dev)
        do_copies(mapped, offload)
        sync()
        host_ok = torch.equal(host.view(as_int), original.view(as_int).cpu())
        do_copies(mapped, reload)
        sync()
        back_ok = torch.equal(pool[blocks:2 * blocks].view(as_int), original.view(as_int))
        report(f"{label}: offload then reload through the worker's copies, byte-exact", host_ok and back_ok,
               f"offloaded equal={host_ok}, reloaded equal={back_ok}")

        nbytes = blocks * mapped.descriptor.block_nbytes
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
        scattered_off = _step(mapped, [(b, perm[b]) for b in range(0, blocks, 2)], dev, hst)
        scattered_re = _step(mapped, [(perm[b], blocks + b) for b in range(0, blocks, 2)], hst, dev)
        figures = []
        for name, plan, n in (("offload", offload, nbytes), ("reload", reload, nbytes),
                              ("offload scattered", scattered_off, nbytes // 2),
                              ("reload scattered", scattered_re, nbytes // 2)):
            seconds = _timed(lambda p=plan: do_copies(mapped, p), sync, repeats)
            figures.append(f"{name} {n / seconds / 1e9:.1f} GB/s")
        report(f"{label}: copy bandwidth (figures)", True, f"{nbytes / 2**20:.0f} MiB: " + ", ".join(figures))
    except Exception as e:  # noqa: BLE001 - a failed section is a FAIL line, the script goes on
        report(f"{label}", False, f"{type(e).__name__}: {e}")
    finally:
        if mapped is not None:
            mapped.close()
        owner.close()


if __name__ == "__main__":  # python scripts/gpu_check_tiers.py [cpu|cuda]
    sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")]

    def _print(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}".rstrip(), flush=True)

    run(_print, sys.argv[1] if len(sys.argv) > 1 else "cpu")
