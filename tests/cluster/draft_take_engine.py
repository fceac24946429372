"""Run by tests/cluster/test_draft_take.py in a process of its own: a real in-process vLLM engine
(engine core and worker in this process, so the executor's calls can be counted) with the n-gram
pool's engine arguments and vLLM's own n-gram proposer. Prints, as JSON, per phase the greedy
token ids, the draft fetches the engine core made and the steps it ran:
`k0` (every request at K = 0), `k3` (K = 3, drafts fetched), `k3_carried` (K = 3, the runner
carrying its drafts back with the sampled tokens: `draft_take.carry_drafts`)."""

from __future__ import annotations

import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from cluster.config import load_config
    from cluster.engine.draft_take import carry_drafts
    from cluster.ops.models import resolve_model
    from cluster.speculation import EXTRA_ARGS_K
    from deployments.vllm_args import engine_kwargs
    from tests.paths import LOCAL_CPU

    config = load_config(LOCAL_CPU)
    pool = config.pools["ngram"]
    kwargs = engine_kwargs(pool, resolve_model(pool.model, config), None, pool.model, dtype="float32")
    for key in ("worker_extension_cls", "enable_log_requests"):  # the lookup proposer's; an AsyncEngineArgs field
        kwargs.pop(key, None)
    kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    kwargs.update(max_num_seqs=4, distributed_executor_backend="uni")
    counts = {"takes": 0, "steps": 0}
    take, sample = UniProcExecutor.take_draft_token_ids, UniProcExecutor.sample_tokens

    def counting_take(self):
        counts["takes"] += 1
        return take(self)

    def counting_sample(self, *args, **kw):
        counts["steps"] += 1
        return sample(self, *args, **kw)

    UniProcExecutor.take_draft_token_ids, UniProcExecutor.sample_tokens = counting_take, counting_sample
    llm = LLM(**kwargs)
    prompt = "Repeat after me, three times: the quick brown fox jumps over the lazy dog."
    prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True)] * 2

    def run(k: int) -> dict:
        counts.update(takes=0, steps=0)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args={EXTRA_ARGS_K: k})
        out = llm.generate(prompts, params, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in out], **counts}

    result = {"k0": run(0), "k3": run(3)}
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    result["carry_installed"] = carry_drafts(runner)
    result["k3_carried"] = run(3)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
