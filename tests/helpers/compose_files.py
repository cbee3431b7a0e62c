"""The compose files read as the tests read them: interpolated with their defaults, each service's
`pagedkv` command parsed by the CLI's own parser, published ports, and the shell commands their
header comments show (tests/system/test_compose.py)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
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
    "PAGEDKV_FRONTEND_HOST_PORT",
    "PAGEDKV_MEMORY_HOST_PORT",
    "PAGEDKV_METRICS_HOST_PORT",
    "PAGEDKV_COMPUTE_HOST_PORTS",
}
#: The gRPC services (published on the host's loopback only) and the HTTP front-end.
GRPC_SERVICES = ("memory", "compute")
#: `pagedkv <subcommand>` each service runs.
SUBCOMMANDS = {"certs": "certs", "memory": "memory", "compute": "compute", "frontend": "serve", "client": "generate"}
#: Where the compose files mount the plane's certificates (the `tls` volume, made by `certs`).
TLS_DIR = "/etc/pagedkv/tls"
#: The certificate each service presents on the internal plane (`pagedkv certs` file stems).
TLS_MEMBER = {"memory": "memory", "compute": "worker", "frontend": "scheduler", "client": "scheduler"}
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
#: The grpcurl binary (the dev extra installs it beside this Python).
GRPCURL = shutil.which("grpcurl") or str(BIN / "grpcurl")

#: Hugging Face's own variables (huggingface_hub reads them in the containers), passed from the
#: host's shell: the cache (HF_HOME, also the host folder mounted), the token, offline mode.
HUB_VARS = {"HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE"}
#: Where the compose files mount the host's Hugging Face cache in the containers (their HF_HOME).
HF_HOME_DIR = "/var/lib/huggingface"
#: Container environment variables read by libraries rather than by pagedkv.
FOREIGN_ENV_VARS = {
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "NVIDIA_TF32_OVERRIDE",
    "TRITON_CACHE_DIR",
    *HUB_VARS,
}

VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value):
    """Resolve `${VAR}` / `${VAR:-default}` with the defaults, as `docker compose` does with an empty environment."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: m["default"] or "", value).replace("$$", "$")
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
    """PAGEDKV_* names the project's code reads from the environment: the registry's (canonical
    names and aliases; tests/pagedkv/test_config.py holds every read to the registry)."""
    from pagedkv.config import ENV_VARS

    return {n for v in ENV_VARS.values() for n in (v.name, *v.aliases) if n.startswith("PAGEDKV_")}


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
    elif sub == "serve":
        # build_parser's flags plus parse_args' own checks (ranges, dtype pairs, API keys).
        from client.serve.config import parse_args

        return sub, parse_args(command[2:])
    else:
        from client.ops.cli import build_parser

        return sub, build_parser().parse_args(command[1:])
    return sub, build_parser().parse_args(command[2:])


def service_port(svc: dict, monkeypatch) -> int:
    return parse_command(svc["command"], svc.get("environment", {}), monkeypatch)[1].port


def published_ports(svc: dict) -> list[tuple[str | None, str, int]]:
    """(host ip or None, host port or range, container port) of each `ports:` entry."""
    out = []
    for entry in svc.get("ports", []):
        parts = str(entry).split(":")
        ip = parts[0] if len(parts) == 3 else None
        out.append((ip, parts[-2], int(parts[-1])))
    return out


def header_commands(path: Path, program: str) -> list[list[str]]:
    """The commands of ``path``'s header comment (its lines before the first that is not a comment)
    that run ``program``, each as argv: a line ending in a backslash joined with the next, a trailing
    ``# comment`` (after two spaces) dropped."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").strip())
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    commands = (re.split(r"\s{2,}#", line)[0].split() for line in text.splitlines())
    return [argv for argv in commands if argv[:1] == [program]]
