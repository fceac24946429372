"""The drafter wire's pure checks: what a request may carry (drafter side), what a reply may carry
(target side), the limits a drafter announces, and how a target keeps its calls inside them."""

from __future__ import annotations

import copy

import pytest

from cluster.engine.draft_limits import BadFrame, WireLimits, parse_reply, parse_request, token_ids
from cluster.engine.draft_client import plan_call
from cluster.engine.remote_proposer import SeqWork

LIM = WireLimits(max_k=4, vocab_size=100, max_seq_tokens=32, max_call_tokens=40, max_seqs=3, max_evict=4,
                 max_frame_bytes=1 << 16, idle_timeout_s=60.0)
GOOD = {"client": "t", "evict": ["old"], "seqs": [["a", 0, [1, 2, 3], 4], ["b", 5, [99], 0]]}


def test_a_request_inside_the_limits_parses_to_proposes_arguments():
    assert parse_request(GOOD, LIM) == ("t", [("a", 0, [1, 2, 3], 4), ("b", 5, [99], 0)], ["old"])
    assert parse_request({"client": "t"}, LIM) == ("t", [], [])  # a ping


def _with(path, value):
    msg = copy.deepcopy(GOOD)
    *head, last = path
    target = msg
    for p in head:
        target = target[p]
    target[last] = value
    return msg


@pytest.mark.parametrize("msg, field", [
    (["not", "a", "map"], "request"),
    ({**GOOD, "extra": 1}, "unknown fields"),
    ({k: v for k, v in GOOD.items() if k != "client"}, "client"),
    (_with(["client"], "c" * 65), "client"),
    (_with(["client"], 7), "client"),
    (_with(["seqs"], [["s", 0, [1], 1]] * 4), "seqs: 4 entries, more than 3"),
    (_with(["seqs"], {"a": 1}), "seqs: not a list"),
    (_with(["seqs", 0], ["a", 0, [1]]), "seqs[0]: not [seq_id"),
    (_with(["seqs", 0, 0], ""), "seqs[0].seq_id"),
    (_with(["seqs", 0, 0], "x" * 257), "seqs[0].seq_id"),
    (_with(["seqs", 1, 0], "a"), "seqs[1].seq_id: repeated"),
    (_with(["seqs", 0, 1], -1), "seqs[0].start"),
    (_with(["seqs", 0, 1], 33), "seqs[0].start"),
    (_with(["seqs", 0, 1], float("nan")), "seqs[0].start: not an integer"),
    (_with(["seqs", 0, 1], 1.0), "seqs[0].start: not an integer"),
    (_with(["seqs", 0, 1], True), "seqs[0].start: not an integer"),
    (_with(["seqs", 0, 2], [1, 100]), "seqs[0].tokens[1]: not a token id in [0, 100)"),
    (_with(["seqs", 0, 2], [-1]), "seqs[0].tokens[0]"),
    (_with(["seqs", 0, 2], [1, float("nan")]), "seqs[0].tokens[1]"),
    (_with(["seqs", 0, 2], [float("inf")]), "seqs[0].tokens[0]"),
    (_with(["seqs", 0, 2], [1.0]), "seqs[0].tokens[0]"),
    (_with(["seqs", 0, 2], [False]), "seqs[0].tokens[0]"),
    (_with(["seqs", 0, 2], [1 << 70]), "seqs[0].tokens[0]"),
    (_with(["seqs", 0, 2], "abc"), "seqs[0].tokens: not a list"),
    (_with(["seqs", 1, 2], [1] * 28), "seqs[1].tokens: 28 entries, more than 27"),  # start 5 + 28 > 32
    (_with(["seqs"], [["a", 0, [1] * 30, 1], ["b", 0, [1] * 11, 1]]), "more than 40 tokens in the call"),
    (_with(["seqs", 0, 3], 5), "seqs[0].k: outside [0, 4]"),
    (_with(["seqs", 0, 3], -1), "seqs[0].k"),
    (_with(["seqs", 0, 3], 2.5), "seqs[0].k: not an integer"),
    (_with(["evict"], ["e"] * 5), "evict: 5 entries, more than 4"),
    (_with(["evict"], [3]), "evict[0]: not a string"),
])
def test_a_request_outside_the_limits_is_refused_naming_the_field(msg, field):
    with pytest.raises(BadFrame) as e:
        parse_request(msg, LIM)
    assert field in str(e.value)


def test_a_refusal_does_not_echo_the_peers_data():
    with pytest.raises(BadFrame) as e:
        parse_request(_with(["seqs", 0, 2], ["<script>" * 10]), LIM)
    assert "script" not in str(e.value)


def test_token_ids_accepts_the_vocabularys_edges():
    assert token_ids([0, 99], 2, 100, "t") == [0, 99]
    assert token_ids([], 0, 100, "t") == []


REPLY = {"drafts": [[1, 2], []], "resync": [-1, 3], "compute_s": 0.001}


