"""Compile every Triton kernel ahead of time for a CUDA architecture, on a machine without a GPU.

The launch wrappers (`kernels.triton.decode`, `.prefill`, `.cache_ops`) are run on CPU tensors
with each kernel replaced by a recorder, so the arguments and compile-time constants compiled
are exactly the ones the wrapper would launch with. Each recorded launch is then compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, down to a cubin (Triton's
bundled ptxas). A kernel that would fail to compile on the first GPU run (e.g. a 16-bit
``tl.dot`` with K < 16) fails here.

The interpreter (``TRITON_INTERPRET=1``) replaces ``triton.jit`` functions with interpreted ones
that cannot be compiled; run this in a process without it::

    python -m kernels.triton.aot [--arch 90]       # one line per launch, exit status 1 on a failure

Used by tests/kernels/test_triton_aot.py and scripts/gpu_check.py's ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import torch

from pagedkv.config import env

#: torch dtype -> Triton signature type of a pointer to it.
_POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
            torch.int64: "*i64", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}


@dataclass(frozen=True)
class Case:
    """One model shape and dtype to launch every kernel at."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    fp8: bool = False  # an e4m3 cache (the query stays ``dtype``)
    tune: bool = False  # compile every tuning candidate (kernels.triton.tuning), not only the first


#: The project's shapes (SmolLM2-135M, a Llama-3-8B layer, Qwen2.5's 80-wide... and the
#: narrowest head a 16-bit dot must still take), each dtype a GPU runs.
CASES = (
    Case("smollm2 bf16", 9, 3, 64, torch.bfloat16),
    Case("smollm2 fp16", 9, 3, 64, torch.float16),
    Case("smollm2 fp32", 9, 3, 64, torch.float32, tune=True),
    Case("llama3-8b bf16", 32, 8, 128, torch.bfloat16, tune=True),
    Case("head_dim 80 fp16 bs 24", 28, 4, 80, torch.float16, block_size=24),
    Case("head_dim 8 bf16", 4, 2, 8, torch.bfloat16),
    Case("head_dim 8 fp16", 4, 2, 8, torch.float16),
    Case("smollm2 bf16 fp8 cache", 9, 3, 64, torch.bfloat16, fp8=True, tune=True),
)


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its runtime arguments, its constexprs."""

    case: str
    kernel: object  # the triton JITFunction
    args: tuple
    constexprs: dict
    #: Compiler options (num_warps, num_stages) of a tuning candidate; {} for Triton's defaults.
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        tuned = "".join(f" {k}={v}" for k, v in self.options.items())
        tile = f" TILE={self.constexprs['TILE']}" if self.options and "TILE" in self.constexprs else ""
        return f"{self.kernel.fn.__name__} [{self.case}{tile}{tuned}]"

    def signature(self) -> tuple[dict[str, str], dict[str, object]]:
        """Triton's ``signature`` (every argument's type, ``constexpr`` for the constants) and ``constexprs``."""
        names = self.kernel.arg_names
        sig: dict[str, str] = {}
        for name, value in zip(names, self.args):
            if isinstance(value, torch.Tensor):
                sig[name] = _POINTER[value.dtype]
            elif isinstance(value, bool):
                sig[name] = "i1"
            elif isinstance(value, int):
                sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{self.name}: argument {name} of type {type(value).__name__}")
        for name in self.constexprs:
            sig[name] = "constexpr"
        return sig, dict(self.constexprs)


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **constexprs)`` records the launch."""

    def __init__(self, kernel, case: str, into: list[Launch]):
        self.kernel, self.case, self.into = kernel, case, into

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            self.into.append(Launch(self.case, self.kernel, args, kwargs, options))

        return launch


def record(cases=CASES) -> list[Launch]:
    """Run every launch wrapper on CPU tensors at each case's shapes (decode with one split, with
    four, and with its splits read on the device as a CUDA graph's; a mixed prefill, the cache
    write, the block copy; the sampler's draws once); returns the launches made."""
    from kernels.triton import cache_ops, decode, draws, prefill

    launches: list[Launch] = []
    kernels = [(decode, "kernel_paged_decode"), (decode, "kernel_reduce_splits"), (prefill, "kernel_paged_prefill"),
               (cache_ops, "kernel_reshape_and_cache"), (cache_ops, "kernel_copy_blocks"),
               (draws, "kernel_uniforms")]
    real = {(m, n): getattr(m, n) for m, n in kernels}
    try:
        for c in cases:
            for (m, n), k in real.items():
                setattr(m, n, _Recorder(k, c.name, launches))
            _launch_all(c, decode, prefill, cache_ops)
            if c is cases[0]:  # the sampler's draws: one kernel whatever the model
                draws.uniforms(torch.zeros(3, dtype=torch.int64))
    finally:
        for (m, n), k in real.items():
            setattr(m, n, k)
    tune = {c.name for c in cases if c.tune}
    return [c for launch in launches for c in (candidates(launch) if launch.case in tune else [launch])]


