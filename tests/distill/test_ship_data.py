import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tools.bench.workload import MT_BENCH_CATEGORIES, task_of
from tools.distill import data
from tools.distill.cli import build_drafter
from tools.distill.ship import MANIFEST, assemble, ship
from tests.distill.conftest import tiny_target


@pytest.mark.parametrize("kind", ["eagle", "draft_model"])
def test_ship_then_assemble_restores_the_drafter(kind, target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    drafter = build_drafter(kind, target, 1, seed=0)
    shipped = ship(kind, drafter, target, tmp_path / "ship")
    stored = load_file(str(shipped / "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in stored.values())
    assert not any("embed_tokens" in k or "lm_head" in k for k in stored)
    full = load_file(str(assemble(shipped, tmp_path / "target", tmp_path / "full") / "model.safetensors"))
    own = drafter.state_dict()
    for k, v in full.items():
        if k == "model.embed_tokens.weight":
            assert torch.equal(v, target.model.embed_tokens.weight)
        else:
            assert torch.allclose(v, own[k].float(), atol=2e-3, rtol=1e-3), k
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert json.loads((shipped / MANIFEST).read_text())["kind"] == kind


def test_assemble_refuses_another_target(target, tmp_path):
    shipped = ship("eagle", build_drafter("eagle", target, 1, 0), target, tmp_path / "ship")
    tiny_target(seed=5).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="different target"):
        assemble(shipped, tmp_path / "other", tmp_path / "full")


TASKS = ("math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation")


def test_split_is_stratified_fixed_and_disjoint():
    recs = data.load_specbench()
    category_of = {r["turns"][0]: r["category"] for r in recs}
    tr, ev = data.split_prompts(recs, 8, seed=0)
    assert Counter(h.task for h in ev) == {t: 8 for t in TASKS}
    assert Counter(h.category for h in ev if h.task == "mt_bench") == {c: 1 for c in MT_BENCH_CATEGORIES}
    assert all(h.category == category_of[h.text] and h.task == task_of(h.category) for h in ev)
    texts = [h.text for h in ev]
    assert len(tr) == len(recs) - 48 and not set(tr) & set(texts)
    assert sorted(tr + texts) == sorted(category_of)  # nothing lost, nothing twice
    assert data.split_prompts(recs, 8, seed=0) == (tr, ev)
    assert data.split_prompts(recs, 8, seed=1) != (tr, ev)
    assert data.synthetic_instructions(5, 1) == data.synthetic_instructions(5, 1)
    many = data.synthetic_instructions(2000, 0)
    assert len(many) == len(set(many)) == 2000  # distinct: a repeat would only repeat its continuation


@pytest.mark.parametrize("n, most", [(3, 1), (12, 2), (0, 0)])
def test_split_spreads_mt_bench_over_its_categories(n, most):
    recs = data.load_specbench()
    for seed in range(3):
        tr, ev = data.split_prompts(recs, n, seed)
        per_cat = Counter(h.category for h in ev if h.task == "mt_bench")
        assert sum(per_cat.values()) == n and max(per_cat.values(), default=0) == most
        assert min(per_cat.values(), default=0) >= most - 1 and len(tr) == len(recs) - 6 * n


def test_split_refuses_more_than_a_task_has():
    with pytest.raises(ValueError, match="fewer than"):
        data.split_prompts(data.load_specbench(), 41, seed=0)


class CharTokenizer:
    """A stand-in tokenizer: one token per character, a visible chat template."""

    eos_token_id, pad_token_id = 2, 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "<" + messages[0]["content"] + ">"

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 250 for c in s]}


def test_corpus_returns_samples_in_prompt_order(target, tmp_path):
    """Batches are sorted by length inside a shard; the result must still follow the prompts."""
    prompts = ["a long first prompt", "b", "mid one", "xy", "the fifth prompt"]
    tok = CharTokenizer()
    kw = dict(max_new_tokens=3, temperature=0.0, seed=0, batch_size=2, shard_size=3, log_fn=lambda m: None)
    out = data.corpus(target, tok, prompts, tmp_path, **kw)
    assert [s["ids"][: s["prompt_len"]].tolist() for s in out] == [data.chat_ids(tok, p) for p in prompts]
    cached = data.corpus(target, tok, prompts, tmp_path, **kw)
    assert all(torch.equal(a["ids"], b["ids"]) for a, b in zip(out, cached)) and len(cached) == len(out)


def test_batched_left_padded_generation_equals_one_by_one(target):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    gen = torch.Generator().manual_seed(0)
    batched = data.generate(target, prompts, 6, 0.0, gen, eos_id=2, pad_id=0)
    single = [data.generate(target, [p], 6, 0.0, gen, eos_id=2, pad_id=0)[0] for p in prompts]
    assert batched == single
    sampled = data.generate(target, prompts, 6, 1.0, torch.Generator().manual_seed(3), eos_id=2, pad_id=0)
    assert sampled == data.generate(target, prompts, 6, 1.0, torch.Generator().manual_seed(3), eos_id=2, pad_id=0)