def test_a_reply_inside_the_contract_parses():
    assert parse_reply(REPLY, ks=[2, 2], lengths=[5, 7], vocab_size=100) == ([[1, 2], []], [-1, 3], 0.001)


@pytest.mark.parametrize("reply, field", [
    ("garbage", "not a map"),
    ({"error": "bad request: seqs[0].k"}, "drafter refused the call: bad request"),
    ({**REPLY, "drafts": [[1, 2]]}, "1 drafts and 2 resyncs for 2 sequences"),
    ({**REPLY, "drafts": [[1, 2], [], []]}, "drafts: 3 entries"),
    ({**REPLY, "drafts": [[1, 2, 3], []]}, "drafts[0]: 3 entries, more than 2"),  # more than K
    ({**REPLY, "drafts": [[1, 100], []]}, "drafts[0][1]: not a token id"),  # past the vocabulary
    ({**REPLY, "drafts": [[-5], []]}, "drafts[0][0]"),
    ({**REPLY, "drafts": [[1.5], []]}, "drafts[0][0]"),
    ({**REPLY, "resync": [-1, 8]}, "resync[1]: outside [-1, 7]"),
    ({**REPLY, "resync": [-2, 3]}, "resync[0]"),
    ({**REPLY, "resync": None}, "resync: not a list"),
    ({**REPLY, "compute_s": float("nan")}, "compute_s"),
    ({**REPLY, "compute_s": float("inf")}, "compute_s"),
    ({**REPLY, "compute_s": -1.0}, "compute_s"),
    ({k: v for k, v in REPLY.items() if k != "compute_s"}, "compute_s"),
])
def test_a_malformed_reply_is_refused(reply, field):
    with pytest.raises(BadFrame) as e:
        parse_reply(reply, ks=[2, 2], lengths=[5, 7], vocab_size=100)
    assert field in str(e.value)


def test_limits_round_trip_and_bad_announcements_are_refused():
    assert WireLimits.from_wire(LIM.to_wire()) == LIM
    for name, bad in [("max_k", -1), ("vocab_size", "97"), ("idle_timeout_s", float("nan")), ("idle_timeout_s", 0),
                      ("max_seqs", 1 << 40), ("max_frame_bytes", None)]:
        with pytest.raises(BadFrame, match=f"limits.{name}"):
            WireLimits.from_wire({**LIM.to_wire(), name: bad})
    with pytest.raises(BadFrame):
        WireLimits.from_wire([1, 2])


def test_plan_call_keeps_a_call_inside_the_drafters_limits():
    sent, evict = {"long": 3, "b": 2}, {"gone"}
    todo = list(enumerate([
        SeqWork("a", [1, 2, 3], 9),  # K capped at 4
        SeqWork("long", list(range(33)), 2),  # past max_seq_tokens: not sent, and the drafter forgets it
        SeqWork("b", [1, 2, 150, 4], 2),  # a new token outside the drafter's vocabulary: not sent
        SeqWork("x" * 257, [1], 1),  # an id past max_id_chars: not sent
        SeqWork("c", [5] * 30, 1),  # 3 + 30 tokens of the call's 40
        SeqWork("d", [6] * 10, 1),  # 33 + 10 > 40: waits for the next step
        SeqWork("e", [7], 1),  # the call's third sequence (max_seqs)
        SeqWork("f", [8], 1),  # a fourth: waits
    ]))
    calls, seqs, ev = plan_call(todo, sent, evict, LIM)
    assert seqs == [["a", 0, [1, 2, 3], 4], ["c", 0, [5] * 30, 1], ["e", 0, [7], 1]]
    assert [(i, start, k) for i, _, start, k in calls] == [(0, 0, 4), (4, 0, 1), (6, 0, 1)]
    assert ev == ["gone", "long"] and "long" not in sent and sent["b"] == 2


def test_plan_call_keeps_the_frame_under_the_drafters_bound():
    lim = WireLimits(**{**LIM.to_wire(), "max_call_tokens": 10_000, "max_seq_tokens": 10_000, "max_seqs": 100,
                        "max_frame_bytes": 4096})
    todo = list(enumerate(SeqWork(f"s{i}", [99] * 200, 1) for i in range(10)))  # ~1 KB each
    _, seqs, _ = plan_call(todo, {}, set(), lim)
    assert 0 < len(seqs) < 10
    from cluster.engine.draft_wire import TAG_BYTES, pack
    assert len(pack({"client": "x" * 64, "evict": [], "seqs": seqs})) + TAG_BYTES <= 4096


def test_plan_call_sends_at_most_max_evict_finished_ids():
    evict = {f"s{i}" for i in range(10)}
    _, _, ev = plan_call([(0, SeqWork("a", [1], 1))], {}, evict, LIM)
    assert len(ev) == LIM.max_evict and len(evict) == 10  # the rest go with later calls
