"""`generate_vllm` on the real vLLM engine (the CPU build here): a batch of seeded sampled jobs whose
prompts overflow one step's token budget used to kill the engine core (chunked prefill split a
seeded prompt and vLLM rewound its CPU generator: "CPU Generator does not use offset")."""

from __future__ import annotations

import pytest

from tests.paths import LOCAL_CPU

pytestmark = pytest.mark.engine


def test_seeded_sampled_batch_overflowing_a_step_completes_and_reproduces():
    from transformers import AutoTokenizer

    from cluster.config import load_config
    from tools.distill.vllm_gen import generate_vllm
    from cluster.ops.models import resolve_model

    path = resolve_model("smollm2-135m", load_config(LOCAL_CPU))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(" ".join(f"item{i}-{j}" for j in range(250)))["input_ids"] for i in range(6)]
    assert 2 * min(map(len, prompts)) > 2048  # any two of them overflow one step of 2048 tokens
    jobs = [{"prompt_ids": p, "max_new_tokens": 6, "temperature": 1.0, "seed": 100 + i} for i, p in enumerate(prompts)]
    jobs += [dict(jobs[0]), {**jobs[1], "temperature": 0.0}]  # the same seed again; a greedy one
    out = generate_vllm(path, jobs, 2048, log_fn=lambda m: None)
    assert len(out) == len(jobs) and all(1 <= len(c) <= 6 for c in out)
    assert out[6] == out[0]  # a seed reproduces its continuation
