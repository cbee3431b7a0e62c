"""scripts/gpu_check.py --dry-run on the CPU, through both phases at reduced shapes.

The device check runs on a lent GPU only now and then, with minutes to spare; what a CPU can
check of it is checked here, so that a lent GPU checks the GPU, not the script: the kernels phase
compiles the Triton launches for sm_90, the services phase runs every check on CPU stacks with a
2-layer model (receipts read by another worker, greedy tokens against the reference stack, the
pool handle, `pagedkv serve`, host tier, node transfers, the memory service exiting first, a cpu
memory service refusing --gpu-memory-utilization and the GPU budget on a fake device), and
every result is in results.jsonl as it ends. A phase whose budget is spent starts nothing more
and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    path = tmp_path / "results.jsonl"
    return proc, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_dry_run_passes_every_check_of_both_phases(tmp_path):
    proc, results = run(tmp_path, "--dry-run")
    failed = [f"{r['phase']}: {r['name']}: {r['detail']}" for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + proc.stdout[-3000:] + proc.stderr[-3000:]
    names = {(r["phase"], r["name"].split(" (")[0].split(":")[0]) for r in results}
    for want in [("kernels", "sm_90 compile"),
                 ("services", "receipts"),
                 ("services", "greedy tokens equal, cpu"),
                 ("services", "n=2 greedy samples"),
                 ("services", "cpu pool"),
                 ("services", "pagedkv serve"),
                 ("services", "memory service exits first"),
                 ("services", "host tier"),
                 ("services", "node transfers"),
                 ("services", "pool sizing")]:
        assert want in names, (want, sorted(names))
    compiled = [r for r in results if r["name"].startswith("sm_90 compile")]
    assert {r["name"].split(": ")[1].split(" [")[0] for r in compiled} == {
        "kernel_paged_decode", "kernel_reduce_splits", "kernel_paged_prefill", "kernel_reshape_and_cache",
        "kernel_copy_blocks", "kernel_uniforms"}
    assert all(r["t"] >= 0 for r in results) and results == sorted(results, key=lambda r: r["t"])


def test_a_spent_budget_starts_nothing_and_fails(tmp_path):
    proc, results = run(tmp_path, "--cpu-only", "--phase-seconds", "0", "--nodes", "skip")
    skipped = [r for r in results if r["detail"] == "skipped: the phase's time budget is spent"]
    assert proc.returncode == 1
    assert {r["phase"] for r in skipped} == {"kernels", "services"}
    assert not [r for r in results if r["phase"] == "services" and r["ok"] and r["name"] != "random SmolLM2-layout "
                "model written"]
