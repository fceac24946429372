"""No module of the serving packages, `cluster/` and `deployments/`, is over 399 lines, and none of `tools/` over
500: a module that grows past its package's bound is split along its own concepts rather than left to become a
file nobody reads whole. The serving code has the tighter bound: it runs in every replica, and a change to
serving is read against it module by module, each one whole; the tools (the bench and the distillation) run
beside the cluster, not in it, and keep the looser one."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = {"cluster": 399, "deployments": 399, "tools": 500}  # package: the most lines one of its modules has


def oversized(root: Path = ROOT, max_lines: dict[str, int] = MAX_LINES) -> dict[str, int]:
    """{path relative to root: line count} of every .py file under a package of `max_lines` over that
    package's bound."""
    out = {}
    for package, bound in max_lines.items():
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > bound:
                out[str(path.relative_to(root))] = lines
    return out


def test_no_module_is_over_the_bound():
    offenders = oversized()
    assert not offenders, f"modules over their package's bound {MAX_LINES} (split them): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(offenders.items()))


def test_the_bound_catches_a_long_module(tmp_path):
    serving, tools = MAX_LINES["cluster"], MAX_LINES["tools"]
    assert MAX_LINES["deployments"] == serving < tools
    for package in MAX_LINES:
        (tmp_path / package).mkdir()
    (tmp_path / "cluster" / "long.py").write_text("x = 1\n" * (serving + 1))
    (tmp_path / "cluster" / "short.py").write_text("x = 1\n" * serving)
    (tmp_path / "deployments" / "long.py").write_text("x = 1\n" * (serving + 1))
    (tmp_path / "tools" / "serving_long.py").write_text("x = 1\n" * (serving + 1))  # within the tools' bound
    (tmp_path / "tools" / "short.py").write_text("x = 1\n" * tools)
    (tmp_path / "tools" / "long.py").write_text("x = 1\n" * (tools + 1))
    assert oversized(tmp_path) == {"cluster/long.py": serving + 1, "deployments/long.py": serving + 1,
                                   "tools/long.py": tools + 1}
