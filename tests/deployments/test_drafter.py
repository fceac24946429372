"""Drafter: batched drafts with per-sequence KV caches must equal plain greedy decoding of the same
model; state is kept, rolled back, resynced and bounded. A tiny random Llama, no weights needed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deployments.drafter import DraftModel, Drafter, DraftServer  # noqa: E402
from tests.drafter_peer import SECRET, call, connect, greedy, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def test_drafts_equal_greedy_decoding_for_a_batch_of_different_lengths(hf_model):
    drafter = Drafter(DraftModel(hf_model))
    contexts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    ks = [4, 2, 3]
    drafts, resync = drafter.propose("t", [(f"s{i}", 0, c, k) for i, (c, k) in enumerate(zip(contexts, ks))], [])
    assert resync == [-1, -1, -1]
    assert drafts == [greedy(hf_model, c, k) for c, k in zip(contexts, ks)]


def test_later_steps_feed_only_new_tokens_and_roll_back_rejected_drafts(hf_model):
    drafter = Drafter(DraftModel(hf_model))
    ctx = [3, 14, 15, 92, 65, 35]
    d1, _ = drafter.propose("t", [("a", 0, ctx, 4)], [])
    assert d1[0] == greedy(hf_model, ctx, 4)
    # The target accepted the first two drafts and its bonus token differs from draft 3.
    bonus = (d1[0][2] + 1) % 97
    new = d1[0][:2] + [bonus]
    fed_before = drafter.stats.fed_tokens
    d2, resync = drafter.propose("t", [("a", len(ctx), new, 3)], [])
    assert resync == [-1]
    assert d2[0] == greedy(hf_model, ctx + new, 3)
    # Two accepted drafts were cached already: only the bonus token, then 2 drafts, are fed.
    assert drafter.stats.fed_tokens - fed_before == 1 + 2
    # No draft accepted, a different token: everything after the committed prefix is rolled back.
    d3, _ = drafter.propose("t", [("a", len(ctx) + 3, [7], 2)], [])
    assert d3[0] == greedy(hf_model, ctx + new + [7], 2)


def test_unknown_or_lost_sequences_ask_for_a_resync(hf_model):
    drafter = Drafter(DraftModel(hf_model))
    drafts, resync = drafter.propose("t", [("x", 10, [1, 2], 3)], [])
    assert drafts == [[]] and resync == [0]
    drafter.propose("t", [("y", 0, [1, 2, 3], 2)], [])
    drafts, resync = drafter.propose("t", [("y", 5, [4], 2)], [])  # a gap: positions 3..4 missing
    assert drafts == [[]] and resync == [3]
    # Same sequence id from another client is another sequence.
    drafts, resync = drafter.propose("u", [("y", 3, [4], 2)], [])
    assert resync == [0]


def test_k_zero_keeps_state_without_drafting(hf_model):
    drafter = Drafter(DraftModel(hf_model))
    drafts, _ = drafter.propose("t", [("a", 0, [1, 2, 3], 0)], [])
    assert drafts == [[]]
    drafts, resync = drafter.propose("t", [("a", 3, [4, 5], 2)], [])
    assert resync == [-1] and drafts[0] == greedy(hf_model, [1, 2, 3, 4, 5], 2)


def test_memory_is_bounded_by_eviction_lru_and_idle_ttl(hf_model):
    now = [0.0]
    drafter = Drafter(DraftModel(hf_model), max_sequences=2, idle_ttl_s=10.0, clock=lambda: now[0])
    for sid in ("a", "b", "c"):
        drafter.propose("t", [(sid, 0, [1, 2], 1)], [])
    assert drafter.stats.sequences == 2 and drafter.stats.evicted_lru == 1
    assert drafter.propose("t", [("a", 2, [3], 1)], [])[1] == [0]  # "a" was least recently used
    drafter.propose("t", [], ["c"])
    assert drafter.stats.sequences == 1
    now[0] = 11.0
    drafter.propose("t", [], [])
    assert drafter.stats.sequences == 0 and drafter.stats.evicted_idle >= 1


def test_server_answers_authenticated_requests_and_rejects_malformed_ones(hf_model):
    server = DraftServer(Drafter(DraftModel(hf_model)), "127.0.0.1", 0, secret=SECRET)
    try:
        ch, limits = connect(server)
        assert limits.vocab_size == 97 and limits.max_k == 16 and limits.max_seqs == 256
        reply = call(ch, {"client": "t", "evict": [], "seqs": [["a", 0, [5, 6, 7], 3]]})
        assert reply["drafts"] == [greedy(hf_model, [5, 6, 7], 3)] and reply["resync"] == [-1]
        assert reply["compute_s"] >= 0
        assert "client" in call(ch, {"seqs": [["a", 0, [1], 1]]})["error"]  # no client
        assert call(ch, {"client": "t", "seqs": []})["drafts"] == []  # a ping on the same connection still works
    finally:
        server.close()


def test_the_model_reports_the_ids_it_can_embed_and_score(hf_model):
    assert DraftModel(hf_model).vocab_size == 97
