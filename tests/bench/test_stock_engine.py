"""One real stock vLLM server started through `tools.bench.anchors` (about 1-2 minutes; no cluster).

Built from the embedded default's n-gram pool (cluster/configs/local-cpu.yaml) as `--baselines ngram:3`
builds it: two greedy requests through the bench's runner come back with their token ids; the
server saw the prompt tokens specserve's engine would (the chat template, tokenized as a text
prompt); and after the fleet's exit no process of the server's tree is left.
"""
import asyncio
from pathlib import Path

import httpx
import pytest

from tools.bench import anchors as A
from tools.bench.runner import Job, Runner
from tools.bench.workload import Prompt
from cluster.client import AsyncSpecServeClient
from cluster.client_wire import iter_sse_data
from cluster.config import load_config
from tests.paths import LOCAL_CPU

pytestmark = pytest.mark.engine
PROMPTS = [Prompt("p1", "qa", "qa", "List three colours, then list them again in the same order."),
           Prompt("p2", "qa", "qa", "What is the capital of France?")]


def _tree(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def test_a_real_stock_server_serves_greedy_token_ids_and_stops(tmp_path):
    pytest.importorskip("vllm")
    from cluster.ops.models import resolve_model

    config = load_config(LOCAL_CPU)
    pool_name, pool = A.choose_pool(config, None)
    (baseline,) = A.parse_baselines("ngram:3", pool, pool_name)
    model_dir = resolve_model(pool.model, config)
    (server,) = A.plan_servers([baseline], pool, model_dir, pool.model, config.models[pool.model].dtype, tmp_path)
    server.env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # the smallest cache: the test shares the machine's memory
    need, free = A.memory_needed_gib(server.env, 1), A.mem_available_gib()
    if free is not None and free < need:  # the estimate holds ~0.6 GiB over the measured PSS
        pytest.skip(f"a stock server needs about {need:.1f} GiB, {free:.1f} GiB available")

    async def send(url: str):
        async with AsyncSpecServeClient(url, timeout_s=300) as client:
            runner = Runner(None, model=pool.model, max_tokens=24, stock_clients={baseline.name: client},
                            request_timeout_s=300)
            samples = await runner.run_sequential([Job("compare", baseline.config(), p) for p in PROMPTS])
        body = {"model": pool.model, "messages": PROMPTS[0].messages, "max_tokens": 24, "temperature": 0,
                "stream": True, "return_token_ids": True}
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(url + "/v1/chat/completions", json=body)
        import json

        events = [json.loads(e) for e in iter_sse_data(r.text.splitlines()) if e.strip() != "[DONE]"]
        return samples, events

    with A.StockFleet([server], timeout_s=pool.startup_timeout_s, log=print) as urls:
        tree = _tree(server.proc.pid)
        assert len(tree) >= 2  # the API server and its engine core (and worker)
        samples, events = asyncio.run(send(urls[baseline.name]))
    assert all(s.ok and s.output_tokens > 0 and s.spec == {} for s in samples), [s.error for s in samples]
    assert all(len(s.token_ids) == sum(s.chunk_tokens) for s in samples)
    # The same prompt, greedy, streamed again: the same tokens.
    again = [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]
    assert again == samples[0].token_ids
    # The prompt tokens specserve's engine would send for this chat (template, then a text prompt).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(PROMPTS[0].messages, tokenize=False, add_generation_prompt=True)
    assert events[0]["prompt_token_ids"] == tok(text)["input_ids"]
    # Stopped: nothing of the process tree is left.
    import psutil

    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "--speculative-config" in server.log_path.read_text().splitlines()[0]
