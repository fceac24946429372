"""`cluster.engine.plain_params`: `logit_bias` and `min_p` pass vLLM's speculative check only for a
request pinned at K = 0, and the workers build vLLM's built-in logits processors under speculation.
Their effect on a real cluster: tests/e2e/test_vllm_conformance.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from cluster.engine import plain_params
from cluster.speculation import plain_field

K0 = {"specserve_k": 0, "specserve_mode": "none"}


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(SamplingParams, "_validate_spec_decode", SamplingParams._validate_spec_decode)
    assert plain_params.install_validation()
    assert not plain_params.install_validation(), "installed twice"


@pytest.mark.parametrize("params", [dict(logit_bias={5: 3.0}), dict(min_p=0.2, temperature=0.7)])
def test_vllm_refuses_them_under_speculation_unless_pinned_at_k0(installed, params):
    spec = object()  # any speculative config
    SamplingParams(**params, extra_args=dict(K0))._validate_spec_decode(spec)
    for extra in (None, {"specserve_k": 3}, {**K0, "specserve_k_step": 0.5}):
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
            SamplingParams(**params, extra_args=extra)._validate_spec_decode(spec)


def test_other_requests_are_checked_as_vllm_checks_them(installed):
    SamplingParams(temperature=0.5, extra_args={"specserve_k": 4})._validate_spec_decode(object())
    SamplingParams(logit_bias={5: 3.0})._validate_spec_decode(None)


def test_plain_field_reads_sampling_params_as_well_as_bodies():
    assert plain_field(SamplingParams(logit_bias={1: 1.0})) == "logit_bias"
    assert plain_field(SamplingParams(min_p=0.05)) == "min_p"
    assert plain_field(SamplingParams(temperature=0.3)) is None


def test_workers_build_the_builtin_logits_processors_under_speculation(monkeypatch):
    from vllm.v1.sample import logits_processor as lp
    from vllm.v1.worker import gpu_model_runner as gmr

    made = []

    def ctor(name):
        return lambda config, device, pin: made.append(name) or name

    monkeypatch.setattr(lp, "BUILTIN_LOGITS_PROCESSORS", [ctor("min_tokens"), ctor("logit_bias"), ctor("min_p")])
    monkeypatch.setattr(lp, "LogitsProcessors", list)
    monkeypatch.setattr(gmr, "build_logitsprocs", lambda *a, **k: "vllm's")
    assert plain_params.install_logitsprocs()
    assert not plain_params.install_logitsprocs(), "installed twice"
    spec, plain = SimpleNamespace(speculative_config=object()), SimpleNamespace(speculative_config=None)
    assert gmr.build_logitsprocs(spec, "cpu", False, False, ()) == ["min_tokens", "logit_bias", "min_p"]
    assert gmr.build_logitsprocs(plain, "cpu", False, False, ()) == "vllm's"
    assert gmr.build_logitsprocs(spec, "cpu", False, False, ("my.Proc",)) == "vllm's"  # vLLM refuses those
    assert gmr.build_logitsprocs(spec, "cpu", False, True, ()) == "vllm's"  # pooling models
