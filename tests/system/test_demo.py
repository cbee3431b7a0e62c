"""`make demo` in a bounded form: real services as processes, real prompts, the printed tables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import private_home

ROOT = Path(__file__).resolve().parents[2]


def test_demo_quick(tmp_path):
    # float32: the greedy answer below is a reference (bfloat16, the default on a CPU with AVX-512
    # BF16, flips this prompt's first token, a near-tie of 0.09 in float32's logits).
    env = {**os.environ, "PAGEDKV_HOME": str(tmp_path), "PAGEDKV_KV_CACHE_DTYPE": "float32",
           "COLUMNS": "160", "HOME": os.environ.get("HOME", str(tmp_path))}
    private_home(tmp_path)  # the default home's caches shared, so the services start in seconds
    out = subprocess.run([sys.executable, "scripts/demo.py", "--quick", "--memory-port", "0", "--worker-port", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert "The capital of France is Paris." in text
    assert "SmolLM2-135M-Instruct in float32" in text  # the dtype the run used
    assert re.search(r"\d+ output tokens in [\d.]+ s = [\d.]+ tokens/s", text)
    # The block table captured while the three samples shared their prompt blocks.
    rows = [line for line in text.splitlines() if re.search(r"story\[\d\]", line)]
    assert len(rows) == 3, text
    shared = [set(re.findall(r"\b(\d+)\*3\b", r)) for r in rows]
    assert shared[0] and shared[0] == shared[1] == shared[2]
    assert re.search(r"after the run: used blocks 0, available (\d+) of \1", text)
    assert "stopped" in text and not (tmp_path / "state.json").exists()
