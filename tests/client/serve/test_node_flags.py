"""`pagedkv serve --node`: what a node spec says, and every way it can be wrong (a usage error, exit 2)."""

from __future__ import annotations

import pytest

from client.cluster.core import NodeSpec, parse_node
from client.serve.config import parse_args


def test_a_node_names_its_memory_service_workers_and_roles():
    assert parse_node("a=10.0.0.1:50051,workers=10.0.0.1:50052,10.0.0.1:50053,role=prefill") == NodeSpec(
        "a", "10.0.0.1:50051", ["10.0.0.1:50052", "10.0.0.1:50053"], "prefill", [])
    assert parse_node("b=h:1,workers=h:2@prefill,h:3@decode") == NodeSpec("b", "h:1", ["h:2", "h:3"], "both",
                                                                         ["prefill", "decode"])
    args = parse_args(["--node", "a=h:1,workers=h:2", "--node", "b=g:1,workers=g:2,role=decode"])
    assert [n.name for n in args.nodes] == ["a", "b"] and args.nodes[1].role == "decode"


def test_nodes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDKV_NODE", "a=h:1,workers=h:2; b=g:1,workers=g:2,role=decode")
    assert [(n.name, n.role) for n in parse_args([]).nodes] == [("a", "both"), ("b", "decode")]


@pytest.mark.parametrize("spec, why", [
    ("a", "NAME=MEMORY_ADDR"), ("=h:1,workers=h:2", "NAME=MEMORY_ADDR"), ("a=h:1", "workers"),
    ("a=h:1,workers=h:2,role=fast", "role"), ("a=h:1,workers=h:2@fast", "role"), ("a=h:1,gpus=2", "unknown key"),
    ("a=h:1,h:2", "follows no key"), ("a=h:1,workers=h:2,role=prefill,role=decode", "role"),
    ("a=h:1,workers=h:2,,h:3", "empty worker"), ("a=h:1,workers=", "empty worker"),
])
def test_a_bad_node_spec_names_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_node(spec)


@pytest.mark.parametrize("argv, why", [
    (["--node", "a=h:1,workers=h:2", "--node", "a=g:1,workers=g:2"], "each node name once"),
    (["--node", "a=h:1,workers=h:2", "--memory", "h:1"], "replaces --memory"),
    (["--node", "a=h:1"], "workers"),
])
def test_serve_refuses_bad_node_flags(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err
