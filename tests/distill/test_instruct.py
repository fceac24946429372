"""Self-instructed training prompts (tools/distill/instruct.py): the pure parts, and the cached
generation with a stand-in engine (the real engine runs in `specserve distill --self-instruct`)."""

import pytest

from tools.distill import instruct
from tests.distill.test_ship_data import CharTokenizer


def test_message_numbers_and_cuts_examples_on_a_word():
    msg = instruct.instruct_message(["Short one.", "word " * 100], max_example_chars=30)
    assert "1. Short one." in msg and "\n2. word word" in msg
    line2 = msg.split("\n2. ")[1].split("\n")[0]
    assert line2.endswith(" ...") and len(line2) <= 34 and "wor ..." not in line2
    assert msg.endswith("Reply with the request only.")


@pytest.mark.parametrize("reply, want", [
    ("Explain how tides work on Earth.", "Explain how tides work on Earth."),
    ('4. "Describe the water cycle in simple terms."', "Describe the water cycle in simple terms."),
    ("Request: Write a poem about autumn leaves.\n\nSure! Here it is", "Write a poem about autumn leaves."),
    ("New request 3: Compare cats and dogs as pets.", "Compare cats and dogs as pets."),
    ("- Summarize the plot of Hamlet briefly.", "Summarize the plot of Hamlet briefly."),
    ("\n\n  What is the capital of\n France and why?  ", "What is the capital of France and why?"),
    ("Here's a new request:\n\nExplain how volcanoes form.", "Explain how volcanoes form."),  # lead-in, then the request
    ('Here is a new request: "Plan a picnic for six people."', "Plan a picnic for six people."),
    ("That's my idea! One new request: List three uses of copper.", "List three uses of copper."),
    ("Here is a new request:", None),  # a lead-in with nothing after it
    ("Here are examples of requests that users send to an AI assistant.", None),  # the instruction echoed
    ("Write one new request of the same kind about a different subject, about stars.", None),
    ("Hi.", None),  # too short
    ("1234567890 1234567890", None),  # no letter
    ("x" * 700, None),  # too long
    ("", None),
])
def test_parse_request(reply, want):
    assert instruct.parse_request(reply) == want


def test_pick_requests_dedupes_and_excludes_the_pool():
    replies = ["Tell me about the Moon landing.", "tell me  about the moon landing.", "Hi",
               "An existing pool prompt here.", "Write a limerick about a cat.", "Plan a trip to Rome for me."]
    got = instruct.pick_requests(replies, 2, exclude=["An existing pool prompt here."])
    assert got == ["Tell me about the Moon landing.", "Write a limerick about a cat."]
    assert instruct.pick_requests(replies, 10, exclude=[])[-1] == "Plan a trip to Rome for me."


def test_jobs_are_seeded_and_draw_only_from_the_pool():
    tok = CharTokenizer()
    pool = [f"pool prompt number {i}" for i in range(10)]
    a = instruct.instruct_jobs(tok, pool, 5, seed=1)
    assert a == instruct.instruct_jobs(tok, pool, 5, seed=1)
    assert a != instruct.instruct_jobs(tok, pool, 5, seed=2)
    assert len({j["seed"] for j in a}) == 5 and all(j["temperature"] == 1.0 for j in a)
    with pytest.raises(ValueError, match="pool"):
        instruct.instruct_jobs(tok, [], 1, seed=0)


class DecodingTokenizer(CharTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_self_instruct_generates_once_then_reads_the_cache(tmp_path):
    calls = []
    replies = ["Describe a rainy day in a city.", "Describe a rainy day in a city.", "ok",
               "Explain why the sky is blue.", "List three uses of copper."]

    def fake_generate(model_path, jobs, max_model_len, log_fn=print):
        calls.append(jobs)
        return [[ord(c) for c in replies[i % len(replies)]] for i in range(len(jobs))]

    kw = dict(target_key=["t"], log_fn=lambda m: None, generate=fake_generate)
    pool = ["Write a story about a dragon.", "What is photosynthesis?"]
    got = instruct.self_instruct(DecodingTokenizer(), "/m", pool, 3, 0, tmp_path, **kw)
    assert got == ["Describe a rainy day in a city.", "Explain why the sky is blue.", "List three uses of copper."]
    assert len(calls) == 1 and len(calls[0]) == 5  # 3 x 1.5 + 1 jobs
    assert instruct.self_instruct(DecodingTokenizer(), "/m", pool, 3, 0, tmp_path, **kw) == got
    assert len(calls) == 1  # cached
    instruct.self_instruct(DecodingTokenizer(), "/m", pool, 3, 1, tmp_path, **kw)  # another seed: generated
    assert len(calls) == 2
    assert instruct.self_instruct(DecodingTokenizer(), "/m", pool, 0, 0, tmp_path, **kw) == []
