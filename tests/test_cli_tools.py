"""`specserve bench` and `specserve distill` come from the tools package (`tools/`); a serving image
carries none, and there the commands say what is missing instead of the whole CLI failing."""

from __future__ import annotations

import importlib

import pytest

from cluster.ops import cli


def test_the_tools_commands_are_the_tools_own():
    args = cli.build_parser().parse_args(["bench", "--help"][:1])
    assert args.func.__module__ == "tools.bench.cli"


def test_without_the_tools_the_cli_works_and_the_tool_commands_say_what_is_missing(monkeypatch):
    real = importlib.import_module

    def no_tools(name, *a, **k):
        if name.split(".")[0] == "tools":
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name="tools")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_tools)
    parser = cli.build_parser()
    assert parser.parse_args(["check-config", "x.yaml"]).func is cli.cmd_check_config
    with pytest.raises(SystemExit, match="tools are not installed"):
        parser.parse_args(["bench"]).func(None)
