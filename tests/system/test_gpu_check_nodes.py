"""scripts/gpu_check_nodes.py on cpu pools: its checks pass here, so the GPU run checks the GPU, not the script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_node_transfer_section_passes_on_cpu_pools():
    spec = importlib.util.spec_from_file_location("gpu_check_nodes", ROOT / "scripts" / "gpu_check_nodes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = []
    mod.run(lambda name, ok, detail="": results.append((name, ok, detail)), device="cpu", blocks=8, repeats=1)
    assert len(results) == 4 and all(ok for _, ok, _ in results), results
