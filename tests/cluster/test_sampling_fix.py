"""`cluster.engine.sampling_fix`: the per-token temperature of vLLM's rejection sampler on the CPU
build, in torch (`expand_into`), installed in vLLM's own kernel registry (`install`), and the plugin
that installs it only in the cluster's engines (`register`, `wrap`). The sampled outputs of a real
cluster with speculation on and off: tests/e2e/test_sampling.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tools.bench.anchors import stock_env
from cluster.config import load_config
from cluster.engine import sampling_fix
from cluster.ops.placement import engine_deployment_options
from tests.paths import LOCAL_CPU, ROOT


def test_expand_into_repeats_each_request_value_over_its_tokens_and_replaces():
    out = torch.full((6,), -9.0)
    sampling_fix.expand_into(out, torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 5, 6], dtype=torch.int32),
                             replace_from=0, replace_to=1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.5])


def test_expand_into_keeps_integer_dtypes_and_skips_requests_without_tokens():
    out = torch.zeros(4, dtype=torch.int32)
    sampling_fix.expand_into(out, torch.tensor([5, 6, 7], dtype=torch.int32), torch.tensor([1, 1, 4]), 0, 0)
    assert out.dtype == torch.int32 and out.tolist() == [5, 7, 7, 7]


# vLLM's kernel registry rebinds references across every loaded module: these checks run in a
# process of their own, as in an engine's worker, not beside the other tests' imports.
_SAMPLER = """
import json, sys, torch
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
if HAS_TRITON:
    print(json.dumps({"skip": True})); sys.exit()
current_platform.register_triton_kernel_overrides()  # vLLM's C++ fallbacks, as a worker starts
import vllm._custom_ops  # loads torch.ops._C
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.metadata import SamplingMetadata
from cluster.engine import sampling_fix
assert sampling_fix.install()
out = {"expanded": rs.expand_batch_to_tokens(torch.tensor([0.7, 1.0, 0.5]), torch.tensor([2, 5, 6], dtype=torch.int32),
                                             6, replace_from=rs.GREEDY_TEMPERATURE, replace_to=1).tolist()}
# one draft token per request at temperature 0.5: the first output token, accepted or replaced
n, temperature, draft = 20_000, 0.5, 3
logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.3])
md = SamplingMetadata(
    temperature=torch.full((n,), temperature), all_greedy=False, all_random=True, top_p=None, top_k=None,
    generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
    frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
    output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None)
cu = torch.arange(1, n + 1, dtype=torch.int32)
torch.manual_seed(0)
target = rs.apply_sampling_constraints(logits.repeat(n, 1).contiguous(), cu, md)
first = rs.rejection_sample(torch.full((n,), draft, dtype=torch.int32), [1] * n, 1, cu, None, target,
                            torch.full((n, 1), 7, dtype=torch.int64), md)[:, 0]
out["freq"] = (torch.bincount(first.long(), minlength=8).double() / n).tolist()
out["expected"] = (logits / temperature).softmax(-1).tolist()
print(json.dumps(out))
"""


def _sampler() -> dict:
    run = subprocess.run([sys.executable, "-c", _SAMPLER], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if out.get("skip"):
        pytest.skip("Triton runs vLLM's own kernel here: nothing to replace")
    return out


def test_installed_the_rejection_sampler_samples_the_tempered_target():
    """The per-token temperature is the request's, and with one draft token per request at
    temperature 0.5 the first output token of 20,000 requests is distributed as
    softmax(logits / 0.5), whether the draft was accepted or replaced."""
    out = _sampler()
    assert out["expanded"] == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.5])
    assert out["freq"] == pytest.approx(out["expected"], abs=0.015)


def test_wrap_installs_after_the_platform_registers_its_own_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(sampling_fix, "install", lambda: calls.append("install"))
    monkeypatch.setattr(sampling_fix, "install_worker_hooks", lambda: calls.append("hooks"))

    class Platform:
        @classmethod
        def register_triton_kernel_overrides(cls):
            calls.append("platform")

    assert sampling_fix.wrap(Platform)
    assert not sampling_fix.wrap(Platform), "wrapped twice"
    Platform.register_triton_kernel_overrides()
    assert calls == ["platform", "install", "hooks"]


def test_register_leaves_vllm_alone_without_the_environment_flag(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv(sampling_fix.ENV, raising=False)
    before = type(current_platform).__dict__["register_triton_kernel_overrides"]
    sampling_fix.register()
    assert type(current_platform).__dict__["register_triton_kernel_overrides"] is before


def test_the_cluster_engines_set_the_flag_and_the_stock_anchors_do_not():
    config = load_config(str(LOCAL_CPU))
    for name, pool in config.pools.items():
        env = engine_deployment_options(name, pool, {})["ray_actor_options"]["runtime_env"]["env_vars"]
        assert env[sampling_fix.ENV] == "1", name
        assert sampling_fix.ENV not in stock_env(pool, base={}, platform_env={})
