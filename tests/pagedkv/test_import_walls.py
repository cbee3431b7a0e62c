"""The walls between the packages: which package may import which (DESIGN.md; docs/design-notes.md,
"Package walls").

Every hand-written .py file of memory_service, compute_service, client, kernels and the shared
package (protos/pagedkv; generated *_pb2* code aside) is parsed, and every import in it, at module
level or inside a function, is checked against :data:`ALLOWED`; so are imports by name
(``importlib.import_module("...")``, ``__import__``) and strings that name a module of a package
the file may not import (a module name kept for a later dynamic import). The one allowed exception
is :data:`EXCEPTIONS`: the console entry point starts each service's ``main`` by module name,
lazily.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Each package and its source folder.
PACKAGES = {
    "memory_service": ROOT / "memory_service",
    "compute_service": ROOT / "compute_service",
    "client": ROOT / "client",
    "kernels": ROOT / "kernels",
    "pagedkv": ROOT / "protos" / "pagedkv",
}
#: The packages each package may import besides itself. The services reach each other and the
#: client reaches them over gRPC only (the generated code is the shared package's); kernels are
#: a library of ops under the services; the shared package imports none of the others.
ALLOWED = {
    "memory_service": {"pagedkv", "kernels"},
    "compute_service": {"pagedkv", "kernels"},
    "client": {"pagedkv"},
    "kernels": {"pagedkv"},
    "pagedkv": set(),
}
#: (file, module): the console entry point `pagedkv` starts each service's main by module name,
#: inside the subcommand (importlib), so `pagedkv memory` never loads the client's or model code.
EXCEPTIONS = {
    ("client/ops/cli.py", "memory_service.main"),
    ("client/ops/cli.py", "compute_service.main"),
}
#: (file, module): crossings still to remove (none: every wall holds).
PENDING: set[tuple[str, str]] = set()

_MODULE_NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+")
_IMPORT_CALLS = {"import_module", "__import__"}


def sources() -> list[tuple[str, Path]]:
    """(package, file) for every hand-written .py file of the packages."""
    out = []
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if "_pb2" not in path.name:
                out.append((pkg, path))
    return out


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, bool]:
    """node -> whether it lies inside a function."""
    inside: dict[ast.AST, bool] = {}

    def walk(node: ast.AST, in_fn: bool) -> None:
        inside[node] = in_fn
        fn = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            walk(child, fn)

    walk(tree, False)
    return inside


def imports(source: str) -> list[tuple[int, str, str, bool]]:
    """(line, module, how, inside a function) for every import of ``source``: ``import`` and
    ``from`` statements at any depth ("import"), import calls with a literal name ("call"), and
    string literals that are a dotted name of a project package ("name")."""
    tree = ast.parse(source)
    inside = _enclosing_functions(tree)
    found, named = [], set()  # named: literal arguments of import calls (not counted again as names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "import", inside[node]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, "import", inside[node]))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            arg = node.args[0] if node.args else None
            if name in _IMPORT_CALLS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value, "call", inside[node]))
                named.add(arg)
        elif isinstance(node, ast.Constant) and node not in named and isinstance(node.value, str) \
                and _MODULE_NAME.fullmatch(node.value):
            if node.value.split(".")[0] in PACKAGES:
                found.append((node.lineno, node.value, "name", inside[node]))
    return found


def crossings() -> list[tuple[str, int, str, str, str]]:
    """(file, line, package, imported module, how) for every import that crosses a wall."""
    out = []
    for pkg, path in sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, module, how, _ in imports(path.read_text()):
            top = module.split(".")[0]
            if top in PACKAGES and top != pkg and top not in ALLOWED[pkg]:
                out.append((rel, line, pkg, module, how))
    return out


def test_every_package_has_sources():
    counts = {pkg: sum(1 for p, _ in sources() if p == pkg) for pkg in PACKAGES}
    assert all(n > 0 for n in counts.values()), counts


def test_no_import_crosses_a_wall():
    bad = [c for c in crossings() if (c[0], c[3]) not in EXCEPTIONS | PENDING]
    assert not bad, "imports across the package walls (tests/pagedkv/test_import_walls.py, ALLOWED):\n" + "\n".join(
        f"{file}:{line}: {pkg} {how}s {module} ({pkg} may import only {sorted(ALLOWED[pkg]) or 'itself'})"
        for file, line, pkg, module, how in bad)


def test_the_exceptions_are_what_they_say():
    found = {(c[0], c[3]): c for c in crossings()}
    stale = sorted((EXCEPTIONS | PENDING) - set(found))
    assert not stale, f"listed crossings that no longer occur (remove them from the lists): {stale}"
    for key in EXCEPTIONS:  # the entry point names each service's main, and imports it by name, lazily
        assert found[key][4] == "name", found[key]
    cli = (ROOT / "client" / "ops" / "cli.py").read_text()
    services = {module for _, module, _,
                _ in imports(cli) if module.split(".")[0] in ("memory_service", "compute_service")}
    assert services == {module for _, module in EXCEPTIONS}  # each service's main, nothing else of theirs
    tree = ast.parse(cli)
    inside = _enclosing_functions(tree)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "import_module"]
    assert loads and all(inside[n] for n in loads), (
        "client/ops/cli.py imports services by name inside a subcommand only")


@pytest.mark.parametrize(
    "source, crossing",
    [
        ("from client.tokenizer import load_tokenizer\n", "import"),
        ("def f():\n    import client.cluster.router\n", "import"),
        ("def f():\n    from memory_service import layout\n", "import"),
        ("import importlib\ndef f():\n    return importlib.import_module('client.api')\n", "call"),
        ("SERVICE = 'memory_service.main'\n", "name"),
    ],
)
def test_a_crossing_is_found_at_module_level_and_inside_functions(source, crossing):
    (line, module, how, _), *rest = [f for f in imports(source) if f[1].split(".")[0] in ("client", "memory_service")]
    assert how == crossing and not rest
    assert module.split(".")[0] not in ALLOWED["compute_service"]