def test_shared_prompt_features_equal_one_by_one(target):
    """The prompt run once with its KV cache repeated per continuation gives each whole sequence's
    features (ragged continuations, an empty one included)."""
    prompt, conts = [5, 6, 7, 8, 9], [[10, 11, 12], [13], [14, 15, 16, 17, 18], []]
    shared = data.features_shared_prompt(target, prompt, conts)
    assert len(shared) == len(conts)
    for c, f in zip(conts, shared):
        assert f.shape == (len(prompt) + len(c), target.config.hidden_size)
        assert torch.allclose(f, data.features(target, torch.tensor(prompt + c)), atol=1e-5)
    assert [f.shape[0] for f in data.features_shared_prompt(target, prompt, [[], []])] == [5, 5]


def test_corpora_features_of_twin_corpora_equal_their_own(target, tmp_path):
    """A greedy corpus and a sampled twin of the same prompts (features computed together, each
    prompt once) hold exactly the features each sequence has alone."""
    tok = CharTokenizer()
    specs = [data.CorpusSpec(("ab", "cde", "f"), 3, 0.0, 0), data.CorpusSpec(("ab", "cde", "f"), 3, 1.0, 7)]
    a, b = data.corpora(target, tok, specs, tmp_path, shard_size=2, log_fn=lambda m: None)
    assert len(a) == len(b) == 3
    for s in a + b:
        assert torch.allclose(s["feats"].float(), data.features(target, s["ids"]), atol=1e-2)
        assert s["ids"][: s["prompt_len"]].tolist() in [data.chat_ids(tok, p) for p in ("ab", "cde", "f")]


def test_corpora_one_call_for_every_spec_and_engine_in_the_key(target, tmp_path, monkeypatch):
    """engine vllm: every missing continuation of every spec goes to ONE generation call (one engine
    start), prompt-major (a prompt's jobs adjacent), each sampled job with its own seed; cached shards are not asked
    again; the engine is part of the cache key (the transformers corpus is a different one)."""
    from tools.distill import vllm_gen

    calls = []

    def fake_generate(model_path, jobs, max_model_len, log_fn=print):
        calls.append(jobs)
        return [[7, 8, 2][: 1 + j["max_new_tokens"] % 3] for j in jobs]

    monkeypatch.setattr(vllm_gen, "generate_vllm", fake_generate)
    tok = CharTokenizer()
    specs = [data.CorpusSpec(("ab", "cde", "f"), 2, 0.0, 0), data.CorpusSpec(("gh",), 4, 0.8, 5)]
    kw = dict(engine="vllm", model_path="/m", shard_size=2, log_fn=lambda m: None)
    a, b = data.corpora(target, tok, specs, tmp_path, **kw)
    asked = sorted(zip((j["prompt_ids"] for j in calls[0]), (j["temperature"] for j in calls[0])))
    assert len(calls) == 1 and asked == sorted([(data.chat_ids(tok, p), 0.0) for p in ("ab", "cde", "f")]
                                               + [(data.chat_ids(tok, "gh"), 0.8)])
    assert len({j["seed"] for j in calls[0]}) == 4
    assert [s["ids"][s["prompt_len"]:].tolist() for s in a] == [[7, 8, 2]] * 3 and len(b) == 1
    assert a[1]["feats"].shape == (len(a[1]["ids"]), target.config.hidden_size)
    again = data.corpora(target, tok, specs, tmp_path, **kw)  # all cached: no call
    assert len(calls) == 1 and all(torch.equal(x["ids"], y["ids"]) for x, y in zip(again[0], a))
    data.corpus(target, tok, ["ab"], tmp_path, max_new_tokens=2, temperature=0.0, seed=0, log_fn=lambda m: None)
    assert len(list(tmp_path.glob("corpus-*"))) == 3  # the transformers corpus is its own
    with pytest.raises(ValueError, match="model_path"):
        data.corpora(target, tok, specs, tmp_path, engine="vllm")
    with pytest.raises(ValueError, match="engine"):
        data.corpora(target, tok, specs, tmp_path, engine="tgi")


def test_corpora_vllm_jobs_prompt_major_and_mapped_back(target, tmp_path, monkeypatch):
    """Twin corpora's jobs reach the engine with each prompt's jobs adjacent (its prefill shared in
    the prefix cache), and every continuation comes back to its own corpus and prompt."""
    from tools.distill import vllm_gen

    calls = []

    def fake_generate(model_path, jobs, max_model_len, log_fn=print):
        calls.append(jobs)
        return [[3 + len(j["prompt_ids"]) % 50, 4 if j["temperature"] else 5] for j in jobs]

    monkeypatch.setattr(vllm_gen, "generate_vllm", fake_generate)
    tok = CharTokenizer()
    prompts = ("ab", "cdefg", "h")
    specs = [data.CorpusSpec(prompts, 2, 0.0, 0), data.CorpusSpec(prompts, 2, 0.8, 1)]
    greedy, sampled = data.corpora(target, tok, specs, tmp_path, engine="vllm", model_path="/m", shard_size=2,
                                   log_fn=lambda m: None)
    asked = [j["prompt_ids"] for j in calls[0]]
    assert all(asked[k] == asked[k + 1] for k in range(0, len(asked), 2))
    for part, last in ((greedy, 5), (sampled, 4)):
        for s, p in zip(part, prompts):
            assert s["ids"].tolist() == data.chat_ids(tok, p) + [3 + len(data.chat_ids(tok, p)) % 50, last]


