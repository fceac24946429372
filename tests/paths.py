"""Paths the tests share: the repository, its configs and the embedded default."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster" / "configs"
LOCAL_CPU = CONFIGS / "local-cpu.yaml"
