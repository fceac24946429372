"""`logit_bias` and `min_p` in an engine configured for speculation: served at K = 0.

vLLM refuses both whenever an engine has a speculative config ("not yet supported with speculative
decoding") and builds neither logits processor, because its rejection sampler does not apply them
to the logits of verified drafts. A request that verifies no drafts never reaches those logits:
every token it gets is drawn by the plain sampler (the bonus token), which applies every logits
processor. specserve fixes K per request, so such a request runs at K = 0 in the same engine:

- the router decides `none`, K = 0 for it (`plain_field` names the field that asks for it);
- the replica lets vLLM's validation pass only for a request whose `extra_args` pin K = 0
  (`allow_at_k0`), so a request that would verify drafts still gets vLLM's own 400;
- each worker builds vLLM's built-in logits processors (min-tokens, logit bias, min-p) as an
  engine without speculation does (`install_logitsprocs`).
"""

from __future__ import annotations

from typing import Any, Optional

from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_K_STEP, plain_field


def pins_k0(extra_args: Optional[dict[str, Any]]) -> bool:
    """Whether a request's `extra_args` fix its K at 0 for every step (the scheduler then verifies
    none of its drafts: `cluster.engine.vllm_scheduler`).

    >>> pins_k0({"specserve_k": 0, "specserve_mode": "none"}), pins_k0({"specserve_k": 2}), pins_k0(None)
    (True, False, False)
    >>> pins_k0({"specserve_k": 0, "specserve_k_step": 0.5})
    False
    """
    args = extra_args or {}
    return (args.get(EXTRA_ARGS_K) == 0 and not isinstance(args.get(EXTRA_ARGS_K), bool)
            and EXTRA_ARGS_K_STEP not in args)


def install_validation() -> bool:
    """Let `SamplingParams` pass vLLM's speculative check when its own K is pinned at 0; False if
    already installed."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if getattr(original, "specserve_k0", False):
        return False

    def _validate_spec_decode(self, speculative_config):
        if speculative_config is not None and plain_field(self) and pins_k0(self.extra_args):
            return None
        return original(self, speculative_config)

    _validate_spec_decode.specserve_k0 = True
    SamplingParams._validate_spec_decode = _validate_spec_decode
    return True


def install_logitsprocs() -> bool:
    """Make the model runner build vLLM's built-in logits processors under speculation too (no
    custom processors: those vLLM still refuses); False if already installed."""
    from vllm.v1.sample import logits_processor as lp
    from vllm.v1.worker import gpu_model_runner as gmr

    original = gmr.build_logitsprocs
    if getattr(original, "specserve_k0", False):
        return False

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if vllm_config.speculative_config and not is_pooling_model and not custom_logitsprocs:
            return lp.LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in lp.BUILTIN_LOGITS_PROCESSORS)
        return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)

    build_logitsprocs.specserve_k0 = True
    gmr.build_logitsprocs = build_logitsprocs
    return True
