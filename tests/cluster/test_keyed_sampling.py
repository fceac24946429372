"""`cluster.engine.keyed_sampling`: a seeded request's tokens do not depend on the drafts verified.

The pure parts (`noise_key`, `keyed_token`, `verify`) here; vLLM's own rejection sampler and
top-k/top-p sampler with the hooks installed in a process of their own (as in an engine's worker);
the same seeded request through a real cluster at every K: tests/e2e/test_sampling.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from cluster.engine import keyed_sampling as ks
from tests.paths import ROOT


def test_noise_keys_differ_by_seed_and_position_and_fit_a_torch_seed():
    keys = {ks.noise_key(s, p) for s in range(-3, 30) for p in range(200)}
    assert len(keys) == 33 * 200
    assert all(0 <= k < 2**63 for k in keys)


def test_a_keyed_token_is_a_sample_of_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 8000
    freq = torch.bincount(torch.tensor([ks.keyed_token(probs, 3, j) for j in range(n)]), minlength=6).double() / n
    assert freq.tolist() == pytest.approx(probs.tolist(), abs=0.02)
    assert freq[5] == 0.0


def test_a_keyed_token_depends_on_seed_and_position_only():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), -1)
    torch.manual_seed(123)
    first = [ks.keyed_token(probs, 9, j) for j in range(50)]
    torch.manual_seed(456)  # the global generator plays no part
    assert [ks.keyed_token(probs, 9, j) for j in range(50)] == first
    assert [ks.keyed_token(probs, 10, j) for j in range(50)] != first


@pytest.mark.parametrize("trial", range(200))
def test_verify_emits_the_plain_tokens_whatever_the_drafts(trial):
    rng = random.Random(trial)
    plain = [rng.randrange(4) for _ in range(12)]
    n = rng.randrange(9)
    drafts = [t if rng.random() < 0.7 else rng.randrange(4) for t in plain[:n]]
    out = ks.verify(drafts, plain.__getitem__)
    accepted = next((j for j, (d, t) in enumerate(zip(drafts, plain)) if d != t), n)
    assert out == plain[:accepted + 1]
    assert 1 <= len(out) <= n + 1


def test_step_places_the_plain_draw_after_the_rows_drafts():
    step = ks.Step({0: (5, 100), 2: (6, 7)}, [3, 0, 2])
    assert (step.bonus_position(0), step.bonus_position(2)) == (103, 9)
    assert ks.Step({1: (5, 40)}).bonus_position(1) == 40


# vLLM's samplers with the hooks installed: one process, as in an engine's worker.
_HOOKED = """
import json, sys, torch
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
if not HAS_TRITON:
    current_platform.register_triton_kernel_overrides()
    from cluster.engine import sampling_fix
    sampling_fix.install()
import vllm._custom_ops
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
from vllm.v1.sample.metadata import SamplingMetadata
from cluster.engine import keyed_sampling as ks
ks.install(); ks.install()  # idempotent
V, T = 50, 0.8
torch.manual_seed(0)
def md(n, seeds):
    gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
    return SamplingMetadata(
        temperature=torch.full((n,), T), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=gens, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None)
# logits of one seeded request at positions 20..27 (drafts verified in one step come from these rows)
pos_logits = torch.randn(8, V) * 3
probs = (pos_logits / T).softmax(-1)
seed, base = 77, 20
plain = [ks.keyed_token(probs[j], seed, base + j) for j in range(8)]
sampler = TopKTopPSampler()
out = {"plain": plain, "rows": [], "unseeded_same": True}
# the plain draw: row 1 seeded at position base + j, row 0 not seeded
for j in range(3):
    ks._STEP = ks.Step({1: (seed, base + j)})
    logits = torch.stack([pos_logits[0] / T, pos_logits[j] / T])
    tokens, _ = sampler(logits, md(2, {1: seed}).generators, None, None)
    out["rows"].append(["plain", j, int(tokens[1])])
# verification: drafts of length n with the first wrong draft at `wrong` (None: all right)
for n, wrong in ((4, None), (4, 0), (4, 2), (7, 6), (1, None)):
    drafts = [t if j != wrong else (t + 1) % V for j, t in enumerate(plain[:n])]
    # batch: row 0 unseeded with 2 drafts, row 1 the seeded request with its n drafts
    other = torch.randn(2, V)
    target = torch.cat([other / T, pos_logits[:n] / T])
    draft_ids = torch.tensor([3, 4] + drafts, dtype=torch.int32)
    cu = torch.tensor([2, 2 + n], dtype=torch.int32)
    ks._STEP = ks.Step({1: (seed, base)}, [2, n])
    bonus_logits = torch.stack([torch.randn(V) / T, pos_logits[n] / T])
    bonus, _ = sampler(bonus_logits, md(2, {1: seed}).generators, None, None)
    m = md(2, {1: seed})
    torch.manual_seed(5)
    got = rs.rejection_sample(draft_ids, [2, n], max(n, 2), cu, None, target.clone(), bonus.view(-1, 1).to(torch.int64), m)
    ks._STEP = None
    torch.manual_seed(5)
    ref = rs.rejection_sample(draft_ids, [2, n], max(n, 2), cu, None, target.clone(), bonus.view(-1, 1).to(torch.int64), m)
    out["unseeded_same"] &= got[0].tolist() == ref[0].tolist()
    out["rows"].append(["verify", n, wrong, [t for t in got[1].tolist() if t >= 0]])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hooked() -> dict:
    run = subprocess.run([sys.executable, "-c", _HOOKED], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_vllms_plain_draw_gives_a_seeded_row_its_keyed_token(hooked):
    plain = hooked["plain"]
    for kind, j, token in (r for r in hooked["rows"] if r[0] == "plain"):
        assert token == plain[j], f"position {j}"


def test_vllms_rejection_sampler_emits_the_plain_tokens_for_any_drafts(hooked):
    plain = hooked["plain"]
    rows = [r for r in hooked["rows"] if r[0] == "verify"]
    assert len(rows) == 5
    for _, n, wrong, emitted in rows:
        accepted = n if wrong is None else wrong
        assert emitted == plain[:accepted + 1], (n, wrong)


def test_a_request_without_a_seed_keeps_vllms_sampler(hooked):
    assert hooked["unseeded_same"]
