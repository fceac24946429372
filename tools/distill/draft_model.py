"""A small draft model for vLLM's `draft_model` method: the target's first N decoder layers and
final norm, with the target's (tied) embeddings and LM head frozen and shared.

Contract: `make_draft(target, N)` returns a `LlamaForCausalLM` whose trainable tensors are
`model.layers.*` and `model.norm.weight` (what `ship` stores); `draft_logits` gives its logits on
teacher-forced text, from which both training and offline evaluation follow (under greedy
verification, draft step j of the round started at t is the drafter's argmax at position t+j).
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def draft_config(target_cfg: LlamaConfig, num_layers: int) -> LlamaConfig:
    if not 1 <= num_layers <= target_cfg.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{target_cfg.num_hidden_layers}, got {num_layers}")
    cfg = copy.deepcopy(target_cfg)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    if not cfg.tie_word_embeddings:
        raise ValueError("draft_model sharing needs a target with tied embeddings")
    return cfg


def make_draft(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first `num_layers` layers + final norm; embeddings tied, frozen and shared."""
    cfg = draft_config(target.config, num_layers)
    draft = LlamaForCausalLM(cfg).to(torch.float32)
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    unexpected = [k for k in unexpected if not k.startswith("model.layers.")]  # layers >= N
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"draft init: missing {missing}, unexpected {unexpected}")
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight  # shared tensor
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def unique_state(draft: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors only the drafter has (everything but the shared embeddings / LM head)."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith("model.layers.") or k == "model.norm.weight"}


def draft_logits(draft: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, T] -> logits [B, T, V] (position t predicts x_{t+1})."""
    return draft(input_ids=ids, use_cache=False).logits
