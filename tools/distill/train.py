"""The distillation loop: AdamW, warmup + cosine LR, gradient clipping, a time budget, checkpoints
(model + optimizer + step + RNG) every N steps, and resume from the latest.

Contract: `train(cfg, drafter, target, samples, out_dir)` trains the drafter's own tensors in place
(the target stays frozen and lends its embeddings / LM head) and returns the last step reached;
running it again with `resume=True` continues exactly where the last checkpoint left off.

With `cfg.sub_vocab` the loss is over the sub-vocabulary V' of the tokens the training samples use
(the target's distribution renormalised over V'): the LM head, which dominates a step over SmolLM2's
49,152 tokens, shrinks to V' rows. Evaluation stays over the full vocabulary.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tools.distill.draft_model import unique_state
from tools.distill.loss import distill_loss


@dataclass
class TrainConfig:
    kind: str = "eagle"  # eagle | draft_model
    steps: int = 1500  # length of the LR schedule (the time budget may stop earlier)
    lr: float = 2e-4  # 1e-3 diverged on SmolLM2 (its features reach |f| ~ 33 against embeddings of rms 0.14)
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_seqs: int = 4
    max_len: int = 384  # tokens per sequence (prompt + continuation), longer ones are cut
    unroll: int = 3  # eagle: draft steps trained per round (training-time test, as vLLM drafts)
    step_decay: float = 0.8  # eagle: weight of draft step j is step_decay**(j-1)
    ce_weight: float = 0.1
    ckpt_every: int = 100
    keep_ckpts: int = 2
    time_budget_s: Optional[float] = None
    log_every: int = 10
    seed: int = 0
    sub_vocab: bool = True  # loss over the training samples' tokens only (else all V)
    # Against memorising a small corpus (a head reached acceptance length 2.8 on its training text, 1.3 held out):
    context: int = 64  # prompt tokens kept before the continuation (the window's left edge)
    supervise_prompt: bool = False  # also distil on the kept prompt positions (free: features exist)
    feat_noise: float = 0.0  # eagle: uniform noise on the input features, times their RMS (EAGLE-1: data noise)
    val_every: int = 0  # held-back training sequences scored every N steps (0: never)
    bf16: bool = False  # the drafter's forward under bfloat16 autocast (~2.6x faster on AVX512-BF16; the
    # weights, optimizer and the target's logits stay fp32)


def lr_at(step: int, cfg: TrainConfig, time_frac: float = 0.0) -> float:
    """Warmup, then cosine to min_lr_ratio. The cosine's progress is the further of the steps done
    and `time_frac` (the share of the time budget spent), so a run that the budget stops early still
    ends annealed, whatever a step costs for this drafter form."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(1.0, max((step - cfg.warmup) / max(1, cfg.steps - cfg.warmup), time_frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def collate(samples: list[dict], max_len: int, context: int = 64, supervise_prompt: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded batch: ids [B, T], next_ids [B, T] (x_{p+1}), feats [B, T, H] fp32,
    sup [B, T] bool (position p predicts a generated token x_{p+1}; with supervise_prompt also the
    kept prompt positions). Long prompts are cut from the left (the features were computed on the
    whole text, so they stay exact)."""
    T = min(max_len, max(len(s["ids"]) for s in samples))
    B, H = len(samples), samples[0]["feats"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    nxt = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, H)
    sup = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        # a window of at most T tokens: the prompt's last `context` tokens, then the continuation
        start = max(0, min(s["prompt_len"] - context, len(s["ids"]) - T))
        seq, f = s["ids"][start : start + T], s["feats"][start : start + T]
        n = len(seq)
        ids[b, :n] = seq
        nxt[b, : n - 1] = seq[1:]
        feats[b, :n] = f.float()
        sup[b, 0 if supervise_prompt else max(s["prompt_len"] - start - 1, 0) : n - 1] = True
    return {"ids": ids, "next_ids": nxt, "feats": feats, "sup": sup}


@dataclass
class LossVocab:
    """The tokens the loss is over: `ids` [V'] sorted, the target's LM head rows for them, and
    `index` [V] giving a token id's row (-1 outside V')."""

    ids: torch.Tensor  # [V'] long
    weight: torch.Tensor  # [V', H]
    bias: Optional[torch.Tensor]  # [V'] or None
    index: torch.Tensor  # [V] long

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] final-norm hidden states -> [..., V'] logits over these tokens."""
        return F.linear(x, self.weight, self.bias)


