"""A benchmark workload of constrained requests: JSON-schema extraction and tool calls.

Contract: `generate(per_category, seed)` returns Spec-Bench-format records (`question_id`,
`category`, `turns`) that also carry `request`: OpenAI request fields the bench adds to the body
(`tools.bench.workload.Prompt.request`), the same for the cluster and every stock server. Two
categories, filled from `tools.bench.repeated`'s word lists by a seeded `random.Random` (stdlib
only, no network):

- `json_extraction`: a sentence about a person -> `response_format` `json_schema` with five typed,
  required keys (vLLM's structured outputs hold the answer to the schema).
- `tool_call`: a customer's request -> `tools` (weather, booking, unit conversion) with
  `tool_choice` `required` (vLLM constrains the answer to a call of one of them).

The router files both as `structured` (`cluster.api.openai_body.request_class`). Question ids are
numbered per category with gaps so that each category falls into exactly equal halves of
`tools.bench.split`, as in `tools.bench.repeated`.

    python -m tools.bench.structured --out cluster/data/structured.jsonl --per-category 40 --seed 11
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tools.bench.repeated import CITIES, FIRST, JOBS, LAST, MONTHS, _person
from tools.bench.split import TUNE, UNTOUCHED, split_half

PERSON_SCHEMA = {"type": "object", "additionalProperties": False,
                 "required": ["name", "age", "city", "job", "email"],
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                                "job": {"type": "string"}, "email": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city on a day",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "day"],
                       "properties": {"city": {"type": "string"}, "day": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a restaurant table",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["name", "people", "day"],
                       "properties": {"name": {"type": "string"}, "people": {"type": "integer"},
                                      "day": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert an amount from one unit to another",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "from_unit", "to_unit"],
                       "properties": {"amount": {"type": "number"}, "from_unit": {"type": "string"},
                                      "to_unit": {"type": "string"}}}}},
]
UNITS = [("km", "miles"), ("kg", "pounds"), ("litres", "gallons"), ("celsius", "fahrenheit")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _extraction(rng: random.Random) -> tuple[str, dict]:
    p = _person(rng)
    text = rng.choice([
        "{name} is {age} and works as {a_job} in {city}; write to {email}.",
        "Meet {name}, {a_job} from {city}, aged {age} (email: {email}).",
        "{name} ({age}) lives in {city}, is {a_job}, and can be reached at {email}.",
    ]).format(**p)
    prompt = f"Extract the person's name, age, city, job and email as JSON.\n\nText: {text}"
    return prompt, {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}


def _tool(rng: random.Random) -> tuple[str, dict]:
    kind = rng.randrange(3)
    if kind == 0:
        prompt = f"What will the weather be like in {rng.choice(CITIES)} on {rng.choice(DAYS)}?"
    elif kind == 1:
        prompt = (f"Please book a table for {rng.randint(2, 9)} people under the name {rng.choice(FIRST)} "
                  f"{rng.choice(LAST)} on {rng.choice(DAYS)} {rng.randint(1, 28)} {rng.choice(MONTHS)}.")
    else:
        src, dst = rng.choice(UNITS)
        prompt = f"How many {dst} is {rng.randint(2, 500)} {src}? I am a {rng.choice(JOBS)} and need it exact."
    return prompt, {"tools": TOOLS, "tool_choice": "required"}


CATEGORIES = {"json_extraction": _extraction, "tool_call": _tool}


def generate(per_category: int, seed: int) -> list[dict]:
    """`per_category` records of each category, half of each in each split half (per_category even)."""
    rng = random.Random(seed)
    out = []
    for category, make in CATEGORIES.items():
        halves = {TUNE: 0, UNTOUCHED: 0}
        n = 0
        while sum(halves.values()) < per_category:
            qid = f"{category}-{n:03d}"
            n += 1
            half = split_half(qid)
            if halves[half] >= per_category // 2:
                continue
            halves[half] += 1
            prompt, request = make(rng)
            out.append({"question_id": qid, "category": category, "turns": [prompt], "request": request})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-category", type=int, default=40)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    rows = generate(args.per_category, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
