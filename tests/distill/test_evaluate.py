import torch

from cluster.distill.draft_model import make_draft
from cluster.distill.eagle import EagleHead
from cluster.distill.evaluate import accepted_counts, draft_model_match, eagle_match, evaluate, summarize
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
