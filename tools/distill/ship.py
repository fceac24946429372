"""Artefacts of a trained drafter: the full directory vLLM loads, and the small repository copy.

Contract: `write_artefact` writes what vLLM's `speculative_config={"method": kind, "model": dir}`
loads. `ship` writes only the drafter's own tensors (fp16) plus config.json and a manifest naming
the tensors to take from the target; `assemble(ship_dir, target_dir, out_dir)` rebuilds the full
directory from it at model preparation time and refuses a target whose embeddings differ from the
one the drafter was trained against.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.distill import eagle as eagle_mod
from tools.distill.draft_model import unique_state
from cluster.ops.shipped_drafter import EMBED, MANIFEST, assemble, embed_digest  # noqa: F401 - assemble: the other half of the contract


def _own_tensors(kind: str, drafter) -> dict[str, torch.Tensor]:
    return drafter.state_dict() if kind == "eagle" else unique_state(drafter)


def _config(kind: str, drafter, target, dtype: str) -> dict:
    if kind == "eagle":
        return eagle_mod.vllm_config(target.config, dtype)
    cfg = drafter.config.to_dict()
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    return cfg


def write_artefact(kind: str, drafter, target, tokenizer, out_dir: Path) -> Path:
    """The full fp32 directory vLLM loads (eagle: head only; draft_model: a complete model)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in _own_tensors(kind, drafter).items()}
    if kind == "draft_model":
        tensors[EMBED] = target.model.embed_tokens.weight.detach().float().contiguous()
        tokenizer.save_pretrained(out)
        if getattr(tokenizer, "chat_template", None):
            (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(kind, drafter, target, "float32"), indent=2))
    return out


def ship(kind: str, drafter, target, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Only the drafter's own tensors, in `dtype`, with a manifest for `assemble`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in _own_tensors(kind, drafter).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(kind, drafter, target, "float32"), indent=2))
    tc = target.config
    manifest = {
        "kind": kind,
        "shared_from_target": [EMBED] if kind == "draft_model" else [],
        "target": {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size,
                   "num_hidden_layers": tc.num_hidden_layers,
                   "embed_sha256_16": embed_digest(target.model.embed_tokens.weight)},
        "stored_dtype": str(dtype).removeprefix("torch."),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out
