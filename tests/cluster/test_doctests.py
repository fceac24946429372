"""The examples in the pure modules' docstrings are executed, so they cannot drift from the code."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["cluster.percentile", "cluster.engine.lookup_proposer", "cluster.policy.decision", "cluster.policy.cells", "cluster.policy.model", "cluster.policy.cost", "cluster.policy.choice", "cluster.engine.coalesce", "cluster.engine.draft_take", "cluster.engine.sampling_fix", "cluster.engine.keyed_sampling", "cluster.api.grpc_openai", "cluster.engine.plain_params", "cluster.speculation", "cluster.routing.route", "cluster.autoscale.policy", "cluster.engine.vllm_scheduler", "cluster.engine.step_k", "cluster.engine.draft_gate", "cluster.state.redis_server",
           "tools.bench.runs_check", "tools.bench.split", "tools.bench.step_split", "tools.bench.k_replay", "cluster.ops.placement", "cluster.ops.ray_driver",
           "cluster.policy.teaching", "cluster.routing.deadline", "cluster.ops.cpu_pinning", "cluster.state.redis_client",
           "cluster.api.openai_body", "cluster.ops.models", "deployments.vllm_openai", "deployments.engine_types",
           "deployments.router_http", "cluster.client_wire", "deployments.engine_start"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples any more: drop it from MODULES"
    assert result.failed == 0
