"""A second benchmark workload where earlier outputs matter: prompts that repeat one structure per category.

Contract: `generate(per_category, seed)` returns Spec-Bench-format records (`question_id`, `category`,
`turns`: [one first turn]) whose outputs share their shape within a category, so that a drafter that
remembers earlier requests' outputs (SuffixDecoding, vLLM `method: suffix`) has something to find
that prompt lookup (n-gram) does not. Four categories, one template each, filled from small word lists
by a seeded `random.Random` (stdlib only, no network):

- `templated_extraction`: a sentence about a person -> a JSON object with the same five keys.
- `agent_loop`: an agent's log entry (JSON) and its tool's result -> the next entry, the next tool chosen.
- `code_edit`: a small Python function -> the same function with int type hints and a docstring.
- `form_chat`: a booking form's state (JSON) and the customer's next message -> the updated form.

Each prompt carries a worked example of the expected reply: SmolLM2-135M follows an example far more
reliably than an instruction (checked by greedy decoding 3 prompts per category; other shapes, such as
`Thought:`/`Action:` lines or a multi-turn transcript, were answered in free prose). The question ids are
numbered per category with gaps, so that each category falls into exactly equal halves of
`tools.bench.split` (the split hashes the id).

    python -m tools.bench.repeated --out cluster/data/repeated-structure.jsonl --per-category 60 --seed 7
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Callable, Optional

from tools.bench.split import TUNE, UNTOUCHED, split_half

FIRST = ["Ana", "Ben", "Chloe", "Dario", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jonas", "Kofi", "Lena",
         "Marta", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wei", "Yara"]
LAST = ["Ruiz", "Okafor", "Novak", "Berg", "Costa", "Dubois", "Ito", "Kowalski", "Larsen", "Moreau",
        "Nakamura", "Patel", "Rossi", "Schmidt", "Silva", "Tanaka", "Weber", "Yilmaz", "Zhang", "Haddad"]
CITIES = ["Lyon", "Porto", "Oslo", "Gdansk", "Leeds", "Graz", "Turin", "Ghent", "Aarhus", "Bilbao", "Brno",
          "Cork", "Malmo", "Utrecht", "Basel", "Split", "Tartu", "Nantes", "Bergen", "Krakow"]
JOBS = ["nurse", "teacher", "plumber", "chef", "pilot", "baker", "lawyer", "farmer", "dentist", "architect",
        "librarian", "mechanic", "editor", "florist", "pharmacist", "engineer"]
DOMAINS = ["mail.com", "post.org", "inbox.net", "web.io"]
THINGS = ["bridge", "cathedral", "library", "museum", "stadium", "tower", "harbour", "castle", "theatre"]
MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
VERBS = ["scale", "shift", "clip", "blend", "count", "total", "weigh", "merge", "split", "rank", "score"]
NOUNS = ["price", "score", "width", "height", "speed", "load", "rate", "level", "budget", "stock", "delay"]
ARGS = ["x", "y", "n", "k", "a", "b", "value", "limit", "step", "factor", "base", "offset"]
OPS = ["+", "-", "*"]


def _person(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    job = rng.choice(JOBS)
    return {"name": f"{first} {last}", "age": rng.randint(19, 78), "city": rng.choice(CITIES), "job": job,
            "a_job": ("an " if job[0] in "aeiou" else "a ") + job,
            "email": f"{first.lower()}.{last.lower()}@{rng.choice(DOMAINS)}"}


def _person_json(p: dict) -> str:
    """One record as a JSON line, keys in the template's order.

    >>> _person_json({"name": "A B", "age": 3, "city": "C", "job": "d", "email": "e"})
    '{"name": "A B", "age": 3, "city": "C", "job": "d", "email": "e"}'
    """
    return json.dumps({k: p[k] for k in ("name", "age", "city", "job", "email")})


RECORD_PHRASES = [
    "{name}, {age}, works as {a_job} in {city} ({email}).",
    "{name} is {age} years old and lives in {city}, job: {job}, email {email}.",
    "From {city}: {name}, {job}, aged {age}, reachable at {email}.",
]
EXAMPLE_PEOPLE = [
    {"name": "Ana Ruiz", "age": 34, "city": "Lyon", "job": "nurse", "a_job": "a nurse", "email": "ana.ruiz@mail.com"},
    {"name": "Ben Okafor", "age": 51, "city": "Oslo", "job": "chef", "a_job": "a chef", "email": "ben.okafor@web.io"},
]


def templated_extraction(rng: random.Random) -> str:
    shots = "".join(f"Text: {RECORD_PHRASES[i].format(**p)}\nJSON: {_person_json(p)}\n\n"
                    for i, p in enumerate(EXAMPLE_PEOPLE))
    return ("Convert the text about a person to JSON with the keys name, age, city, job, email.\n\n" + shots
            + f"Text: {rng.choice(RECORD_PHRASES).format(**_person(rng))}\nJSON:")


def _log_entry(step: int, tool: str, tool_input: str, result: Optional[str]) -> str:
    return json.dumps({"step": step, "tool": tool, "input": tool_input, "result": result})


def agent_loop(rng: random.Random) -> str:
    city, thing, year = rng.choice(CITIES), rng.choice(THINGS), rng.randint(1150, 1990)
    builder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    example = "The tower of Graz is 28 metres tall."
    return ("Update the agent's log entry with the tool's result and choose the next tool (search or finish). "
            "Reply with the new entry as JSON.\n\n"
            f"Entry: {_log_entry(1, 'search', 'tower of Graz', None)}\nResult: {example}\n"
            f"JSON: {_log_entry(2, 'finish', '28 metres', example)}\n\n"
            f"Entry: {_log_entry(1, 'search', f'{thing} of {city}', None)}\n"
            f"Result: The {thing} of {city} was built in {year} by {builder}.\nJSON:")


def _function(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(name, arguments, body lines) of a small two-argument function."""
    name = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    a, b = rng.sample(ARGS, 2)
    op, c = rng.choice(OPS), rng.randint(2, 9)
    body = rng.choice([
        [f"result = {a} {op} {b}", f"return result * {c}"],
        [f"if {a} > {b}:", f"    return {a} {op} {c}", f"return {b}"],
        ["total = 0", f"for i in range({a}):", f"    total += i {op} {b}", "return total"],
        [f"while {a} > {c}:", f"    {a} = {a} - {b}", f"return {a}"],
    ])
    return name, [a, b], body


