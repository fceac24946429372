import pytest
import torch

from tools.distill.cli import build_drafter
from tools.distill.loss import distill_loss
from tools.distill.train import (
    TrainConfig, _ckpts, batch_loss, collate, loss_vocab, lr_at, make_optimizer, student_states, train,
)
from tests.distill.conftest import make_samples

KINDS = ["eagle", "draft_model"]


@pytest.mark.parametrize("sub_vocab", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_one_step_lowers_the_loss(kind, sub_vocab, target):
    drafter = build_drafter(kind, target, 1, seed=0)
    before, after = _one_step(kind, drafter, target, sub_vocab)
    assert after < before
    assert not target.model.embed_tokens.weight.requires_grad


def _one_step(kind, drafter, target, sub_vocab=False) -> tuple[float, float]:
    """The batch loss of the test samples before and after one optimizer step."""
    cfg = TrainConfig(kind=kind, lr=3e-3, unroll=2)
    samples = make_samples(target)
    vocab = loss_vocab(target, samples) if sub_vocab else None
    batch = collate(samples, max_len=64)
    opt = make_optimizer(cfg, drafter)
    before, _ = batch_loss(cfg, drafter, target, batch, vocab)
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after, _ = batch_loss(cfg, drafter, target, batch, vocab)
    return float(before.detach()), float(after)


def test_loss_vocab_is_the_samples_tokens_plus_eos(target):
    samples = make_samples(target)
    v = loss_vocab(target, samples, eos_id=2)
    used = torch.unique(torch.cat([s["ids"] for s in samples]))
    assert torch.equal(v.ids, torch.unique(torch.cat([used, torch.tensor([2])])))
    assert v.weight.shape == (len(v.ids), 64) and torch.equal(v.weight, target.lm_head.weight[v.ids])
    assert torch.equal(v.index[v.ids], torch.arange(len(v.ids)))
    assert int((v.index >= 0).sum()) == len(v.ids) < 256
    full = loss_vocab(target)
    assert full.weight.data_ptr() == target.lm_head.weight.data_ptr()  # the LM head itself, not a copy
    assert torch.equal(full.ids, torch.arange(256)) and not full.weight.requires_grad


@pytest.mark.parametrize("kind", KINDS)
def test_sub_vocab_of_every_token_gives_the_full_vocab_loss(kind, target):
    cfg = TrainConfig(kind=kind, unroll=2)
    drafter = build_drafter(kind, target, 1, seed=0)
    batch = collate(make_samples(target), max_len=64)
    every = loss_vocab(target, [{"ids": torch.arange(256)}])  # a copied [V, H] table, not the LM head itself
    assert every.weight.data_ptr() != target.lm_head.weight.data_ptr()
    full, full_stats = batch_loss(cfg, drafter, target, batch)
    sub, sub_stats = batch_loss(cfg, drafter, target, batch, every)
    assert torch.allclose(sub, full, rtol=1e-5, atol=1e-6)
    assert abs(sub_stats["kl"] - full_stats["kl"]) < 1e-5 and abs(sub_stats["ce"] - full_stats["ce"]) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_sub_vocab_logits_are_the_full_logits_at_its_tokens(kind, target):
    cfg = TrainConfig(kind=kind, unroll=2)
    drafter = build_drafter(kind, target, 1, seed=0)
    samples = make_samples(target)
    batch = collate(samples, max_len=64)
    v = loss_vocab(target, samples)
    with torch.no_grad():
        states = student_states(cfg, drafter, target, batch["ids"], batch["feats"])
        assert [j for j, _ in states] == ([0] if kind == "draft_model" else [1, 2])
        for j, o in states:
            full = drafter(input_ids=batch["ids"], use_cache=False).logits if kind == "draft_model" else target.lm_head(o)
            assert torch.allclose(v.logits(o), full[..., v.ids], rtol=1e-5, atol=1e-5)
        # the loss is the full-vocabulary one with both distributions renormalised over V'
        if kind == "draft_model":
            sup = batch["sup"]
            logits = drafter(input_ids=batch["ids"], use_cache=False).logits[sup][:, v.ids]
            teacher = target.lm_head(batch["feats"][sup])[:, v.ids]
            want, _, _ = distill_loss(logits, teacher, v.index[batch["next_ids"][sup]], cfg.ce_weight)
            got, _ = batch_loss(cfg, drafter, target, batch, v)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_collate_supervises_only_generated_tokens(target):
    b = collate(make_samples(target, n=2, T=10, prompt_len=4), max_len=64)
    assert b["sup"][0].tolist() == [False] * 3 + [True] * 6 + [False]
    assert torch.equal(b["next_ids"][0, :9], b["ids"][0, 1:])
    # a long prompt keeps its last `context` tokens and the whole continuation
    s = make_samples(target, n=1, T=40, prompt_len=30)[0]
    b = collate([s], max_len=16, context=4)
    assert torch.equal(b["ids"][0], s["ids"][24:40])  # 16 tokens: the end of the prompt + all 10 generated
    assert b["sup"][0].tolist() == [False] * 5 + [True] * 10 + [False]
    b = collate([s], max_len=64, context=4)  # room enough: nothing is cut
    assert torch.equal(b["ids"][0], s["ids"]) and int(b["sup"].sum()) == 10


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) < lr_at(9, cfg) == 1.0
    assert abs(lr_at(100, cfg) - 0.1) < 1e-9 and lr_at(50, cfg) < 1.0
    # a time budget half spent at a tenth of the steps: the schedule follows the time
    assert abs(lr_at(19, cfg, time_frac=0.5) - lr_at(55, cfg)) < 1e-9
    assert abs(lr_at(19, cfg, time_frac=1.0) - 0.1) < 1e-9 and lr_at(5, cfg, time_frac=0.9) == lr_at(5, cfg)


