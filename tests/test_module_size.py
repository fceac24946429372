"""No module of `cluster/`, `deployments/` or `tools/` is over MAX_LINES lines: a module that grows past it is split
along its own concepts rather than left to become a file nobody reads whole."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "deployments", "tools")
MAX_LINES = 500


def oversized(root: Path = ROOT, max_lines: int = MAX_LINES) -> dict[str, int]:
    """{path relative to root: line count} of every .py file under PACKAGES over `max_lines` lines."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > max_lines:
                out[str(path.relative_to(root))] = lines
    return out


def test_no_module_is_over_the_bound():
    offenders = oversized()
    assert not offenders, f"modules over {MAX_LINES} lines (split them): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(offenders.items()))


def test_the_bound_catches_a_long_module(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "deployments").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "cluster" / "long.py").write_text("x = 1\n" * 4)
    (tmp_path / "deployments" / "short.py").write_text("x = 1\n" * 3)
    assert oversized(tmp_path, max_lines=3) == {"cluster/long.py": 4}