def loss_vocab(target, samples: Optional[list[dict]] = None, eos_id: Optional[int] = None) -> LossVocab:
    """The full vocabulary (samples None), or the sorted unique tokens of the samples' `ids` (+ eos)."""
    lm = target.lm_head
    V = lm.weight.shape[0]
    if samples is None:
        ids = torch.arange(V)
    else:
        extra = [torch.tensor([eos_id])] if eos_id is not None else []
        ids = torch.unique(torch.cat([s["ids"] for s in samples] + extra))  # [V'] sorted
    with torch.no_grad():
        weight = lm.weight if samples is None else lm.weight[ids]  # [V', H]: the full table is not copied
        bias = None if lm.bias is None else lm.bias[ids]  # [V']
    index = torch.full((V,), -1, dtype=torch.long)  # [V]
    index[ids] = torch.arange(len(ids))
    return LossVocab(ids, weight.detach(), bias, index)


def student_states(cfg: TrainConfig, drafter, target, ids: torch.Tensor, feats: torch.Tensor) -> list:
    """-> [(j, o)]: the drafter's final hidden states o [B, T, H], where o[:, t] predicts x_{t+j+1}
    like the target's L_{t+j}. draft_model: j = 0 (its own next token, after its final norm);
    eagle: draft steps j = 1..unroll."""
    if cfg.kind == "draft_model":
        return [(0, drafter.model(input_ids=ids, use_cache=False).last_hidden_state)]  # 1 x [B, T, H]
    outs = drafter.unroll(target.model.embed_tokens, ids, feats, cfg.unroll)  # unroll x [B, T, H]
    return list(enumerate(outs, start=1))


def batch_loss(
    cfg: TrainConfig, drafter, target, batch: dict, vocab: Optional[LossVocab] = None,
) -> tuple[torch.Tensor, dict]:
    """Distillation loss over `vocab` (default: the full vocabulary); eagle's draft step j weighs
    step_decay**(j-1)."""
    vocab = vocab if vocab is not None else loss_vocab(target)
    ids, feats, sup = batch["ids"], batch["feats"], batch["sup"]
    nxt = vocab.index[batch["next_ids"]]  # [B, T]: rows in V' (-1 outside it: padding, never supervised)
    assert bool((nxt[sup] >= 0).all()), "a supervised token lies outside the loss vocabulary"
    T, total, wsum, stats = ids.shape[1], 0.0, 0.0, {"kl": 0.0, "ce": 0.0, "tokens": int(sup.sum())}
    # the target's logits at every supervised position, once for all draft steps (fp32 under autocast too)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        teacher_all = torch.log_softmax(vocab.logits(feats[sup]).float(), -1)  # [N_sup, V']
    row = torch.full(sup.shape, -1, dtype=torch.long)  # [B, T]: row of teacher_all for position p
    row[sup] = torch.arange(int(sup.sum()))
    for j, o in student_states(cfg, drafter, target, ids, feats):
        if j >= T:
            break
        m = sup[:, j:]  # [B, T-j]: o[:, t] predicts x_{t+j+1}, like L_{t+j}
        if not bool(m.any()):
            continue
        teacher = teacher_all[row[:, j:][m]]  # [N, V']
        loss, kl, ce = distill_loss(vocab.logits(o[:, : T - j][m]), teacher, nxt[:, j:][m], cfg.ce_weight)
        w = cfg.step_decay ** max(j - 1, 0)
        total, wsum = total + w * loss, wsum + w
        stats[f"kl{j}"] = float(kl)
        stats["kl"] += w * float(kl)
        stats["ce"] += w * float(ce)
    stats["kl"] /= max(wsum, 1e-9)
    stats["ce"] /= max(wsum, 1e-9)
    return total / max(wsum, 1e-9), stats


def trainable_state(cfg: TrainConfig, drafter) -> dict[str, torch.Tensor]:
    return unique_state(drafter) if cfg.kind == "draft_model" else drafter.state_dict()


def _ckpts(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "ckpt").glob("step-*.pt"))


def save_checkpoint(out_dir: Path, cfg: TrainConfig, drafter, opt, step: int, gen: torch.Generator, keep: int) -> Path:
    d = out_dir / "ckpt"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": trainable_state(cfg, drafter), "optim": opt.state_dict(),
                "gen": gen.get_state(), "torch_rng": torch.get_rng_state(), "cfg": asdict(cfg)}, tmp)
    os.replace(tmp, path)
    for old in _ckpts(out_dir)[:-keep]:
        old.unlink()
    return path


