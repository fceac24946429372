import pytest
import torch

from tools.distill.draft_model import make_draft
from tools.distill.eagle import EagleHead
from tools.distill.evaluate import (
    CHAT_LIKE_TASKS, accepted_counts, draft_model_match, eagle_match, evaluate, format_report, group_summaries,
    summarize,
)
from tests.distill.conftest import make_samples


def test_accepted_counts_stop_at_the_first_rejection():
    match = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert accepted_counts(match).tolist() == [2, 0, 4, 1]
    s = summarize(accepted_counts(match), 4)
    assert s["alpha"] == [0.75, 0.5, 0.25, 0.25]
    assert s["acceptance_length"][1] == 1.75  # min(a, 1) = [1, 0, 1, 1]
    assert s["acceptance_length"][4] == 2.75  # (2 + 0 + 4 + 1) / 4 + 1


def test_drafter_equal_to_target_is_always_accepted(target):
    samples = make_samples(target, n=3, T=20)
    r = evaluate("draft_model", target, target, samples, k_max=6)
    assert r["alpha"] == [1.0] * 6 and r["acceptance_length"][6] == 7.0
    assert r["rounds"] == sum(len(s["ids"]) - 6 - (s["prompt_len"] - 1) for s in samples)


def test_random_drafter_is_almost_never_accepted(target):
    samples = make_samples(target, n=4, T=40)
    gen = torch.Generator().manual_seed(7)

    class Noise(torch.nn.Module):  # a drafter with random logits
        def forward(self, input_ids, use_cache=False):
            return type("O", (), {"logits": torch.randn(*input_ids.shape, 256, generator=gen)})()

    r = evaluate("draft_model", Noise(), target, samples, k_max=3)
    assert r["alpha"][0] < 0.1 and r["acceptance_length"][3] < 1.1
    head = EagleHead(target.config)
    r = evaluate("eagle", head, target, samples, k_max=3)
    assert r["alpha"][0] < 0.1


def test_known_prefix_match(target):
    """A drafter that agrees with the target exactly at chosen positions: counts follow by hand."""
    ids = make_samples(target, n=1, T=12, prompt_len=1)[0]["ids"]
    best = target(input_ids=ids[None]).logits[0].argmax(-1)  # [T]
    agree = torch.zeros(12, dtype=torch.bool)
    agree[[1, 2, 3, 6]] = True  # positions where the drafter's argmax equals the target's

    class Fake(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            wrong = (best + 1) % 256
            choice = torch.where(agree, best, wrong)
            return type("O", (), {"logits": torch.nn.functional.one_hot(choice, 256).float()[None]})()

    m = draft_model_match(Fake(), target, ids, prompt_len=1, k=3)  # starts t = 0..8, d_j at t+j
    assert accepted_counts(m).tolist() == [3, 2, 1, 0, 0, 1, 0, 0, 0]


def test_eagle_match_shape(target):
    s = make_samples(target, n=1, T=16, prompt_len=5)[0]
    m = eagle_match(EagleHead(target.config), target, s["ids"], s["prompt_len"], 4)
    assert m.shape == (16 - 4 - 4, 4) and m.dtype == torch.bool


def test_group_summaries_per_task_and_chat_like():
    match = [torch.tensor(m, dtype=torch.bool) for m in (
        [[1, 1, 0], [0, 1, 1]],  # mt_bench: 2, 0
        [[1, 1, 1]],  # rag: 3
        [[0, 0, 0], [1, 0, 1], [1, 1, 0]],  # qa: 0, 1, 2
        [[1, 1, 1], [1, 0, 0]],  # mt_bench: 3, 1
    )]
    acc = [accepted_counts(m) for m in match]
    tasks = ["mt_bench", "rag", "qa", "mt_bench"]
    r = group_summaries(acc, tasks, 3)
    assert {k: r[k] for k in ("rounds", "alpha", "acceptance_length")} == summarize(torch.cat(acc), 3)
    assert list(r["by_task"]) == ["mt_bench", "qa", "rag"]
    assert r["by_task"]["mt_bench"] == {"sequences": 2, **summarize(torch.tensor([2, 0, 3, 1]), 3)}
    assert r["by_task"]["rag"]["acceptance_length"][3] == 4.0
    assert sum(s["rounds"] for s in r["by_task"].values()) == r["rounds"] == 8
    chat = summarize(torch.cat([acc[0], acc[3], acc[2]]), 3)  # the union of mt_bench and qa
    assert r["chat_like"] == {"tasks": list(CHAT_LIKE_TASKS), "sequences": 3, **chat}
    assert r["chat_like"]["acceptance_length"][3] == round(9 / 7 + 1, 4)


def test_group_summaries_without_tasks_or_chat():
    acc = [torch.tensor([1, 2]), torch.tensor([0])]
    assert group_summaries(acc, None, 2)["by_task"] == {} and group_summaries(acc, None, 2)["chat_like"] is None
    r = group_summaries(acc, ["rag", "translation"], 2)
    assert r["chat_like"] is None and "no held-out sequences" in format_report({"kind": "eagle", **r})
    with pytest.raises(ValueError, match="3 tasks for 2 sequences"):
        group_summaries(acc, ["rag", "qa", "qa"], 2)


def test_evaluate_reports_per_task(target):
    samples = make_samples(target, n=5, T=20)
    tasks = ["qa", "rag", "mt_bench", "qa", "summarization"]
    head = EagleHead(target.config)
    r = evaluate("eagle", head, target, samples, k_max=3, tasks=tasks)
    assert sum(s["rounds"] for s in r["by_task"].values()) == r["rounds"]
    assert sum(s["sequences"] for s in r["by_task"].values()) == r["sequences"] == 5
    acc = [accepted_counts(eagle_match(head, target, s["ids"], s["prompt_len"], 3)) for s in samples]
    chat = torch.cat([a for a, t in zip(acc, tasks) if t in CHAT_LIKE_TASKS])
    assert {k: r["chat_like"][k] for k in ("rounds", "alpha", "acceptance_length")} == summarize(chat, 3)
    lines = format_report(r).splitlines()
    assert len(lines) == 1 + 4 + 1 and lines[0].startswith("eval[eagle] 5 seqs")
    assert lines[-1].lstrip().startswith("chat_like (mt_bench+qa) 3 seqs")
