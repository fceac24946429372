"""Tests for cluster.routing.classifier and cluster.routing.classifier_eval: hand-written prompts per class (none from
the dev set), the explicit override, chat messages, degenerate inputs, bounded work on huge prompts,
and an accuracy floor on the Spec-Bench dev set."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from cluster.routing.classifier import RULES, classify, classify_text
from cluster.routing.classifier_eval import COPY_GROUPS, SPEC_BENCH_TO_CLASS, evaluate, half_of, main
from cluster.speculation import WORKLOAD_CLASSES

DEV_SET = Path("/work/shared/data/specbench-dev.jsonl")
PASSAGE = (
    "The river town grew around a ferry crossing in the eighteenth century. Merchants built "
    "warehouses along the bank, and a stone bridge replaced the ferry after a flood in 1852. "
) * 20  # ~3.5 KB of prose

EXAMPLES = {
    "translation": [
        "Translate into Spanish: The meeting has been moved to Thursday afternoon.",
        "French to English: Je voudrais réserver une table pour deux personnes ce soir.",
        "How do you say 'where is the train station' in Japanese?",
        "Could you translate this sentence for me? Ich habe meinen Schlüssel verloren.",
        'What does "一期一会" mean in English?',
    ],
    "summarization": [
        "Summarize the following article in three sentences:\n" + PASSAGE,
        "TL;DR please:\n" + PASSAGE,
        PASSAGE + "\nPlease give me a short summary of the text above.",
        "Can you sum up this email thread for my manager? " + PASSAGE[:600],
    ],
    "code": [
        "Write a Python function that checks whether a string is a palindrome.",
        "Why does this raise a KeyError?\n```python\nd = {}\nprint(d['x'])\n```",
        "Implement an LRU cache with O(1) get and put.",
        "def add(a, b):\n    return a - b\n\nFix the bug in the code above.",
        "What is the time complexity of quicksort in the worst case?",
        "How do I center a div with CSS? My code is not working.",
    ],
    "extraction": [
        "Extract every date and the event it refers to from the following text:\n" + PASSAGE[:900],
        "List all the company names mentioned in the passage below.\n" + PASSAGE[:500],
        "Identify the named entities in this news report: Acme Corp opened an office in Oslo on Monday.",
        "Rate each of the following reviews from 1 to 5: (a) Loved it. (b) Awful service. (c) It was fine.",
    ],
    "structured": [
        "Generate a JSON object describing a fictional user with fields name, age and email.",
        "Give me a YAML config for a web server with two replicas.",
        "Return the planets of the solar system as a table with their diameters.",
        "Write an XML schema for a library catalogue entry.",
    ],
    "rag": [
        "Context: " + PASSAGE + "\nQuestion: When was the stone bridge built?",
        PASSAGE + "\nWhat replaced the ferry?",
        "Answer the question based on the documents below.\n" + PASSAGE + "\nWhy were warehouses built?",
        "Document [1]: " + PASSAGE[:700] + "\nWho built the warehouses?",
    ],
    "chat": [
        "Hi! How are you doing today?",
        "Act as a travel agent and help me plan a weekend in Lisbon.",
        "Pretend to be a pirate captain for the rest of this conversation.",
        "I'm feeling a bit stressed about my exams, any advice",
        "Imagine yourself as a medieval blacksmith talking to a customer.",
    ],
    "creative": [
        "Write a haiku about autumn rain.",
        "Compose a short story about a robot who learns to paint.",
        "Come up with five catchy slogans for a bakery.",
        "Draft a wedding toast for my sister.",
        "Describe a sunset over the ocean in vivid, poetic language.",
    ],
    "math": [
        "Solve for x: 3x + 7 = 22.",
        "What is the derivative of x^3 * sin(x)?",
        "A train travels 120 km in 1.5 hours. How fast is it going in km per hour?",
        "Maria has 12 apples and gives 5 to her brother. How many apples does she have left?",
        "What is the probability of rolling two sixes with two fair dice?",
        "Compute the integral of 1/x from 1 to e.",
    ],
    "reasoning": [
        "Solve this riddle: what has keys but can't open locks?",
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain your reasoning.",
        "Suppose you are in a room with three light switches and one bulb upstairs. How can you tell which switch controls it?",
        "Think step by step: which is heavier, a kilogram of feathers or a kilogram of steel?",
    ],
    "qa": [
        "Who wrote Pride and Prejudice?",
        "What is the capital of Australia?",
        "Explain how vaccines train the immune system.",
        "Describe the main causes of the French Revolution.",
        "why is the sky blue",
    ],
}


def test_examples_cover_every_class():
    assert set(EXAMPLES) == set(WORKLOAD_CLASSES)


@pytest.mark.parametrize("expected,prompt", [(c, p) for c, ps in EXAMPLES.items() for p in ps])
def test_hand_written_examples(expected, prompt):
    got, rule = classify_text(prompt)
    assert got == expected, f"{prompt[:80]!r} -> {got} by {rule}"
    assert classify(text=prompt) == expected


def test_rule_order_first_match_wins():
    # translation and summarization are checked before code/structured: the verb decides.
    assert classify(text="Translate the comments in this code to German:\n```\n# add two numbers\n```") == "translation"
    assert classify(text="Summarize what the following script does:\n```bash\nrm -rf build && make\n```") == "summarization"
    # extraction (a verb with a source) before structured (a format word).
    assert classify(text="Extract the names from the text below and output JSON.\n" + PASSAGE[:500]) == "extraction"
    # "summarize" with nothing to summarize is a knowledge question, not summarization.
    assert classify(text="Summarize the causes of World War I.") == "qa"
    assert [name for name, _ in RULES][0] == "translation"


# --- explicit class ---------------------------------------------------------------------------
@pytest.mark.parametrize("cls", WORKLOAD_CLASSES)
def test_explicit_class_wins(cls):
    assert classify(text="Translate German to English: Guten Morgen", explicit=cls) == cls
    assert classify(messages=[{"role": "user", "content": "hi"}], explicit=cls) == cls


def test_empty_explicit_is_ignored():
    assert classify(text="Write a haiku about snow.", explicit="") == "creative"
    assert classify(text="Write a haiku about snow.", explicit=None) == "creative"


@pytest.mark.parametrize("bad", ["poetry", "Code", "json", " chat"])
def test_invalid_explicit_class_names_allowed_values(bad):
    with pytest.raises(ValueError) as err:
        classify(text="Who wrote Hamlet?", explicit=bad)
    msg = str(err.value)
    assert repr(bad) in msg
    assert all(c in msg for c in WORKLOAD_CLASSES)


def test_text_and_messages_together_is_an_error():
    with pytest.raises(ValueError):
        classify(text="hi", messages=[{"role": "user", "content": "hi"}])


# --- chat messages ----------------------------------------------------------------------------
def test_messages_use_last_user_message():
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a poem about the sea."},
        {"role": "assistant", "content": "The sea is wide..."},
        {"role": "user", "content": "Now translate it into French."},
    ]
    assert classify(messages=msgs) == "translation"


def test_messages_content_parts_and_objects():
    class Msg:
        def __init__(self, role, content):
            self.role, self.content = role, content

    parts = [{"type": "text", "text": "Write a Python function"}, {"type": "text", "text": "that reverses a list."}]
    assert classify(messages=[{"role": "user", "content": parts}]) == "code"
    assert classify(messages=[Msg("user", "Who painted the Mona Lisa?")]) == "qa"


def test_messages_with_retrieved_context_are_rag():
    question = {"role": "user", "content": "When was the bridge built?"}
    assert classify(messages=[question]) == "qa"
    system = {"role": "system", "content": "Answer using only the context.\nContext: " + PASSAGE[:500]}
    assert classify(messages=[system, question]) == "rag"
    tool = {"role": "tool", "content": PASSAGE[:500]}
    assert classify(messages=[question, tool]) == "rag"
    # a plain system prompt does not make a question rag
    assert classify(messages=[{"role": "system", "content": "You are terse."}, question]) == "qa"


def test_messages_without_user_fall_back_to_all_content():
    assert classify(messages=[{"role": "system", "content": "Write a limerick about cats."}]) == "creative"
    assert classify(messages=[]) == "chat"


# --- degenerate inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("text", [None, "", " ", "\n\t  \n", " " * 1_000_000, "?", "12345", "🙂🙂🙂"])
def test_degenerate_inputs_return_a_class(text):
    assert classify(text=text) in WORKLOAD_CLASSES


def test_empty_is_chat():
    assert classify() == "chat"
    assert classify(text="   ") == "chat"


@pytest.mark.parametrize(
    "text",
    ["这是什么意思？", "Как дела?", "مرحبا كيف حالك", "Ünïcödé ñame: José Ñúñez", "\u200b\u200b", "\ud800 lone surrogate"],
)
def test_unicode_inputs(text):
    assert classify(text=text) in WORKLOAD_CLASSES


def test_random_strings_always_classify():
    rng = random.Random(1234)
    alphabet = "abcdefghij XYZ0123456789\n\t.,?!:;{}()[]|\\/*+-=<>$%`'\"é中ж"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3000)))
        assert classify(text=text) in WORKLOAD_CLASSES


# --- bounded work -----------------------------------------------------------------------------
def _best_of(n, fn):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def test_huge_prompts_classify_from_their_head_and_tail():
    huge = PASSAGE * (1_000_000 // len(PASSAGE))
    assert len(huge) > 900_000
    assert classify(text="Summarize the following report:\n" + huge) == "summarization"
    assert classify(text=huge + "\nWhen was the stone bridge built?") == "rag"


ADVERSARIAL_UNITS = ["a", "1", "1 + ", "function", "function(", "def f(", "class A(", "SELECT * ", "((((",
                     "{", "|x", "\\frac", "translate ", "German to English ", "the following text ",
                     "write a poem ", "imagine you are a ", "http://a.b/c?d=e&f ", "\n", "    ", "中文",
                     "x = 1; ", "summarize ", "Context: "]


@pytest.mark.parametrize("unit", ADVERSARIAL_UNITS)
def test_one_megabyte_prompt_is_fast(unit):
    """A guard against pathological regexes and O(n) scans, not a benchmark: the view is bounded."""
    text = (unit * (1_000_000 // len(unit) + 1))[:1_000_000]
    seconds, cls = _best_of(3, lambda: classify(text=text))
    assert cls in WORKLOAD_CLASSES
    assert seconds < 0.005, f"{unit!r}: {seconds * 1e3:.2f} ms"


# --- mapping, helpers, CLI --------------------------------------------------------------------
def test_mappings_are_consistent():
    assert set(SPEC_BENCH_TO_CLASS.values()) <= set(WORKLOAD_CLASSES)
    grouped = [c for cs in COPY_GROUPS.values() for c in cs]
    assert sorted(grouped) == sorted(WORKLOAD_CLASSES)  # a partition: every class exactly once


def test_latency_percentiles_and_halves(tmp_path):
    # The report's latency percentiles are nearest-rank (tests/cluster/test_percentile.py), 0.0 with no calls.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert evaluate(str(empty), repeats=1)["latency_us"] == {"calls": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    assert [half_of(q) for q in (81, 83, 85, 87)] == ["A", "B", "A", "B"]


def test_main_usage_error(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


# --- accuracy on the Spec-Bench dev set -------------------------------------------------------
# Measured: 0.979 overall, 0.992 on half A (tuned), 0.967 on half B (held out), copy groups 0.983.
# Floors sit a few points below, so a regression fails.
@pytest.fixture(scope="module")
def report():
    if not DEV_SET.exists():
        pytest.skip(f"{DEV_SET} not present")
    return evaluate(str(DEV_SET), repeats=1)


def test_dev_set_accuracy_floor(report):
    assert report["n"] == 240
    assert report["accuracy"] >= 0.95
    assert report["accuracy_half_B_heldout"] >= 0.93
    assert report["copy_group_accuracy"] >= 0.95


def test_dev_set_large_categories(report):
    for cat in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert report["per_category"][cat]["accuracy"] >= 0.9, (cat, report["confusion"][cat])


def test_dev_set_report_is_consistent(report):
    assert sum(sum(row.values()) for row in report["confusion"].values()) == report["n"]
    correct = sum(report["confusion"][cat].get(SPEC_BENCH_TO_CLASS[cat], 0) for cat in report["confusion"])
    assert correct / report["n"] == pytest.approx(report["accuracy"], abs=1e-4)
    # the bound is < 1 ms per request; p99 is looser because the CPU is shared
    assert 0 < report["latency_us"]["p50"] < 1000
    assert report["latency_us"]["p50"] <= report["latency_us"]["p99"] < 5000


def test_main_prints_report(capsys):
    if not DEV_SET.exists():
        pytest.skip(f"{DEV_SET} not present")
    assert main([str(DEV_SET)]) == 0
    out = capsys.readouterr().out
    assert "accuracy=" in out and "p99=" in out and "translation" in out
