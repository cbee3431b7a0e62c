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


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protos"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "kernels.triton.aot", "--arch", "90", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    launches = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [f"{r['launch']}: {r['error']}" for r in launches if not r["ok"]]
    assert not failed, "kernels that do not compile for sm_90:\n" + "\n".join(failed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {r["launch"].split(" [")[0] for r in launches}
    assert names == {"kernel_paged_decode", "kernel_reduce_splits", "kernel_paged_prefill",
                     "kernel_reshape_and_cache", "kernel_copy_blocks"}, names
    assert any("head_dim 8 fp16" in r["launch"] and r["launch"].startswith("kernel_paged_prefill") for r in launches)
    assert all(r["cubin_bytes"] > 0 for r in launches)
