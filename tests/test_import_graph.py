"""The import graph of `cluster/` and `deployments/` has no cycle, counting imports inside functions
(which hide a cycle from Python at import time but not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "deployments")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every module under PACKAGES (a package is its `__init__`)."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, source: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The modules of `modules` that module `name` imports anywhere in `source` (a `from a import b`
    counts `a.b` when that is a module, else `a`).

    >>> mods = {"p", "p.a", "p.b", "p.c"}
    >>> sorted(imports_of("p.a", "import p.b\\ndef f():\\n    from p import c, x\\n", mods))
    ['p', 'p.b', 'p.c']
    >>> sorted(imports_of("p.a", "from .b import y\\nfrom . import c\\n", mods))
    ['p.b', 'p.c']
    """
    def owner(dotted: str):
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {owner(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the importing module's package
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found |= {owner(f"{base}.{a.name}") for a in node.names}
    return found - {None, name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted.

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cluster_and_deployments_import_no_cycle():
    files = module_files()
    graph = {name: imports_of(name, path.read_text(), set(files), path.name == "__init__.py")
             for name, path in files.items()}
    assert sum(len(deps) for deps in graph.values()) > 50  # the walk found the imports
    assert cycles(graph) == []


def test_the_helpers_hold():
    import doctest
    import sys

    assert doctest.testmod(sys.modules[__name__]).failed == 0