def _render(name: str, args: list[str], body: list[str], typed: bool = False, doc: str = "") -> str:
    """The source of a function, with int hints and a docstring when asked.

    >>> print(_render("f", ["a", "b"], ["return a"], typed=True, doc="Return a."))
    def f(a: int, b: int) -> int:
        \"\"\"Return a.\"\"\"
        return a
    """
    sig = ", ".join(f"{x}: int" if typed else x for x in args) + (") -> int:" if typed else "):")
    lines = [f"def {name}({sig}"] + ([f'    """{doc}"""'] if doc else []) + [f"    {line}" for line in body]
    return "\n".join(lines)


def code_edit(rng: random.Random) -> str:
    example = ("add_width", ["x", "y"], ["return x + y"])
    return ("Example of the edit:\n```python\n" + _render(*example) + "\n```\nbecomes\n```python\n"
            + _render(*example, typed=True, doc="Add x and y.") + "\n```\n\nNow the function:\n```python\n"
            + _render(*_function(rng)) + "\n```\n\nApply the same edit to this function: int type hints and a "
            "one-line docstring. Reply with the whole function only.")


FORM_FIELDS = ("name", "arrival", "nights", "guests", "room", "phone")


def _form(values: dict, known: tuple[str, ...]) -> str:
    """The booking form as one JSON line, null where the field is not known yet.

    >>> _form({"name": "A", "nights": 2}, ("name",))
    '{"name": "A", "arrival": null, "nights": null, "guests": null, "room": null, "phone": null}'
    """
    return json.dumps({f: values[f] if f in known else None for f in FORM_FIELDS})


def form_chat(rng: random.Random) -> str:
    example = {"name": "Ana Ruiz", "arrival": "3 May", "nights": 2}
    v = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "arrival": f"{rng.randint(1, 28)} {rng.choice(MONTHS)}",
         "nights": rng.randint(1, 9)}

    def turn(x: dict) -> str:
        return (f"State: {_form(x, ('name',))}\n"
                f"Message: We arrive on {x['arrival']} for {x['nights']} nights.\nJSON:")

    return ("Update the booking state with the customer's message. Reply with the new state as JSON.\n\n"
            + turn(example) + f" {_form(example, ('name', 'arrival', 'nights'))}\n\n" + turn(v))


CATEGORIES: dict[str, Callable[[random.Random], str]] = {
    "templated_extraction": templated_extraction, "agent_loop": agent_loop,
    "code_edit": code_edit, "form_chat": form_chat,
}


def balanced_ids(prefix: str, n: int) -> list[str]:
    """`n` ids `<prefix>-NNN`, numbered upward with gaps so that `split_half` puts exactly n // 2 of
    them in `untouched` and the rest in `tune`.

    >>> ids = balanced_ids("c", 6); [split_half(i) for i in ids].count(TUNE), len(set(ids))
    (3, 6)
    """
    want = {TUNE: n - n // 2, UNTOUCHED: n // 2}
    out, k = [], 0
    while len(out) < n:
        qid = f"{prefix}-{k:03d}"
        half = split_half(qid)
        if want[half]:
            want[half] -= 1
            out.append(qid)
        k += 1
    return out


def generate(per_category: int, seed: int, categories: Optional[list[str]] = None) -> list[dict]:
    """`per_category` records of each category, distinct texts, the same for the same arguments.

    >>> a = generate(3, seed=1); len(a), a == generate(3, seed=1), a == generate(3, seed=2)
    (12, True, False)
    >>> sorted(a[0])
    ['category', 'question_id', 'turns']
    """
    records = []
    for category in categories or list(CATEGORIES):
        rng = random.Random(f"{seed}:{category}")
        texts: list[str] = []
        for _ in range(per_category * 100):
            if len(texts) == per_category:
                break
            text = CATEGORIES[category](rng)
            if text not in texts:
                texts.append(text)
        if len(texts) < per_category:
            raise ValueError(f"--per-category {per_category}: only {len(texts)} distinct {category} prompts")
        records += [{"question_id": qid, "category": category, "turns": [text]}
                    for qid, text in zip(balanced_ids(category, per_category), texts, strict=True)]
    return records


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.repeated", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="The JSONL file to write (Spec-Bench format).")
    parser.add_argument("--per-category", type=int, default=60, help="Prompts per category (60).")
    parser.add_argument("--seed", type=int, default=7, help="Seed of the word draws (7).")
    args = parser.parse_args(argv)
    if args.per_category < 1:
        parser.error(f"--per-category: expected a positive integer, got {args.per_category}")
    try:
        records = generate(args.per_category, args.seed)
    except ValueError as e:
        print(f"repeated: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"repeated: {len(records)} prompts in {len(CATEGORIES)} categories -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