def candidates(launch: Launch) -> list[Launch]:
    """``launch`` once per tuning candidate of its kernel (kernels.triton.tuning), or as it is."""
    from kernels.triton import tuning

    configs = {"kernel_paged_decode": tuning.DECODE, "kernel_paged_prefill": tuning.PREFILL}.get(
        launch.kernel.fn.__name__)
    if configs is None:
        return [launch]
    return [Launch(launch.case, launch.kernel, launch.args, {**launch.constexprs, **c.kwargs},
                   {"num_warps": c.num_warps, "num_stages": c.num_stages}) for c in configs]


def _launch_all(c: Case, decode, prefill, cache_ops) -> None:
    num_blocks, seqs, ctx = 8, 2, 40
    cache_dtype = torch.float8_e4m3fn if c.fp8 else c.dtype
    shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    k_cache = torch.zeros(shape, dtype=torch.float32).to(cache_dtype)
    v_cache = torch.zeros(shape, dtype=torch.float32).to(cache_dtype)
    scales = (torch.ones(c.num_kv_heads), torch.ones(c.num_kv_heads)) if c.fp8 else (None, None)
    tables = torch.zeros(seqs, num_blocks // seqs, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.zeros(seqs, c.num_q_heads, c.head_dim, dtype=c.dtype)
    for splits in (1, 4):
        decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, splits, ctx, *scales)
    # A CUDA graph's decode: the split count and size read on the device (kernels.plan.AttentionPlan.split_args).
    decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 4, ctx, *scales,
                                  split_args=torch.tensor([2, 32], dtype=torch.int32))
    new = 5
    qp = torch.zeros(seqs * new, c.num_q_heads, c.head_dim, dtype=c.dtype)
    starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32)
    prefill.paged_prefill_attention(qp, k_cache, v_cache, tables, starts, lens, 0.125, *scales)
    kv = torch.zeros(3, c.num_kv_heads, c.head_dim, dtype=c.dtype)
    cache_ops.reshape_and_cache(kv, kv, k_cache, v_cache, torch.arange(3, dtype=torch.int64), *scales)
    pool = torch.zeros(num_blocks, 2, 2, c.block_size, c.num_kv_heads, c.head_dim, dtype=torch.float32).to(cache_dtype)
    cache_ops.copy_blocks(pool.view(torch.uint8) if c.fp8 else pool, torch.tensor([[0, 1]], dtype=torch.int64))


def compile_launch(launch: Launch, arch: int) -> int:
    """Compile ``launch`` for ``sm_<arch>``; returns the cubin's size in bytes.

    Raises:
        triton.compiler.errors.CompilationError (or the backend's error): it does not compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs = launch.signature()
    compiled = triton.compile(ASTSource(fn=launch.kernel, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=launch.options or None)
    return len(compiled.asm["cubin"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper, 80: Ampere)")
    ap.add_argument("--json", action="store_true", help="one JSON object per launch instead of text")
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES],
                    help="only this case of CASES (repeat); default every one")
    args = ap.parse_args(argv)
    if env("TRITON_INTERPRET"):
        print("TRITON_INTERPRET=1 is set: interpreted kernels cannot be compiled; unset it", file=sys.stderr)
        return 2
    failed = 0
    for launch in record([c for c in CASES if not args.case or c.name in args.case]):
        t = time.perf_counter()
        try:
            size, error = compile_launch(launch, args.arch), ""
        except Exception as e:  # noqa: BLE001 - reported per launch
            size, error = 0, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            failed += 1
        seconds = time.perf_counter() - t
        if args.json:
            print(json.dumps({"launch": launch.name, "ok": not error, "cubin_bytes": size,
                              "seconds": round(seconds, 2), "error": error}), flush=True)
        else:
            print(f"{'ok  ' if not error else 'FAIL'} sm_{args.arch} {launch.name}: "
                  f"{f'{size} B cubin' if not error else error} ({seconds:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
