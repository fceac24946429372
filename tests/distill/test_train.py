import torch

from cluster.distill.cli import build_drafter
from cluster.distill.train import TrainConfig, _ckpts, batch_loss, collate, lr_at, make_optimizer, train
from tests.distill.conftest import make_samples


def _one_step_lowers(kind, target):
    cfg = TrainConfig(kind=kind, lr=3e-3, unroll=2)
    drafter = build_drafter(kind, target, 1, seed=0)
    batch = collate(make_samples(target), max_len=64)
    opt = make_optimizer(cfg, drafter)
    before, _ = batch_loss(cfg, drafter, target, batch)
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after, _ = batch_loss(cfg, drafter, target, batch)
    assert float(after) < float(before.detach())


def test_one_step_lowers_the_loss_eagle(target):
    _one_step_lowers("eagle", target)


def test_one_step_lowers_the_loss_draft_model(target):
    _one_step_lowers("draft_model", target)
    assert not target.model.embed_tokens.weight.requires_grad


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


def test_resume_from_checkpoint_gives_identical_state(target, tmp_path):
    samples = make_samples(target)
    cfg = TrainConfig(kind="eagle", steps=4, ckpt_every=2, keep_ckpts=2, batch_seqs=2, lr=1e-3, unroll=2, log_every=1)
    straight = build_drafter("eagle", target, 1, seed=0)
    torch.manual_seed(123)
    assert train(cfg, straight, target, samples, tmp_path / "a", log_fn=lambda s: None) == 4
    ck = _ckpts(tmp_path / "a")
    assert [p.name for p in ck] == ["step-000002.pt", "step-000004.pt"]
    ck[-1].unlink()  # as if the run had stopped after step 2
    resumed = build_drafter("eagle", target, 1, seed=0)
    lines = []
    assert train(cfg, resumed, target, samples, tmp_path / "a", resume=True, log_fn=lines.append) == 4
    assert lines[0] == "train: resumed from step 2"
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
    assert "time budget" in lines[0] and _ckpts(tmp_path)
