"""deploy/k8s: the Kubernetes manifests, validated offline, and the properties the stack relies on.

Validation, no network:
- every core object with kubernetes-validate's bundled schemas in strict mode (a field the API does
  not have is an error): pagedkv-cpu.yaml against Kubernetes 1.30 and 1.34, pagedkv-gpu-nodes.yaml
  against 1.34 (the first release with resource.k8s.io/v1, which its GPU claim needs; 1.33 must
  refuse it) and the newest release the package bundles;
- the ServiceMonitor against the v1 openAPIV3Schema of prometheus-operator v0.93.0's CRD
  (deploy/k8s/crds/), with jsonschema, strict the same way.

Properties (pagedkv-gpu-nodes.yaml): one node pod per Kubernetes node sharing its PID namespace and
one GPU claim between the memory service and every worker; every worker transfers (--node-transfers,
--device cuda); the memory service reads the transfer key from the Secret through a mode-0400 copy
that load_transfer_key accepts (the Secret's own file, group-readable under fsGroup, it refuses);
every container's command parses with pagedkv's own parsers and presents its member's certificate,
mounted from the TLS Secret that `pagedkv certs` makes; probes on every container; the front-end
dials node 0 by the names the certificates carry; the ServiceMonitor reaches both /metrics.
"""

from __future__ import annotations

import copy
import os
import shlex
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT
from cryptography import x509
from test_compose import code_env_vars

from client.ops.cli import build_parser as cli_parser
from client.serve.config import parse_args as serve_args
from compute_service.main import build_parser as compute_parser
from memory_service.main import build_parser as memory_parser
from pagedkv.runtime.certs import run as run_certs
from pagedkv.runtime.transfer import load_transfer_key

K8S = ROOT / "deploy" / "k8s"
CPU, GPU = K8S / "pagedkv-cpu.yaml", K8S / "pagedkv-gpu-nodes.yaml"
CRD = K8S / "crds" / "monitoring.coreos.com_servicemonitors.yaml"
#: Kinds that are not core Kubernetes: validated against their CRD's schema instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
#: The newest Kubernetes release whose schemas the installed kubernetes-validate carries.
NEWEST = kubernetes_validate.utils.latest_version()
TLS = "/etc/pagedkv/tls"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return _docs(GPU)


@pytest.fixture(scope="module")
def node(gpu) -> dict:
    """The node pod's spec (the StatefulSet's template)."""
    return _one(gpu, "StatefulSet", "pagedkv-node")["spec"]["template"]["spec"]


def _containers(pod: dict, prefix: str) -> list[dict]:
    return [c for c in pod["containers"] if c["name"].startswith(prefix)]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _volume_at(pod: dict, container: dict, path: str) -> dict:
    """The pod volume that ``container`` mounts at ``path``."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("path, version", [(CPU, "1.30"), (CPU, "1.34"), (GPU, "1.34"), (GPU, NEWEST)],
                         ids=lambda v: v.name if isinstance(v, Path) else v)
def test_core_objects_validate_strictly(path, version):
    docs = [d for d in _docs(path) if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_gpu_claim_needs_kubernetes_1_34(gpu):
    """The DRA GPU claim is resource.k8s.io/v1, GA in 1.34: a 1.33 schema set has no such kind."""
    template = _one(gpu, "ResourceClaimTemplate")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(template, "1.33", strict=True)


def _strict(schema: dict) -> dict:
    """``schema`` (an OpenAPI v3 structural schema) with every object that lists its properties
    closed to others, as the API server's Strict field validation treats them, except where the CRD
    keeps unknown fields (x-kubernetes-preserve-unknown-fields)."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = _strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            out[key] = [_strict(s) for s in schema[key]]
    return out


