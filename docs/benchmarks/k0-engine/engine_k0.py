"""Is a vLLM engine built for n-gram speculation slower than a plain one when it drafts nothing?

Offline (vLLM's `LLM`, no server, no cluster): the n-gram pool's engine arguments, with no
speculation (`none`) or with vLLM's batch-size table (`table`, which drafts nothing at 12 running
requests or more). Two shapes: every request starts together and runs 128 tokens (`--steady`, the
batch stays at `--n`), or `--n` requests with natural lengths pass through `--seqs` slots, so requests
join and leave the batch. Run each variant in its own process, alternating, on a quiet machine:

    for v in none table none table; do
      LD_PRELOAD=.venv/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 \
        .venv/bin/python docs/benchmarks/k0-engine/engine_k0.py $v --model MODEL_DIR --n 96 --seqs 32
    done
"""

import argparse
import json
import os
import time
from pathlib import Path

TABLE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
         "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 11, 1], [12, 64, 0]]}
PROMPTS = Path(__file__).resolve().parents[3] / "cluster" / "data" / "specbench-dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=["none", "table"])
    ap.add_argument("--model", required=True, help="the pool's model directory")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--seqs", type=int, default=64, help="max_num_seqs")
    ap.add_argument("--steady", action="store_true", help="ignore EOS: every request runs 128 tokens")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="float32", max_model_len=2048, enforce_eager=True, max_num_batched_tokens=2112,
              max_num_seqs=a.seqs, enable_chunked_prefill=False, generation_config="vllm",
              speculative_config=TABLE if a.variant == "table" else None)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:a.n]
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True) for r in rows]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # prefix cache warm for both variants
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=a.steady)
    for i in range(a.rounds):
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        print(f"{a.variant} n={a.n} seqs={a.seqs} steady={a.steady} round={i}: "
              f"{sum(len(o.outputs[0].token_ids) for o in out) / dt:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
