"""Shared pieces of the benchmark scripts: the machine record, service processes, traces, output.

Every benchmark prints a table, writes ``benchmarks/results/<name>.json`` (with the machine it
ran on) and a PNG plot beside it (PNGs are not committed).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where results go: benchmarks/results, or $PAGEDKV_BENCH_RESULTS (a run on another machine).
RESULTS = Path(os.environ.get("PAGEDKV_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from client.ops.stack import LocalStack, ServiceProcess  # noqa: E402 - the source tree is on sys.path from here

os.environ.setdefault("PAGEDKV_LOG_LEVEL", "warning")


# ------------------------------------------------------------------ machine
def machine() -> dict:
    """CPU model, cores, load and library versions, recorded with every result."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0]}
    for mod in ("torch", "triton", "transformers", "grpc"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional library is recorded as such
            info[mod] = None
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch, or no usable driver
        info["gpu"] = None
    return info


# ----------------------------------------------------------------- services
#: Memory-service flags that lift the default per-lease block quota (half the pool) and the limit of
#: leases per uid: a benchmark's one client takes the whole pool, as before they existed. Flags a
#: benchmark gives after them win.
UNLIMITED = ["--max-blocks-per-lease", "none", "--max-leases-per-peer", "none"]


def Service(args: list[str], name: str, tmp: Path, timeout: float = 180.0, env: dict | None = None):  # noqa: N802
    """``python -m client.ops.cli <args>`` on a free port as a child process (a :class:`ServiceProcess`).

    A memory service writes its admin token to ``tmp/<name>.admin-token`` (:func:`admin_token`),
    not to ``$PAGEDKV_HOME/admin-token``, which belongs to the host's ``pagedkv up``.
    """
    if args[:1] == ["memory"] and "--admin-token-file" not in args:
        args = [*args, "--admin-token-file", str(Path(tmp) / f"{name}.admin-token")]
    if args[:1] == ["memory"]:  # a benchmark's client measures the pool, not a lease's share of it
        args = ["memory", *UNLIMITED, *args[1:]]
    return ServiceProcess.pagedkv(args, tmp, name, env=env, timeout=timeout, cwd=ROOT)


def admin_token(name: str, tmp: Path) -> str:
    """The admin token of the memory service :func:`Service` started as ``name`` under ``tmp``."""
    return (Path(tmp) / f"{name}.admin-token").read_text().strip()


class Stack(LocalStack):
    """A memory service (``memory_args``) and one compute worker, each its own process.

    ``device`` ("cpu", "cuda" or "cuda:N") and ``model`` (a model source: "smollm2", a .gguf file
    or a Hugging Face directory) go to both services; when None, the services' defaults.
    ``worker_args`` go to the worker alone, ``env`` (added to this process's) to both.
    Started and stopped by ``with Stack(...) as stack:``.
    """

    def __init__(self, memory_args: list[str], name: str = "stack", device: str | None = None,
                 model: str | None = None, worker_args: list[str] | None = None, env: dict[str, str] | None = None):
        # The admin token goes to a folder of its own, not to $PAGEDKV_HOME (the host's `pagedkv up`).
        self._token_dir = tempfile.TemporaryDirectory(prefix="pagedkv-bench-")
        self.admin_token_file = Path(self._token_dir.name) / "admin-token"
        super().__init__(["--lease-ttl", "600", "--admin-token-file", str(self.admin_token_file), *UNLIMITED,
                          *memory_args],
                         worker_args=list(worker_args or []), device=device, model=model, name=name, cwd=ROOT,
                         timeout=180.0, env=env)

    def stop(self) -> None:
        super().stop()
        self._token_dir.cleanup()

    @property
    def worker(self) -> ServiceProcess:
        return self.workers[0]

    def engine(self, config=None, tokenizer=None):
        """A :class:`client.engine.core.Engine` on this stack (the caller closes it)."""
        from client.engine.core import Engine
        from client.services import MemoryClient, WorkerClient
        from pagedkv.model.tokenizer import load_tokenizer

        tok = tokenizer or load_tokenizer("smollm2")
        return Engine(MemoryClient(self.memory.address), [WorkerClient(self.worker.address)], tok,
                      config=config, lease_ttl=600)


def run_engine(engine, requests, timeout: float = 3600.0) -> float:
    """Add ``requests``, step until all finish; returns wall seconds."""
    t0 = time.perf_counter()
    for r in requests:
        engine.add(r)
    while engine.has_work():
        engine.step()
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"requests not done after {timeout:.0f} s")
    return time.perf_counter() - t0


# ------------------------------------------------------------------- traces
#: The vLLM paper's dataset means (Fig. 11): input / output tokens.
DATASETS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
#: Log-normal shape (sigma of the log); the mean is kept by mu = ln(mean) - sigma^2 / 2.
SIGMA = 0.8
MAX_SEQ_LEN = 2048


@dataclass(slots=True)
class TraceRequest:
    """One request of a synthetic trace: arrival (s), prompt and output lengths (tokens)."""

    arrival: float
    prompt_len: int
    output_len: int


def lengths(dataset: str, n: int, rng: random.Random, max_total: int = MAX_SEQ_LEN) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths, log-normal with the dataset's means, total <= max_total."""
    p_mean, o_mean = DATASETS[dataset]
    out = []
    for _ in range(n):
        p = max(1, round(rng.lognormvariate(math.log(p_mean) - SIGMA ** 2 / 2, SIGMA)))
        o = max(1, round(rng.lognormvariate(math.log(o_mean) - SIGMA ** 2 / 2, SIGMA)))
        p = min(p, max_total // 2)
        o = min(o, max_total - p)
        out.append((p, o))
    return out


def poisson_trace(dataset: str, n: int, rate: float, seed: int) -> list[TraceRequest]:
    """``n`` requests arriving as a Poisson process of ``rate`` requests per unit time."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for p, o in lengths(dataset, n, rng):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, p, o))
    return out


# ------------------------------------------------------------------- output
def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank), None for an empty list."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(title: str, header: list[str], rows: list[list], widths: list[int] | None = None) -> str:
    """A plain text table; numbers are already formatted by the caller."""
    widths = widths or [max(len(str(h)), *(len(str(r[i])) for r in rows)) + 2 for i, h in enumerate(header)]
    lines = [title, "".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths)))]
    for r in rows:
        lines.append("".join(f"{c!s:>{w}}" if i else f"{c!s:<{w}}" for i, (c, w) in enumerate(zip(r, widths))))
    text = "\n".join(lines)
    print("\n" + text)
    return text


def shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it (for messages)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def write_result(name: str, result: dict) -> Path:
    """Write ``benchmarks/results/<name>.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {shown(out)}")
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing (extra ``bench``)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {shown(out)}")
