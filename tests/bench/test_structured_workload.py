"""The constrained workload (`tools.bench.structured`): its shipped file is what the generator makes,
each category splits evenly, and its request fields reach the cluster's and the stock servers' bodies."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench import plan as P
from tools.bench.runner import Job, Runner
from tools.bench.split import split_half
from tools.bench.structured import generate
from tools.bench.workload import load_prompts

SHIPPED = Path(__file__).resolve().parents[2] / "cluster" / "data" / "structured.jsonl"


def test_the_shipped_file_is_the_generators_output_and_halves_each_category():
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    assert rows == generate(40, 11)
    for category in ("json_extraction", "tool_call"):
        halves = [split_half(r["question_id"]) for r in rows if r["category"] == category]
        assert halves.count("tune") == halves.count("untouched") == 20


def test_each_prompt_carries_its_request_fields_into_every_body():
    prompts = load_prompts(SHIPPED)
    extraction = next(p for p in prompts if p.category == "json_extraction")
    tool = next(p for p in prompts if p.category == "tool_call")
    assert extraction.request["response_format"]["json_schema"]["schema"]["required"][1] == "age"
    assert tool.request["tool_choice"] == "required" and len(tool.request["tools"]) == 3
    runner = Runner(None, model=None, max_tokens=4, stock_clients={"stock-none": object()})
    for cfg in (*P.parse_configs("auto", {}), P.baseline_config("stock-none")):
        _, kwargs = runner._request(Job("compare", cfg, tool))
        assert kwargs["extra"]["tools"] == tool.request["tools"] and kwargs["extra"]["return_token_ids"] is True
