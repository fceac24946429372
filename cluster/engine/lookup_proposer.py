"""Prompt lookup and SuffixDecoding in one engine, chosen per request.

vLLM fixes one speculative method per engine, so serving n-gram lookup and SuffixDecoding side by
side would take two engines on the same cores, and the router would split the batch between them.
This proposer (`speculative_config.method = "custom_class"`) holds both and drafts for each request
with the method its `SamplingParams.extra_args[EXTRA_ARGS_MODE]` names (the pool's method when it
names none):

- `ngram`: vLLM's own prompt lookup (`NgramProposer.batch_propose`, the same numba kernel and
  prompt_lookup_min/max as its `ngram` method);
- `suffix`: arctic-inference's `SuffixDecodingCache`, as vLLM's `suffix` method uses it: a tree
  per prompt and a global tree over earlier requests' outputs; a draft's length follows the match
  (`max_spec_factor` x the matched length + `max_spec_offset`) and stops below `min_token_prob`,
  with knobs of their own (`suffix.solo`) for a step whose batch holds one request;
- K = 0 (mode `none`, or a step whose scheduler allows no drafts, as above the pool's batch bound):
  no lookup at all.

Every request's tokens go into the suffix trees whatever its mode, so a class the router sends to
n-gram lookup still teaches the global tree what its outputs look like, and suffix drafts for it are
ready when the router tries them. Each request is asked for at most its own K (or the top of its K's
growth, `draft_ceiling`); the scheduler trims further per step (`cluster.engine.vllm_scheduler`). Verification is vLLM's: drafts
change how many tokens a step yields, never which.

The proposer needs the request ids and sampling parameters of the batch, which vLLM does not pass
to a custom proposer: the engine replica attaches the model runner after start-up
(`LookupWorkerExtension.specserve_attach_lookup`). Until then every request drafts by n-gram lookup.
The per-request plan is the pure function `plan_drafts`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from cluster.engine.draft_take import carry_drafts
from cluster.engine.proposer_base import NeverRaises, capped, watch_step_cap
from cluster.engine.vllm_scheduler import ADDITIONAL_CONFIG_KEY, requested_k
from cluster.speculation import EXTRA_ARGS_MODE, SpecMode

log = logging.getLogger("specserve.lookup_proposer")

PROPOSER_CLS_PATH = "cluster.engine.lookup_proposer.LookupProposer"
WORKER_EXTENSION_PATH = "cluster.engine.lookup_proposer.LookupWorkerExtension"
LOOKUP_CONFIG_KEY = "lookup"  # under additional_config[ADDITIONAL_CONFIG_KEY]


@dataclass(frozen=True)
class DraftPlan:
    """Which requests of a step draft, by which method, up to which K (indices into the batch)."""

    ngram: tuple[int, ...] = ()
    ngram_k: int = 0  # the n-gram kernel drafts one K for all; each request is trimmed to its own
    suffix: tuple[tuple[int, int], ...] = ()  # (index, K)
    ks: tuple[int, ...] = ()  # every request's K this step (0: no drafts)


def request_mode(extra_args: Optional[dict[str, Any]], default: str) -> str:
    """The drafting method a request asked for: `EXTRA_ARGS_MODE` if it is one this proposer has,
    else `default` (the pool's method).

    >>> request_mode({"specserve_mode": "suffix"}, "ngram"), request_mode(None, "ngram")
    ('suffix', 'ngram')
    >>> request_mode({"specserve_mode": "eagle"}, "ngram")
    'ngram'
    """
    mode = (extra_args or {}).get(EXTRA_ARGS_MODE)
    return mode if mode in (SpecMode.NGRAM.value, SpecMode.SUFFIX.value, SpecMode.NONE.value) else default


def plan_drafts(modes: Sequence[str], ks: Sequence[int], drafting: Sequence[bool], num_tokens: Sequence[int],
                max_model_len: int, has_ngram: bool = True) -> DraftPlan:
    """Per request: its method (`modes`), its K (`ks`), whether it decodes this step (`drafting`:
    False mid-prefill) and its committed length. A request drafts at most up to the context's end;
    mode `none` and K = 0 draft nothing; without n-gram lookup (`method: suffix` pools) an `ngram`
    request drafts from the suffix tree.

    >>> p = plan_drafts(["ngram", "suffix", "none", "ngram"], [3, 6, 4, 0], [True] * 4, [10, 10, 10, 10], 64)
    >>> p.ngram, p.ngram_k, p.suffix, p.ks
    ((0,), 3, ((1, 6),), (3, 6, 0, 0))
    >>> plan_drafts(["suffix"], [6], [True], [60], 64).suffix   # room for 3 more tokens: K 3
    ((0, 3),)
    >>> plan_drafts(["ngram"], [4], [False], [10], 64).ks
    (0,)
    >>> plan_drafts(["ngram"], [4], [True], [10], 64, has_ngram=False).suffix
    ((0, 4),)
    """
    ngram, suffix, out = [], [], []
    for i, (mode, k, live, n) in enumerate(zip(modes, ks, drafting, num_tokens)):
        k = max(min(int(k), max_model_len - int(n) - 1), 0) if live and mode != SpecMode.NONE.value else 0
        out.append(k)
        if k == 0:
            continue
        if mode == SpecMode.NGRAM.value and has_ngram:
            ngram.append(i)
        else:
            suffix.append((i, k))
    return DraftPlan(tuple(ngram), max((out[i] for i in ngram), default=0), tuple(suffix), tuple(out))


@dataclass(frozen=True)
class SuffixKnobs:
    """How far a suffix draft may run: `max_spec_factor` x the matched length + `max_spec_offset`,
    stopping below `min_token_prob` (arctic-inference's `speculate` arguments)."""

    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1

    @classmethod
    def of(cls, settings: Optional[dict[str, Any]]) -> Optional["SuffixKnobs"]:
        if settings is None:
            return None
        return cls(**{f.name: float(settings[f.name]) for f in fields(cls) if f.name in settings})


def step_knobs(batch_size: int, knobs: SuffixKnobs, solo: Optional[SuffixKnobs]) -> SuffixKnobs:
    """The knobs of a step: `solo` when one request is in the batch (and `solo` is set), else `knobs`.
    Alone in a step, verifying a few more tokens costs little; beside batchmates every extra token
    lengthens the step for all of them.

    >>> base, solo = SuffixKnobs(), SuffixKnobs(max_spec_offset=2.0, min_token_prob=0.3)
    >>> step_knobs(1, base, solo) == solo, step_knobs(2, base, solo) == base, step_knobs(1, base, None) == base
    (True, True, True)
    """
    return solo if solo is not None and batch_size == 1 else knobs


def lookup_settings(vllm_config) -> dict[str, Any]:
    extra = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) or {}
    return dict(extra.get(LOOKUP_CONFIG_KEY) or {})


def _ngram_proposer(vllm_config, k_max: int, min_n: int, max_n: int):
    """vLLM's n-gram proposer, built from our settings (its constructor reads a speculative config
    of method ngram, which this engine does not have)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    shim = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=k_max),
        model_config=vllm_config.model_config, scheduler_config=vllm_config.scheduler_config,
        parallel_config=vllm_config.parallel_config,
    )
    proposer = NgramProposer(shim)
    compile_lookup(proposer, vllm_config.model_config.max_model_len)
    return proposer


def compile_lookup(ngram, max_model_len: int) -> None:
    """Compile vLLM's numba lookup kernel now, at engine start, with the argument types the model
    runner passes (int32 token buffer and lengths, a list of request indices, an int K). vLLM's own
    start-up call drafts for no request, so the kernel is not compiled until the first real n-gram
    lookup, which then stalls its step, and every request in it, for about 1.2 s on these CPUs."""
    import numpy as np

    tokens = np.zeros((1, int(max_model_len)), dtype=np.int32)
    tokens[0, :4] = (1, 2, 1, 2)
    ngram.batch_propose(1, [0], np.array([4], dtype=np.int32), tokens, 1)


class LookupProposer(NeverRaises):
    """vLLM `custom_class` proposer: n-gram lookup or SuffixDecoding per request (see module doc)."""

    _log, _what = log, "lookup proposer"

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        s = lookup_settings(vllm_config)
        self.k_max = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.default_mode = str(s.get("method", SpecMode.NGRAM.value))
        self.ngram = None
        if s.get("ngram", True):
            self.ngram = _ngram_proposer(vllm_config, self.k_max, int(s.get("ngram_min", 1)), int(s.get("ngram_max", 5)))
        suffix = s.get("suffix") or {}
        self.max_tree_depth = int(suffix.get("max_tree_depth", 24))
        self.knobs = SuffixKnobs.of(suffix)
        self.solo = SuffixKnobs.of(suffix.get("solo"))  # None: one set of knobs for every step
        # lazy: an optional native extension (scripts/bootstrap.sh builds it); only suffix pools load it
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=self.max_tree_depth,
                                         max_cached_requests=int(suffix.get("max_cached_requests", 10000)))
        self.runner = None
        self.step_cap: Optional[int] = None  # this step's bound from the scheduler (None: unknown)
        self.errors = 0

    def load_model(self, *args, **kwargs) -> None:
        pass  # lookup has no weights

    def attach(self, runner) -> None:
        """Take the runner's batch from now on, and the scheduler's bound on each step's drafts
        (`watch_step_cap`); the runner sends its drafts back with each step's sampled tokens
        (`draft_take.carry_drafts`)."""
        if self.runner is runner:
            return
        self.runner = runner
        carry_drafts(runner)  # the drafts go back with the sampled tokens: no fetch per step
        watch_step_cap(self, runner)

    def _requests(self, n: int) -> tuple[list[Optional[str]], list[str], list[int]]:
        if self.runner is None:
            return [None] * n, [self.default_mode] * n, [self.k_max] * n
        req_ids = list(self.runner.input_batch.req_ids[:n])
        modes, ks = [], []
        for req_id in req_ids:
            params = getattr(self.runner.requests.get(req_id), "sampling_params", None)
            extra = params.extra_args if params is not None else None
            modes.append(request_mode(extra, self.default_mode))
            ks.append(requested_k(extra, self.k_max))
        return req_ids, modes, ks

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        n = len(sampled_token_ids)
        req_ids, modes, ks = self._requests(n)
        ks = [capped(k, self.step_cap) for k in ks]
        nums = [int(num_tokens_no_spec[i]) for i in range(n)]
        plan = plan_drafts(modes, ks, [bool(s) for s in sampled_token_ids], nums, self.max_model_len,
                           has_ngram=self.ngram is not None)
        drafts: list[list[int]] = [[] for _ in range(n)]
        if self.runner is not None:
            self._learn(req_ids, sampled_token_ids, nums)
        if plan.ngram:
            found = self.ngram.batch_propose(n, list(plan.ngram), num_tokens_no_spec, token_ids_cpu, plan.ngram_k)
            for i in plan.ngram:
                drafts[i] = found[i][:plan.ks[i]]
        knobs = step_knobs(n, self.knobs, self.solo)
        for i, k in plan.suffix:
            if req_ids[i] is None:
                continue
            pattern = token_ids_cpu[i, max(0, nums[i] - self.max_tree_depth):nums[i]]
            drafts[i] = list(self.cache.speculate(req_ids[i], pattern, max_spec_tokens=k,
                                                  max_spec_factor=knobs.max_spec_factor,
                                                  max_spec_offset=knobs.max_spec_offset,
                                                  min_token_prob=knobs.min_token_prob).token_ids)
        return drafts

    def _learn(self, req_ids: list[Optional[str]], sampled_token_ids, nums: list[int]) -> None:
        """Every decoding request's new tokens into its tree (started from its prompt the first time);
        requests that left the batch move to the global tree (as vLLM's suffix proposer does)."""
        batch = self.runner.input_batch
        for i, req_id in enumerate(req_ids):
            if not sampled_token_ids[i] or req_id is None:
                continue
            if req_id not in self.cache.active_requests:
                if req_id in self.cache.cached_requests:  # preempted and resumed: start over
                    self.cache.evict_cached_response(req_id)
                index = batch.req_id_to_index[req_id]
                self.cache.start_request(req_id, batch.token_ids_cpu[index, :batch.num_prompt_tokens[index]])
            self.cache.add_active_response(req_id, sampled_token_ids[i])
        for req_id in self.cache.active_requests - batch.req_id_to_index.keys():
            self.cache.stop_request(req_id)

    def forget(self) -> int:
        """Drop every finished request from the global tree (requests in flight keep their own trees):
        later drafts come only from what is served from now on. Returns how many were dropped.
        A request that left the batch after the last step is still active in the cache (the next
        step's `_learn` would stop it): it is stopped here first."""
        if self.runner is not None:
            for req_id in self.cache.active_requests - self.runner.input_batch.req_id_to_index.keys():
                self.cache.stop_request(req_id)
        done = list(self.cache.cached_requests - self.cache.active_requests)
        for req_id in done:
            self.cache.evict_cached_response(req_id)
        return len(done)

    def status(self) -> dict[str, Any]:
        return {"attached": self.runner is not None, "errors": self.errors,
                "active_requests": len(self.cache.active_requests), "cached_requests": len(self.cache.cached_requests)}


class LookupWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): the engine replica calls this through
    `AsyncLLM.collective_rpc` once the engine has started, to hand the proposer its runner."""

    def specserve_attach_lookup(self) -> dict[str, Any]:
        drafter = self.model_runner.drafter
        drafter.attach(self.model_runner)
        return drafter.status()

    def specserve_forget_outputs(self) -> int:
        return self.model_runner.drafter.forget()
