"""The import graph of `cluster/`, `deployments/` and `tools/` has no cycle, counting imports inside functions
(which hide a cycle from Python at import time but not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "deployments", "tools")


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


def _graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path.read_text(), set(files), path.name == "__init__.py")
            for name, path in files.items()}


def test_cluster_and_deployments_import_no_cycle():
    graph = _graph()
    assert sum(len(deps) for deps in graph.values()) > 50  # the walk found the imports
    assert cycles(graph) == []


TOOLS = ("tools",)


def test_serving_code_never_imports_the_tools():
    """The bench and the distillation are tools: the serving path (router, engines, state, `up`)
    starts without them, so their imports (matplotlib, training code) never load in a replica, and
    the serving images carry no `tools/` (the command line finds them by name, `cluster.ops.cli`)."""
    graph = _graph()
    serving = [m for m in graph if not m.startswith(TOOLS)]
    assert len(serving) > 40
    assert {m: sorted(d for d in graph[m] if d.startswith(TOOLS)) for m in serving
            if any(d.startswith(TOOLS) for d in graph[m])} == {}


def test_the_library_never_imports_the_deployments():
    """`deployments/` imports `cluster/`, never the other way round: `up` and the KubeRay render reach
    the application by its import path (`cluster.ops.placement.APP_IMPORT_PATH`)."""
    graph = _graph()
    assert {m: sorted(d for d in deps if d.startswith("deployments")) for m, deps in graph.items()
            if m.startswith("cluster") and any(d.startswith("deployments") for d in deps)} == {}


LAYERS = {  # a subpackage of cluster/ and what it may import of cluster/ besides the shared modules
    "cluster.api": set(),
    "cluster.engine": set(),
    "cluster.state": {"cluster.policy"},
    "cluster.policy": set(),
    "cluster.routing": {"cluster.api", "cluster.policy"},
    "cluster.autoscale": {"cluster.policy", "cluster.state", "cluster.routing", "cluster.ops.metrics"},
}
SHARED = ("cluster.config", "cluster.config_sections", "cluster.speculation", "cluster.percentile", "cluster.tls")


def test_lower_layers_do_not_import_higher_ones():
    """api and engine import only the shared modules; state, policy, routing and autoscale what
    LAYERS lists; none of them imports ops, k8s or deployments (which import them)."""
    graph = _graph()
    wrong = {}
    for module, deps in graph.items():
        layer = next((name for name in LAYERS if module == name or module.startswith(name + ".")), None)
        if layer is None:
            continue
        allowed = LAYERS[layer] | {layer}
        bad = sorted(d for d in deps if not d.startswith(SHARED) and not any(d == a or d.startswith(a + ".")
                                                                                  for a in allowed))
        if bad:
            wrong[module] = bad
    assert wrong == {}


def test_the_helpers_hold():
    import doctest
    import sys

    assert doctest.testmod(sys.modules[__name__]).failed == 0
