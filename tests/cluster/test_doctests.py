"""The examples in the pure modules' docstrings are executed, so they cannot drift from the code."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["cluster.percentile", "cluster.policy.cells", "cluster.policy.model", "cluster.policy.cost", "cluster.policy.choice", "cluster.coalesce", "cluster.speculation", "cluster.routing", "cluster.autoscale", "cluster.vllm_scheduler", "cluster.step_k", "cluster.redis_server",
           "cluster.bench.runs_check", "cluster.bench.split", "cluster.bench.step_split", "cluster.bench.k_replay", "cluster.placement",
           "cluster.teaching", "cluster.deadline", "cluster.cpu_pinning"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples any more: drop it from MODULES"
    assert result.failed == 0
