"""Every Triton kernel compiles for sm_90 at the launches its wrapper makes, on a CPU (kernels.triton.aot).

No GPU has run the Triton path yet; a kernel that does not compile for Hopper would fail the
first real step. Each launch wrapper runs on CPU tensors with the kernel replaced by a recorder,
and each recorded launch is compiled down to a cubin with Triton's bundled ptxas, in a process
without TRITON_INTERPRET (interpreted kernels cannot be compiled). The shapes include a head_dim
of 8 with 16-bit queries: tl.dot needs K >= 16 there, so the kernels pad the head dim to 16
(kernels.triton.paged.dim_pad); their results at that width are checked against the fp64
reference in tests/kernels/test_kernels_interpret.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


#: `make test`: three shapes (SmolLM2 in bf16, the 8-wide head, and every tuning candidate at a
#: Llama-3-8B layer); `make test-full` (PAGEDKV_TEST_FULL=1): every case of kernels.triton.aot.
BOUNDED = ["--case", "smollm2 bf16", "--case", "head_dim 8 fp16", "--case", "llama3-8b bf16"]


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protos"), env.get("PYTHONPATH", "")])
    cases = [] if os.environ.get("PAGEDKV_TEST_FULL") == "1" else BOUNDED
    proc = subprocess.run([sys.executable, "-m", "kernels.triton.aot", "--arch", "90", "--json", *cases], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    launches = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [f"{r['launch']}: {r['error']}" for r in launches if not r["ok"]]
    assert not failed, "kernels that do not compile for sm_90:\n" + "\n".join(failed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {r["launch"].split(" [")[0] for r in launches}
    assert names == {"kernel_paged_decode", "kernel_reduce_splits", "kernel_paged_prefill",
                     "kernel_reshape_and_cache", "kernel_copy_blocks", "kernel_uniforms"}, names
    assert any("head_dim 8 fp16" in r["launch"] and r["launch"].startswith("kernel_paged_prefill") for r in launches)
    assert all(r["cubin_bytes"] > 0 for r in launches)
    from kernels.triton import tuning

    tuned = {r["launch"] for r in launches if "llama3-8b bf16 TILE=" in r["launch"]}
    assert len(tuned) == len({(c.kwargs["TILE"], c.num_warps, c.num_stages) for c in tuning.DECODE}) + \
        len(tuning.PREFILL), sorted(tuned)  # every candidate of both attention kernels (the split pair shares names)


def test_split_counts_and_context_lengths_compile_nothing_new():
    """The decode kernels take the split count and the context per split at run time: launches at
    3 and 7 splits (and other lengths) have the same compile-time constants, so one compiled
    kernel serves a sequence as it grows (as a constexpr, a new count recompiled both kernels)."""
    import torch

    from kernels.triton import aot, decode

    launches = []
    real = decode.kernel_paged_decode, decode.kernel_reduce_splits
    decode.kernel_paged_decode = aot._Recorder(real[0], "", launches)
    decode.kernel_reduce_splits = aot._Recorder(real[1], "", launches)
    try:
        cache = torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16)
        q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
        tables = torch.zeros(2, 8, dtype=torch.int32)
        for splits, ctx in ((3, 100), (7, 128), (64, 90)):
            lens = torch.full((2,), ctx, dtype=torch.int32)
            decode.paged_decode_attention(q, cache, cache, tables, lens, 0.125, splits, ctx)
    finally:
        decode.kernel_paged_decode, decode.kernel_reduce_splits = real
    by_kernel: dict[str, list] = {}
    for launch in launches:
        by_kernel.setdefault(launch.kernel.fn.__name__, []).append(launch)
    assert {k: len(v) for k, v in by_kernel.items()} == {"kernel_paged_decode": 3, "kernel_reduce_splits": 3}
    for name, group in by_kernel.items():
        assert all(g.constexprs == group[0].constexprs for g in group), name
        assert [g.args[g.kernel.arg_names.index("num_splits")] for g in group] == [3, 7, 64]
        if hasattr(group[0].kernel, "do_not_specialize"):  # a JITFunction (not the interpreter's stand-in)
            assert "num_splits" in group[0].kernel.do_not_specialize, name  # no variant for counts divisible by 16
