"""The vLLM engine arguments of a pool's replica: its speculative config, scheduler and proposer.

Pools whose engine drafts from a suffix tree (`PoolConfig.uses_lookup_proposer`) get specserve's
lookup proposer (`cluster.engine.lookup_proposer`), which serves n-gram lookup and SuffixDecoding per
request in one engine; `remote_draft` pools get the remote proposer; the rest vLLM's own methods.
"""

from __future__ import annotations

from typing import Any, Optional

from cluster.config_pool import PoolConfig
from cluster.engine import lookup_proposer, remote_proposer
from cluster.engine.vllm_scheduler import (ADDITIONAL_CONFIG_KEY, ENGINE_CORE_WAIT_KEY, SCHEDULER_CLS_PATH,
                                           STEP_K_EXPLORE_KEY, STEP_K_MAX_BATCH_KEY)
from cluster.ops.placement import platform_engine_kwargs
from cluster.speculation import SpecMode


def speculative_config(pool: PoolConfig, drafter_path: Optional[str]) -> Optional[dict[str, Any]]:
    """vLLM `speculative_config` for a pool (None for method none)."""
    if pool.method == SpecMode.NONE:
        return None
    if pool.method == SpecMode.REMOTE_DRAFT:  # vLLM loads our proposer; the drafter is another deployment
        return {"method": "custom_class", "model": remote_proposer.PROPOSER_CLS_PATH, "num_speculative_tokens": pool.max_k}
    if pool.uses_lookup_proposer:  # n-gram and suffix per request, in one engine
        return {"method": "custom_class", "model": lookup_proposer.PROPOSER_CLS_PATH,
                "num_speculative_tokens": pool.engine_max_k}
    cfg: dict[str, Any] = {"method": pool.method.value, "num_speculative_tokens": pool.max_k}
    if pool.method == SpecMode.NGRAM:
        cfg.update(prompt_lookup_min=pool.ngram_min, prompt_lookup_max=pool.ngram_max)
    if drafter_path:
        cfg["model"] = drafter_path
    return cfg


def engine_kwargs(
    pool: PoolConfig, model_path: str, drafter_path: Optional[str], served_name: str, dtype: str = "auto",
    cpu_build: Optional[bool] = None, trust_remote_code: bool = False,
) -> dict[str, Any]:
    """AsyncEngineArgs for one replica of `pool`; the pool's engine_kwargs win over our defaults.

    `cpu_build` (None: detect) adds what the vLLM CPU build needs (`platform_engine_kwargs`).
    """
    kwargs: dict[str, Any] = dict(
        model=model_path,
        served_model_name=served_name,
        dtype=dtype,
        trust_remote_code=trust_remote_code,  # the model's own setting (ModelConfig.trust_remote_code)
        max_model_len=pool.max_model_len,
        tensor_parallel_size=pool.tensor_parallel_size,
        scheduler_cls=SCHEDULER_CLS_PATH,
        # Per-request K is applied on the synchronous path (update_draft_token_ids).
        async_scheduling=False,
        per_request_spec_decode_metrics="detailed",  # per-step drafted counts -> per-position rates
        speculative_config=speculative_config(pool, drafter_path),
        additional_config={ADDITIONAL_CONFIG_KEY: {
            ENGINE_CORE_WAIT_KEY: pool.engine_core_wait, STEP_K_EXPLORE_KEY: pool.step_k_explore,
            **({STEP_K_MAX_BATCH_KEY: pool.step_k_max_batch} if pool.step_k_max_batch is not None else {})}},
        enable_log_requests=False,
    )
    if pool.method == SpecMode.REMOTE_DRAFT:
        kwargs["worker_extension_cls"] = remote_proposer.WORKER_EXTENSION_PATH  # the replica hands the proposer its drafter
        kwargs["additional_config"][ADDITIONAL_CONFIG_KEY][remote_proposer.REMOTE_CONFIG_KEY] = {
            "timeout_s": pool.remote_timeout_s, "reprobe_s": pool.remote_reprobe_s,
        }
    if pool.uses_lookup_proposer:
        kwargs["worker_extension_cls"] = lookup_proposer.WORKER_EXTENSION_PATH  # the replica attaches the runner
        kwargs["additional_config"][ADDITIONAL_CONFIG_KEY][lookup_proposer.LOOKUP_CONFIG_KEY] = lookup_settings(pool)
    if pool.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "ray"  # workers go into the replica's placement group
    kwargs.update(pool.engine_kwargs)
    # Under the pool's own values: a pool may set max_model_len, or re-enable chunked prefill.
    return {**platform_engine_kwargs(int(kwargs["max_model_len"]), cpu_build), **kwargs}



def lookup_settings(pool: PoolConfig) -> dict[str, Any]:
    """What the lookup proposer reads from `additional_config` (`cluster.engine.lookup_proposer`)."""
    return {"method": pool.method.value, "ngram": pool.method == SpecMode.NGRAM,
            "ngram_min": pool.ngram_min, "ngram_max": pool.ngram_max,
            "suffix": pool.suffix_settings.model_dump(exclude={"prior_alpha", "prior_draft_rate", "auto_ngram"})}
