import json

import pytest
import torch
from safetensors.torch import load_file

from cluster.distill import data
from cluster.distill.cli import build_drafter
from cluster.distill.ship import MANIFEST, assemble, ship
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


def test_split_is_fixed_and_disjoint():
    recs = data.load_specbench()
    tr, ev = data.split_prompts(recs, 40, seed=0)
    assert len(ev) == 40 and len(tr) == len(recs) - 40 and not set(tr) & set(ev)
    assert data.split_prompts(recs, 40, seed=0) == (tr, ev)
    assert data.synthetic_instructions(5, 1) == data.synthetic_instructions(5, 1)


def test_batched_left_padded_generation_equals_one_by_one(target):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    gen = torch.Generator().manual_seed(0)
    batched = data.generate(target, prompts, 6, 0.0, gen, eos_id=2, pad_id=0)
    single = [data.generate(target, [p], 6, 0.0, gen, eos_id=2, pad_id=0)[0] for p in prompts]
    assert batched == single
    sampled = data.generate(target, prompts, 6, 1.0, torch.Generator().manual_seed(3), eos_id=2, pad_id=0)
    assert sampled == data.generate(target, prompts, 6, 1.0, torch.Generator().manual_seed(3), eos_id=2, pad_id=0)