def test_cap_prompts_drops_long_ones():
    tok = CharTokenizer()
    assert data.cap_prompts(tok, ["abc", "abcdefgh", "a"], 5) == (["abc", "a"], 1)
    assert data.cap_prompts(tok, ["abcdefgh"], None) == (["abcdefgh"], 0)


def test_vllm_sampling_kwargs():
    from tools.distill.vllm_gen import sampling_kwargs

    greedy = sampling_kwargs({"max_new_tokens": 9, "temperature": 0.0, "seed": 3})
    assert greedy["max_tokens"] == 9 and greedy["temperature"] == 0.0 and "seed" not in greedy
    sampled = sampling_kwargs({"max_new_tokens": 9, "temperature": 0.8, "seed": 3})
    assert sampled["seed"] == 3 and sampled["temperature"] == 0.8 and not sampled["ignore_eos"]


def test_training_budget():
    from tools.distill.cli import training_budget

    assert training_budget(None, None, 50, 300) is None
    assert training_budget(100, None, 50, 300) == 100
    assert training_budget(None, 3600, 600, 300) == 2700
    assert training_budget(1000, 3600, 600, 300) == 1000
    assert training_budget(None, 100, 200, 300) == 0.0


def test_heldout_jsonl_is_what_the_bench_reads(tmp_path):
    from tools.bench.workload import load_prompts

    _, held = data.split_prompts(data.load_specbench(), 2, seed=0)
    path = data.write_heldout(tmp_path / "h.jsonl", held)
    lines = path.read_text().splitlines()
    assert len(lines) == len(held) == 12
    back = load_prompts(path)
    assert [(p.text, p.category, p.task) for p in back] == [(h.text, h.category, h.task) for h in held]


def test_hold_back_removes_a_validation_prompt_from_every_corpus():
    greedy = [{"p": i, "kind": "g"} for i in range(10)]
    sampled = [{"p": i, "kind": "s"} for i in range(10)]
    train, val = data.hold_back([greedy, sampled], 3)
    assert [v["p"] for v in val] == [0, 3, 6] and all(v["kind"] == "g" for v in val)
    assert sorted({s["p"] for s in train}) == [1, 2, 4, 5, 7, 8, 9]
    assert len(train) == 14  # both corpora's samples of the 7 training prompts
    all_train, none = data.hold_back([greedy, sampled], 0)
    assert len(all_train) == 20 and none == []


def test_vllm_failure_tail_shows_both_streams():
    from tools.distill.vllm_gen import failure_tail

    out = failure_tail("a\nb\nc", "x\nRuntimeError: boom", n=2)
    assert "child stdout (last 2 lines)" in out and "b\nc" in out and "a" not in out.split("---")[2]
    assert "RuntimeError: boom" in out
    assert failure_tail("", None) == "(the child wrote nothing)"


def test_bf16_corpus_is_its_own_engine_dtype_and_cache(target, tmp_path, monkeypatch):
    """A bf16 training corpus and a float32 one of the same prompts: two generation calls (one
    engine per dtype, bfloat16 asked for the bf16 one), two cache entries, and bf16 features close
    to (but not) the float32 ones."""
    from tools.distill import vllm_gen

    calls = []

    def fake_generate(model_path, jobs, max_model_len, log_fn=print, dtype="float32"):
        calls.append((dtype, len(jobs)))
        return [[7, 8, 9] for _ in jobs]

    monkeypatch.setattr(vllm_gen, "generate_vllm", fake_generate)
    tok = CharTokenizer()
    specs = [data.CorpusSpec(("abc", "de"), 3, 0.0, 0), data.CorpusSpec(("abc", "de"), 3, 0.0, 0, bf16=True)]
    fp, bf = data.corpora(target, tok, specs, tmp_path, engine="vllm", model_path="/m", log_fn=lambda m: None)
    assert sorted(calls) == [("bfloat16", 2), ("float32", 2)]
    assert len(list(tmp_path.glob("corpus-*"))) == 2
    for a, b in zip(fp, bf):
        assert torch.equal(a["ids"], b["ids"]) and not torch.equal(a["feats"], b["feats"])
        rel = (a["feats"].float() - b["feats"].float()).norm() / a["feats"].float().norm()
        assert float(rel) < 0.05
