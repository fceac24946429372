"""Stock vLLM on this CPU build, sampled at temperature 1 with and without speculation, offline.

    .venv/bin/python docs/benchmarks/sampling/stock_check.py none|ngram|suffix
    SPECSERVE_SAMPLING_FIX=1 .venv/bin/python docs/benchmarks/sampling/stock_check.py ngram

vLLM's `LLM` with the n-gram pool's engine arguments as `specserve bench` gives its stock anchors
(no specserve scheduler or proposer), 12 seeded requests of a counting prompt, twice. Without
speculation the answers continue the count and a seed gives the same text both times; with it,
vLLM 0.32's CPU build draws rejected positions from logits divided by uninitialized temperatures
(`cluster/engine/sampling_fix.py`). With SPECSERVE_SAMPLING_FIX=1 the specserve plugin installs
the fix in this stock engine too. Output of runs here: `output.txt`.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from tools.bench import anchors as A  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402

CONFIG = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
POOL_NAME, POOL = A.choose_pool(CONFIG, None)
SPECS = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 5}, "suffix": {"method": "suffix"}}
PROMPT = ("Count: one two three four five six seven eight nine ten. "
          "Count: one two three four five six seven eight nine ten. Count: one two three")
if __name__ == "__main__" and os.environ.get("STOCK_CHECK_CHILD") != "1":  # the engines' environment
    os.execve(sys.executable, [sys.executable] + sys.argv, {**A.stock_env(POOL), "STOCK_CHECK_CHILD": "1"})


def main() -> None:
    from vllm import LLM, SamplingParams

    if len(sys.argv) != 2 or sys.argv[1] not in SPECS:
        sys.exit(__doc__)
    model, dtype = resolve_model(POOL.model, CONFIG), CONFIG.models[POOL.model].dtype
    kw = dict(A.stock_engine_args(POOL, model, POOL.model, dtype))
    kw.pop("enable_log_requests", None)
    if SPECS[sys.argv[1]]:
        kw["speculative_config"] = SPECS[sys.argv[1]]
    llm = LLM(**kw, generation_config="vllm")
    fix = os.environ.get("SPECSERVE_SAMPLING_FIX") == "1"
    for name in ("first pass", "same seeds again"):
        outs = llm.generate([PROMPT] * 12, [SamplingParams(max_tokens=10, temperature=1.0, seed=i) for i in range(12)],
                            use_tqdm=False)
        print(sys.argv[1], "fix" if fix else "stock", name, [o.outputs[0].text for o in outs], flush=True)


if __name__ == "__main__":
    main()