@pytest.fixture(scope="module")
def servicemonitor_validator():
    (crd,) = _docs(CRD)
    assert crd["spec"]["names"]["kind"] == "ServiceMonitor"
    assert crd["metadata"]["annotations"]["operator.prometheus.io/version"] == "0.93.0"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft4Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def test_servicemonitor_validates_against_its_crd_and_reaches_both_metrics(gpu, node, servicemonitor_validator):
    monitor = _one(gpu, "ServiceMonitor")
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in servicemonitor_validator.iter_errors(monitor)]
    assert not errors, errors
    wrong = copy.deepcopy(monitor)
    wrong["spec"]["endpoints"][0]["prot"] = "metrics"  # a typo is an error, as kubectl's strict validation says
    assert not servicemonitor_validator.is_valid(wrong)

    # Each endpoint's port is a named port of a selected Service that reaches a /metrics.
    (expr,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expr["key"] == "app" and expr["operator"] == "In"
    services = {s["metadata"]["name"]: s for s in gpu if s["kind"] == "Service"
                and s["metadata"]["labels"].get("app") in expr["values"]}
    assert set(services) == {"pagedkv-node", "pagedkv-serve"}
    ports = {(name, p["name"]): p["targetPort"] for name, s in services.items() for p in s["spec"]["ports"]}
    by_port = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    assert by_port == {"metrics": "/metrics", "http": "/metrics"}
    (memory,) = _containers(node, "memory")
    assert ports[("pagedkv-node", "metrics")] == int(_flag(memory["args"], "--metrics-port"))
    serve = _one(gpu, "Deployment", "pagedkv-serve")["spec"]["template"]["spec"]["containers"][0]
    assert ports[("pagedkv-serve", "http")] == serve_args(serve["args"][2:]).port
    assert '@app.get("/metrics")' in (ROOT / "client" / "serve" / "app.py").read_text()


def test_node_pod_shares_processes_and_one_gpu(gpu, node):
    """Legacy CUDA IPC: the memory service and its workers in one PID (and IPC) namespace, on one GPU."""
    assert node["shareProcessNamespace"] is True and not node.get("hostIPC") and not node.get("hostPID")
    (claim,) = node["resourceClaims"]
    template = _one(gpu, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "count": 1}
    gpu_containers = _containers(node, "memory") + _containers(node, "compute")
    assert len(gpu_containers) == len(node["containers"]) >= 2
    for c in gpu_containers:
        # Every one names the pod's single claim; none asks the device plugin for a GPU of its own.
        assert c["resources"] == {"claims": [{"name": claim["name"]}]}, c["name"]
    (term,) = node["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    sts = _one(gpu, "StatefulSet", "pagedkv-node")
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    headless = _one(gpu, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # The worker socket: one in-memory folder, mounted by the memory service and the workers only.
    (memory,) = _containers(node, "memory")
    socket = _flag(memory["args"], "--worker-socket")
    for c in _containers(node, "compute"):
        assert _flag(c["args"], "--memory-socket") == socket
        assert _volume_at(node, c, os.path.dirname(socket)) == _volume_at(node, memory, os.path.dirname(socket))
    assert _volume_at(node, memory, os.path.dirname(socket))["emptyDir"]["medium"] == "Memory"


def test_workers_transfer_and_the_memory_service_holds_the_transfer_key(node, tmp_path):
    for c in _containers(node, "compute"):
        args = compute_parser().parse_args(c["args"][2:])
        assert args.node_transfers and args.device == "cuda", c["name"]
    (memory,) = _containers(node, "memory")
    args = memory_parser().parse_args(memory["args"][2:])
    assert args.node_name == "$(POD_NAME)" and args.device == "cuda"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in memory["env"]
    assert args.transfer_key_file == "/etc/pagedkv/transfer/key"
    key_dir = os.path.dirname(args.transfer_key_file)
    copy = _volume_at(node, memory, key_dir)
    assert copy["emptyDir"]["medium"] == "Memory"

    # The init container copies the key from the Secret (mode 0400) into that folder.
    (init,) = node["initContainers"]
    assert _volume_at(node, init, key_dir) == copy
    (secret_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] != key_dir]
    secret = _volume_at(node, init, secret_mount["mountPath"])["secret"]
    assert secret["secretName"] == "pagedkv-transfer-key" and secret["defaultMode"] == 0o400
    assert [v for v in node["volumes"] if v.get("secret", {}).get("secretName") == "pagedkv-transfer-key"] \
        == [_volume_at(node, init, secret_mount["mountPath"])]
    assert not any(m["name"] == secret_mount["name"] for c in node["containers"] for m in c["volumeMounts"])

    # Run its command on local folders: the Secret's file as the kubelet leaves it under fsGroup
    # (0440) is refused, the copy is accepted.
    src, dst = tmp_path / "secret", tmp_path / "transfer"
    src.mkdir()
    dst.mkdir()
    key = os.urandom(32)
    (src / "key").write_text(key.hex() + "\n")
    (src / "key").chmod(0o440)
    assert init["command"][:2] == ["sh", "-c"]
    script = init["command"][2].replace(secret_mount["mountPath"], str(src)).replace(key_dir, str(dst))
    subprocess.run(["sh", "-c", script], check=True, timeout=10)
    with pytest.raises(ValueError, match="readable by its owner only"):
        load_transfer_key(src / "key")
    assert load_transfer_key(dst / "key") == key


def _tls_items(pod: dict, container: dict) -> set[str]:
    """The files of the TLS Secret that ``container`` sees at /etc/pagedkv/tls (each under its own name)."""
    secret = _volume_at(pod, container, TLS)["secret"]
    assert secret["secretName"] == "pagedkv-tls" and secret["defaultMode"] == 0o400
    assert all(i["key"] == i["path"] for i in secret["items"])
    return {i["path"] for i in secret["items"]}


def test_every_command_parses_and_presents_its_members_certificate(gpu, node, monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith("PAGEDKV_"):
            monkeypatch.delenv(k)
    serve_pod = _one(gpu, "Deployment", "pagedkv-serve")["spec"]["template"]["spec"]
    pods = [(node, c) for c in node["containers"]] + [(serve_pod, c) for c in serve_pod["containers"]]
    # Parsers are built under each container's environment: their defaults read it.
    members = {"memory": ("memory", lambda a: memory_parser().parse_args(a)),
               "compute": ("worker", lambda a: compute_parser().parse_args(a)), "serve": ("scheduler", serve_args)}
    known = code_env_vars()
    for pod, c in pods:
        (prefix,) = [p for p in members if c["name"].startswith(p)]
        member, parse = members[prefix]
        assert c["args"][:2] == ["pagedkv", prefix]
        with monkeypatch.context() as env:
            for var in c.get("env", []):
                assert not var["name"].startswith("PAGEDKV_") or var["name"] in known, \
                    f"{c['name']} sets {var['name']}, which no pagedkv code reads"
                if "value" in var:
                    env.setenv(var["name"], var["value"])
            ns = parse(c["args"][2:])
        assert (ns.tls_cert, ns.tls_key, ns.tls_ca) == (f"{TLS}/{member}.pem", f"{TLS}/{member}-key.pem",
                                                        f"{TLS}/ca.pem")
        assert ns.host == "0.0.0.0"
        # Its own three files of the TLS Secret, nothing more (no ca-key.pem, no other key); the front
        # also holds the router's pair, for the nodes' KV event streams.
        router = {"router.pem", "router-key.pem"} if prefix == "serve" else set()
        assert _tls_items(pod, c) == {f"{member}.pem", f"{member}-key.pem", "ca.pem"} | router, c["name"]
        if prefix == "serve":
            assert (ns.router_tls_cert, ns.router_tls_key) == (f"{TLS}/router.pem", f"{TLS}/router-key.pem")
        assert all(m["readOnly"] for m in c["volumeMounts"] if m["mountPath"] == TLS)

    # The front-end names every node pod by its stable name, at the ports its containers serve.
    front = serve_args(serve_pod["containers"][0]["args"][2:])
    sts = _one(gpu, "StatefulSet", "pagedkv-node")
    (memory,) = _containers(node, "memory")
    assert [n.name for n in front.nodes] == [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    for n in front.nodes:
        host = f"{n.name}.{sts['spec']['serviceName']}"
        assert n.memory == f"{host}:{_flag(memory['args'], '--port')}"
        assert n.workers == [f"{host}:{_flag(c['args'], '--port')}" for c in _containers(node, "compute")]

    # The header's `pagedkv certs` line makes the files the volumes name, and its server
    # certificates name every node the StatefulSet runs.
    (line,) = [ln for ln in GPU.read_text().splitlines() if "pagedkv certs --out" in ln]
    argv = shlex.split(line.lstrip("# ").replace("$NS", "pagedkv"))
    assert argv[:2] == ["pagedkv", "certs"]
    args = cli_parser().parse_args(argv[1:] + ["--out", str(tmp_path / "tls")])
    assert run_certs(args) == 0
    made = {p.name for p in (tmp_path / "tls").iterdir()}
    assert {i for pod, c in pods for i in _tls_items(pod, c)} <= made
    nodes = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}" for i in range(sts["spec"]["replicas"])}
    for member in ("memory", "worker"):
        cert = x509.load_pem_x509_certificate((tmp_path / "tls" / f"{member}.pem").read_bytes())
        names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                    .get_values_for_type(x509.DNSName))
        assert nodes | {f"{n}.pagedkv.svc" for n in nodes} <= names, member


def test_probes_on_every_container(gpu, node):
    """Memory service and workers: startup, readiness and liveness run docker/healthcheck.py over
    mutual TLS with the container's own files (the kubelet's grpc probe cannot present a client
    certificate). The front-end: readiness on /health, liveness on its port."""
    for c in node["containers"]:
        port = _flag(c["args"], "--port")
        assert {p["containerPort"] for p in c["ports"]} >= {int(port)}
        ns_tls = [_flag(c["args"], f) for f in ("--tls-cert", "--tls-key", "--tls-ca")]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["python", "/opt/pagedkv/docker/healthcheck.py",
                                   f"127.0.0.1:{port}"], (c["name"], probe)
            assert [_flag(command, f) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == ns_tls
            assert c[probe]["timeoutSeconds"] > 3  # healthcheck.py's own timeout is 3 s
    serve = _one(gpu, "Deployment", "pagedkv-serve")["spec"]["template"]["spec"]["containers"][0]
    assert serve["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert serve["livenessProbe"]["tcpSocket"] == {"port": 8000}
    assert '@app.get("/health")' in (ROOT / "client" / "serve" / "app.py").read_text()