@pytest.mark.parametrize("sub_vocab", [False, True])
def test_resume_from_checkpoint_gives_identical_state(sub_vocab, target, tmp_path):
    samples = make_samples(target)
    cfg = TrainConfig(kind="eagle", steps=4, ckpt_every=2, keep_ckpts=2, batch_seqs=2, lr=1e-3, unroll=2, log_every=1,
                      sub_vocab=sub_vocab)
    straight = build_drafter("eagle", target, 1, seed=0)
    torch.manual_seed(123)
    assert train(cfg, straight, target, samples, tmp_path / "a", log_fn=lambda s: None) == 4
    ck = _ckpts(tmp_path / "a")
    assert [p.name for p in ck] == ["step-000002.pt", "step-000004.pt"]
    ck[-1].unlink()  # as if the run had stopped after step 2
    resumed = build_drafter("eagle", target, 1, seed=0)
    lines = []
    assert train(cfg, resumed, target, samples, tmp_path / "a", resume=True, log_fn=lines.append) == 4
    n = len(torch.unique(torch.cat([s["ids"] for s in samples])))
    head = [f"train: sub-vocabulary of {n} tokens (of 256)"] if sub_vocab else []
    assert lines[: len(head) + 1] == head + ["train: resumed from step 2"]
    assert any(line.startswith("step 4/4 loss") and "tok/s" in line and "eta" in line for line in lines)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    # a fresh (not resumed) run in the same directory starts over and drops the old checkpoints
    cfg.steps = 2
    train(cfg, build_drafter("eagle", target, 1, seed=0), target, samples, tmp_path / "a", log_fn=lambda s: None)
    assert [p.name for p in _ckpts(tmp_path / "a")] == ["step-000002.pt"]


def test_time_budget_stops_and_checkpoints(target, tmp_path):
    cfg = TrainConfig(kind="draft_model", steps=1000, time_budget_s=0.0, batch_seqs=2)
    d = build_drafter("draft_model", target, 1, seed=0)
    lines = []
    assert train(cfg, d, target, make_samples(target), tmp_path, log_fn=lines.append) == 0
    assert lines[0].startswith("train: sub-vocabulary of ")  # the default
    assert "time budget" in lines[1] and _ckpts(tmp_path)


def test_collate_can_supervise_the_kept_prompt(target):
    s = make_samples(target, n=1, T=40, prompt_len=30)[0]
    b = collate([s], max_len=16, context=4, supervise_prompt=True)
    assert b["sup"][0].tolist() == [True] * 15 + [False]  # every kept position but the last
    b = collate([s], max_len=64, context=4, supervise_prompt=True)
    assert int(b["sup"].sum()) == 39


def test_feature_noise_and_validation_hook(target, tmp_path):
    """Noise changes the update (same seed, same draws otherwise); the validation hook runs every
    val_every steps with the drafter in eval mode, and its line is logged."""
    samples = make_samples(target)
    states, lines, modes = [], [], []
    for noise in (0.0, 0.5):
        cfg = TrainConfig(kind="eagle", steps=4, batch_seqs=2, lr=1e-3, unroll=2, feat_noise=noise, val_every=2,
                          ckpt_every=100)
        d = build_drafter("eagle", target, 1, seed=0)

        def validate(d=d):
            modes.append(d.training)
            return "ok"

        train(cfg, d, target, samples, tmp_path / str(noise), log_fn=lines.append, validate=validate)
        states.append(d.state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(states[0].values(), states[1].values()))
    assert [line for line in lines if line.startswith("val")] == ["val step 2: ok", "val step 4: ok"] * 2
    assert modes == [False] * 4


def test_freeze_copied_trains_only_fc_outputs_and_norm(target):
    from tools.distill.eagle import COPIED

    drafter = build_drafter("eagle", target, 1, seed=0, freeze_copied=True)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight",
                         "layers.0.post_attention_layernorm.weight"}
    frozen = {n: p.detach().clone() for n, p in drafter.named_parameters() if not p.requires_grad}
    assert {n.removeprefix("layers.0.") for n in frozen} == set(COPIED)
    before, after = _one_step("eagle", drafter, target)
    assert after < before  # still learns
    assert all(torch.equal(p, frozen[n]) for n, p in drafter.named_parameters() if n in frozen)
    with pytest.raises(SystemExit):
        build_drafter("draft_model", target, 1, seed=0, freeze_copied=True)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_training_lowers_the_loss_and_keeps_fp32_weights(kind, target, tmp_path):
    """--bf16: the drafter's forward runs under bfloat16 autocast (the loss is ~ the fp32 one), the
    weights and optimizer stay fp32, and a few steps of `train` lower the fp32 loss."""
    drafter = build_drafter(kind, target, 1, seed=0)
    samples = make_samples(target)
    cfg = TrainConfig(kind=kind, lr=3e-3, unroll=2, steps=8, warmup=1, batch_seqs=6, max_len=64, bf16=True)
    batch = collate(samples, max_len=64)
    with torch.no_grad():
        fp32, _ = batch_loss(cfg, drafter, target, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half, _ = batch_loss(cfg, drafter, target, batch)
    assert float(half) == pytest.approx(float(fp32), rel=0.05) and float(half) != float(fp32)
    train(cfg, drafter, target, samples, tmp_path, log_fn=lambda m: None)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    with torch.no_grad():
        after, _ = batch_loss(cfg, drafter, target, batch)
    assert float(after) < float(fp32)
