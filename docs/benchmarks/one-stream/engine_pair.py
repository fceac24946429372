"""One stream, offline: is specserve's engine slower than stock vLLM's suffix engine per request?

Both engines in this process (vLLM's `LLM`, no server, no Ray): `ours` is the n-gram pool's engine as
the cluster builds it (`deployments.vllm_args.engine_kwargs`: the lookup proposer, the per-request-K
scheduler, per-request metrics), its requests in suffix mode at K 16; `ours-nometrics` the same
without per-request spec-decode metrics; `stock` the engine arguments of the bench's stock anchors
(`tools.bench.anchors.stock_engine_args`) with `{"method": "suffix"}`. Tune-half prompts, each
once per engine, one at a time, order alternating per prompt, 1.2 s apart (vLLM's readers busy-poll
for 1 s after a step), every prompt warmed in every engine first; tokens/s, a paired bootstrap
interval against the last variant, and each engine's drafts and steps (vLLM's metrics).

    .venv/bin/python docs/benchmarks/one-stream/engine_pair.py ours,stock 40 6
    .venv/bin/python docs/benchmarks/one-stream/engine_pair.py ours,ours-nometrics,stock 40 46

Arguments: the variants (the last is the reference), how many prompts, how many to skip.
"""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from tools.bench import anchors as A  # noqa: E402
from tools.bench.verdict import bootstrap_ci  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402

CONFIG = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
POOL_NAME, POOL = A.choose_pool(CONFIG, None)
if __name__ == "__main__" and os.environ.get("ENGINE_PAIR_CHILD") != "1":  # the engines' environment
    os.execve(sys.executable, [sys.executable] + sys.argv, {**A.stock_env(POOL), "ENGINE_PAIR_CHILD": "1"})


def engine_args(variant: str) -> dict:
    from deployments.vllm_args import engine_kwargs
    model, dtype = resolve_model(POOL.model, CONFIG), CONFIG.models[POOL.model].dtype
    if variant == "stock":
        kw = dict(A.stock_engine_args(POOL, model, POOL.model, dtype), speculative_config={"method": "suffix"})
    else:
        kw = engine_kwargs(POOL, model, None, POOL.model, dtype)
        if variant == "ours-nometrics":
            kw["per_request_spec_decode_metrics"] = "none"
    kw.pop("enable_log_requests", None)
    return {**kw, "generation_config": "vllm", "disable_log_stats": False}


def interval(a: list, b: list) -> str:
    """95% paired bootstrap interval (the bench's) of tokens/s a over b ((tokens, seconds) per prompt)."""
    def rate(x: list, idx: list[int]) -> float:
        return sum(x[i][0] for i in idx) / sum(x[i][1] for i in idx)
    lo, hi = bootstrap_ci(len(a), lambda idx: rate(a, idx) / rate(b, idx))
    return f"{lo:.4f}-{hi:.4f}"


def main() -> None:
    from tools.bench.split import keep
    from tools.bench.workload import load_prompts
    from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_MODE
    from vllm import LLM, SamplingParams

    variants = sys.argv[1].split(",")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    skip = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if not set(variants) <= {"ours", "ours-nometrics", "stock"}:
        raise SystemExit("variants: ours, ours-nometrics, stock")
    engines = {}
    for v in variants:
        engines[v] = LLM(**engine_args(v))
        if v.startswith("ours"):  # as the engine replica does once the engine runs
            print(v, "attach", engines[v].collective_rpc("specserve_attach_lookup"), flush=True)
    tok = next(iter(engines.values())).get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
             for p in keep(load_prompts(), "tune")[skip:skip + n]]
    for llm in engines.values():  # every prompt's prefix cached in every engine
        llm.generate(texts, SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(1.2)

    def params(v: str) -> SamplingParams:
        extra = {EXTRA_ARGS_MODE: "suffix", EXTRA_ARGS_K: 16} if v.startswith("ours") else None
        return SamplingParams(max_tokens=128, temperature=0, extra_args=extra)

    per: dict[str, list] = {v: [] for v in engines}
    mismatches = 0
    for i, text in enumerate(texts):
        outs = []
        for v in variants if i % 2 == 0 else list(reversed(variants)):
            time.sleep(1.2)
            t = time.perf_counter()
            out = engines[v].generate([text], params(v), use_tqdm=False)[0].outputs[0]
            per[v].append((len(out.token_ids), time.perf_counter() - t))
            outs.append(list(out.token_ids))
        mismatches += any(o != outs[0] for o in outs)
    rates = {v: sum(k for k, _ in x) / sum(s for _, s in x) for v, x in per.items()}
    base = variants[-1]
    print(f"{len(texts)} prompts, greedy mismatches {mismatches}; tok/s",
          {v: round(r, 2) for v, r in rates.items()}, flush=True)
    for v in variants[:-1]:
        print(f"{v} / {base}: {rates[v] / rates[base]:.4f} ({interval(per[v], per[base])})", flush=True)
    for v, llm in engines.items():
        got = {m.name: getattr(m, "value", None) or getattr(m, "count", None) for m in llm.get_metrics()
               if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                             "vllm:iteration_tokens_total")}
        print(v, got, flush=True)


if __name__ == "__main__":
    main()
