"""The deployments' front-ends hold the whole pool: compose and the one-pod Kubernetes stack hand the
memory service's admin token to the front-end (its lease is created with it, exempt from the default
per-lease block quota), through a volume only those two mount, read-only at the front-end; the
several-node Kubernetes stack, whose front-end cannot read a node's token, lifts the quota instead.
"""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT
from test_compose import FILES, flag, services

from memory_service.main import build_parser as memory_parser

K8S = ROOT / "deploy" / "k8s"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_compose_hands_the_admin_token_to_the_frontend_only(path):
    svcs = services(path)
    token = flag(svcs["memory"]["command"], "--admin-token-file")
    assert token and flag(svcs["frontend"]["command"], "--memory-admin-token-file") == token
    folder = token.rsplit("/", 1)[0]
    mounts = {name: [v for v in svc.get("volumes", []) if v.split(":")[1:2] == [folder]] for name, svc in svcs.items()}
    volume = mounts["memory"][0].split(":")[0]
    assert mounts["memory"] == [f"{volume}:{folder}"] and mounts["frontend"] == [f"{volume}:{folder}:ro"]
    assert [n for n, m in mounts.items() if m] == ["memory", "frontend"], mounts
    assert "mode=0700" in yaml.safe_load(path.read_text())["volumes"][volume]["driver_opts"]["o"]


def _containers(path) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {c["name"]: c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]}


def test_the_one_pod_stack_hands_the_admin_token_to_the_frontend_only():
    containers = _containers(K8S / "pagedkv-cpu.yaml")
    token = flag(containers["memory"]["args"], "--admin-token-file")
    assert token and flag(containers["frontend"]["args"], "--memory-admin-token-file") == token
    folder = token.rsplit("/", 1)[0]
    mounts = {n: [m for m in c.get("volumeMounts", []) if m["mountPath"] == folder] for n, c in containers.items()}
    assert [n for n, m in mounts.items() if m] == ["memory", "frontend"]
    assert not mounts["memory"][0].get("readOnly") and mounts["frontend"][0]["readOnly"]


def test_the_node_pods_lift_the_block_quota_for_the_front_end():
    args = _containers(K8S / "pagedkv-gpu-nodes.yaml")["memory"]["args"]
    assert memory_parser().parse_args(args[2:]).max_blocks_per_lease.resolve(1024) is None
