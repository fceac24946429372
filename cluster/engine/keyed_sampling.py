"""A seeded request samples the same text whatever K the engine verified at each step.

vLLM draws a seeded request's randomness from one `torch.Generator` per request, in the order the
sampler consumes it: one noise vector per sampled token, one uniform per verified draft, one noise
vector per step for a replacement token. How much is consumed depends on how many drafts were
verified, so the same seed gave different text at different K, and specserve changes K per request
and per step.

Here a seeded request's noise is keyed by (seed, output position) instead: the token at position j
is `argmax(p / E)`, E ~ Exp(1) per vocabulary entry drawn from a generator seeded with
`noise_key(seed, j)` (the exponential race, an exact sample of p). Verification under that noise
is `verify`: a draft is accepted exactly when it is the token plain sampling gives at its position,
and the first draft that is not is replaced by that token. Every emitted token is therefore the
token plain decoding emits with the same seed, for any drafts and any K. For drafts that are a
single token (n-gram, suffix) the acceptance probability is p(draft), as in vLLM's rejection
sampler, so nothing is lost; for a drafter with a distribution q it is p(draft) rather than
min(1, p/q), which costs acceptance but never correctness. Requests without a seed keep vLLM's
own sampler.

Hooks (`install`, in each engine worker where `cluster.engine.sampling_fix` acts): the model
runner's `_sample` records each request's position for the step; the top-k/top-p sampler's random
draw (plain tokens and the bonus token after drafts) and `rejection_sample` then re-sample the
seeded rows with keyed noise. Checked on vLLM's CPU build (synchronous scheduling); on GPUs,
where scheduling is asynchronous, not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from cluster.speculation import SAMPLING_EPS

MASK64 = (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """A 63-bit generator seed for (seed, position): SplitMix64 of both, so neighbouring seeds and
    positions get unrelated noise.

    >>> noise_key(7, 0) == noise_key(7, 0), noise_key(7, 0) == noise_key(7, 1), noise_key(7, 1) == noise_key(8, 0)
    (True, False, False)
    >>> 0 <= noise_key(-1, 10**12) < 2**63
    True
    """
    z = ((seed & MASK64) ^ (((position + 1) * 0x9E3779B97F4A7C15) & MASK64)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_token(probs: Any, seed: int, position: int) -> int:
    """The token a seeded request samples at `position` from `probs` (one row, summing to 1)."""
    import torch

    gen = torch.Generator(device=probs.device)
    gen.manual_seed(noise_key(seed, position))
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=gen)
    return int((probs.to(torch.float32) / noise).argmax())


def verify(drafts: list[int], token_at: Callable[[int], int]) -> list[int]:
    """The tokens a step emits: drafts while each is the token plain sampling gives at its position
    (`token_at(j)`), then that token; after all drafts, the token at the next position.

    >>> plain = [5, 6, 7, 8].__getitem__
    >>> verify([5, 6, 9], plain), verify([5, 6, 7], plain), verify([], plain), verify([4], plain)
    ([5, 6, 7], [5, 6, 7, 8], [5], [5])
    """
    out: list[int] = []
    for j, draft in enumerate(drafts):
        token = token_at(j)
        out.append(token)
        if token != draft:
            return out
    out.append(token_at(len(drafts)))
    return out


@dataclass
class Step:
    """One sampling step's seeded rows: batch row -> (seed, position of its first sampled token),
    and how many drafts each row verifies (empty: none)."""

    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    drafts: list[int] = field(default_factory=list)

    def bonus_position(self, row: int) -> int:
        """Position of the token the plain sampler draws for `row`: after its drafts."""
        return self.rows[row][1] + (self.drafts[row] if row < len(self.drafts) else 0)


_STEP: Optional[Step] = None  # set only while the model runner samples (one thread per worker)


def resample_rows(tokens: Any, probs: Any, step: Step) -> None:
    """Overwrite the seeded rows of a plain (or bonus) draw with their keyed tokens."""
    for row, (seed, _) in step.rows.items():
        tokens[row] = keyed_token(probs[row], seed, step.bonus_position(row))


def reverify_rows(output: Any, draft_ids: list[int], target_probs_of: Callable[[int, int], Any], bonus: Any,
                  temperature: Any, step: Step, placeholder: int) -> None:
    """Overwrite the seeded, sampled rows of a rejection-sampler output ([batch, max_spec + 1]) with
    `verify` under keyed noise. `target_probs_of(start, n)`: the processed target probabilities of
    those draft rows; `bonus[row]`: the row's keyed bonus token."""
    start = 0
    for row, n in enumerate(step.drafts):
        if n and row in step.rows and float(temperature[row]) >= SAMPLING_EPS:
            seed, base = step.rows[row]
            probs = target_probs_of(start, n)
            emitted = verify(draft_ids[start:start + n],
                             lambda j: keyed_token(probs[j], seed, base + j) if j < n else int(bonus[row]))
            output[row, :] = placeholder
            output[row, :len(emitted)] = output.new_tensor(emitted)
        start += n


def install() -> None:
    """Wrap vLLM's model runner `_sample`, top-k/top-p sampler and `rejection_sample` (idempotent)."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.ops import topk_topp_sampler as tts
    from vllm.v1.worker import gpu_model_runner as gmr

    runner = gmr.GPUModelRunner
    if getattr(runner._sample, "specserve_keyed", False):
        return
    original_sample = runner._sample

    def _sample(self, logits, spec_decode_metadata):
        global _STEP
        gens = self.input_batch.sampling_metadata.generators
        if not gens:
            return original_sample(self, logits, spec_decode_metadata)
        nts = self.input_batch.num_tokens_no_spec
        _STEP = Step({row: (int(g.initial_seed()), int(nts[row])) for row, g in gens.items()},
                     list(spec_decode_metadata.num_draft_tokens) if spec_decode_metadata is not None else [])
        try:
            return original_sample(self, logits, spec_decode_metadata)
        finally:
            _STEP = None

    _sample.specserve_keyed = True
    runner._sample = _sample

    def keyed_draw(original):
        def forward(self, logits, generators, k, p):
            step = _STEP
            if step is None or not generators:
                return original(self, logits, generators, k, p)
            logits = tts.apply_top_k_top_p(logits, k, p)
            probs = logits.softmax(dim=-1, dtype=torch.float32)
            tokens, processed = original(self, logits, {}, None, None)
            resample_rows(tokens, probs, step)
            return tokens, processed
        return forward

    sampler = tts.TopKTopPSampler
    sampler.forward_native = keyed_draw(sampler.forward_native)
    sampler.forward_cpu = keyed_draw(sampler.forward_cpu)
    original_rs = rs.rejection_sample

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        output = original_rs(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                             target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        step = _STEP
        if step is not None and step.rows and not sampling_metadata.all_greedy:
            reverify_rows(output, draft_token_ids.tolist(),
                          lambda s, n: target_logits[s:s + n].softmax(dim=-1, dtype=torch.float32),
                          bonus_token_ids.view(-1), sampling_metadata.temperature, step, rs.PLACEHOLDER_TOKEN_ID)
        return output

    rs.rejection_sample = rejection_sample