def load_latest(out_dir: Path, drafter, opt, gen: torch.Generator) -> int:
    """Restore the newest checkpoint in out_dir/ckpt; return its step (0 if none)."""
    found = _ckpts(out_dir)
    if not found:
        return 0
    ck = torch.load(found[-1], weights_only=False)
    missing, unexpected = drafter.load_state_dict(ck["model"], strict=False)
    if unexpected:
        raise RuntimeError(f"checkpoint {found[-1]} has unexpected tensors {unexpected}")
    opt.load_state_dict(ck["optim"])
    gen.set_state(ck["gen"])
    torch.set_rng_state(ck["torch_rng"])
    return int(ck["step"])


def make_optimizer(cfg: TrainConfig, drafter) -> torch.optim.Optimizer:
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def train(
    cfg: TrainConfig, drafter, target, samples: list[dict], out_dir: Path, *, resume: bool = False,
    eos_id: Optional[int] = None, log_fn: Callable[[str], None] = print,
    validate: Optional[Callable[[], str]] = None,
) -> int:
    """`validate` (e.g. acceptance on held-back sequences) is called every cfg.val_every steps and
    its line logged, so a run shows when it starts to memorise."""
    out_dir = Path(out_dir)
    target.requires_grad_(False)
    vocab = loss_vocab(target, samples, eos_id) if cfg.sub_vocab else loss_vocab(target)
    if cfg.sub_vocab:
        log_fn(f"train: sub-vocabulary of {len(vocab.ids)} tokens (of {len(vocab.index)})")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(cfg, drafter)
    if not resume:  # a fresh run: older checkpoints would otherwise outrank (and prune) the new ones
        for old in _ckpts(out_dir):
            old.unlink()
    step = load_latest(out_dir, drafter, opt, gen) if resume else 0
    if step:
        log_fn(f"train: resumed from step {step}")
    drafter.train()
    t0, tokens, first_step = time.monotonic(), 0, step
    while step < cfg.steps:
        elapsed = time.monotonic() - t0
        if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
            log_fn(f"train: time budget {cfg.time_budget_s:.0f}s reached at step {step}")
            break
        # 1. a batch of sequences, drawn with the checkpointed generator
        idx = torch.randint(len(samples), (cfg.batch_seqs,), generator=gen).tolist()
        batch = collate([samples[i] for i in idx], cfg.max_len, cfg.context, cfg.supervise_prompt)
        if cfg.feat_noise and cfg.kind == "eagle":
            f = batch["feats"]  # [B, T, H]
            rms = f.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
            batch["feats"] = f + (torch.rand(f.shape, generator=gen) * 2 - 1) * cfg.feat_noise * rms
        # 2. loss, gradient, clipped update at this step's learning rate
        time_frac = elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0
        lr = lr_at(step, cfg, time_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, stats = batch_loss(cfg, drafter, target, batch, vocab)
        if not stats["tokens"] or not torch.is_tensor(loss):  # nothing supervised in this draw
            step += 1
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        opt.step()
        step += 1
        tokens += stats["tokens"]
        # 3. progress and checkpoints
        if step % cfg.log_every == 0 or step == cfg.steps:
            el = time.monotonic() - t0
            rate = el / max(1, step - first_step)  # seconds per step in this run
            eta = (cfg.steps - step) * rate
            if cfg.time_budget_s is not None:
                eta = min(eta, max(0.0, cfg.time_budget_s - el))
            log_fn(f"step {step}/{cfg.steps} loss {float(loss.detach()):.4f} kl {stats['kl']:.4f} ce {stats['ce']:.4f} "
                   f"gnorm {float(gnorm):.2f} lr {lr:.2e} tok/s {tokens / max(el, 1e-9):.0f} "
                   f"elapsed {el:.0f}s eta {eta:.0f}s")
        if validate is not None and cfg.val_every and step % cfg.val_every == 0:
            drafter.eval()
            log_fn(f"val step {step}: {validate()}")
            drafter.train()
        if step % cfg.ckpt_every == 0:
            save_checkpoint(out_dir, cfg, drafter, opt, step, gen, cfg.keep_ckpts)
    if not _ckpts(out_dir) or int(_ckpts(out_dir)[-1].stem.split("-")[1]) != step:
        save_checkpoint(out_dir, cfg, drafter, opt, step, gen, cfg.keep_ckpts)
    return step
