"""Artefacts of a trained drafter: the full directory vLLM loads, and the small repository copy.

Contract: `write_artefact` writes what vLLM's `speculative_config={"method": kind, "model": dir}`
loads. `ship` writes only the drafter's own tensors (fp16) plus config.json and a manifest naming
the tensors to take from the target; `assemble(ship_dir, target_dir, out_dir)` rebuilds the full
directory from it at model preparation time and refuses a target whose embeddings differ from the
one the drafter was trained against.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cluster.distill import eagle as eagle_mod
from cluster.distill.draft_model import unique_state

MANIFEST = "drafter.json"
EMBED = "model.embed_tokens.weight"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def embed_digest(embed: torch.Tensor) -> str:
    return hashlib.sha256(embed.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


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


def _target_embed(target_dir: Path) -> torch.Tensor:
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if EMBED in sf.keys():
                return sf.get_tensor(EMBED)
    raise FileNotFoundError(f"{target_dir}: no {EMBED} in its safetensors files")


def assemble(ship_dir: Path, target_dir: Path, out_dir: Path) -> Path:
    """Shipped drafter + its target's shared tensors -> a full fp32 directory vLLM loads."""
    ship_dir, target_dir, out = Path(ship_dir), Path(target_dir), Path(out_dir)
    manifest = json.loads((ship_dir / MANIFEST).read_text())
    tcfg = json.loads((target_dir / "config.json").read_text())
    want = manifest["target"]
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if tcfg.get(key) != want[key]:
            raise ValueError(f"drafter {ship_dir} was trained for {key}={want[key]}, target has {tcfg.get(key)}")
    embed = _target_embed(target_dir)
    if embed_digest(embed) != want["embed_sha256_16"]:
        raise ValueError(f"drafter {ship_dir} was trained against a different target than {target_dir}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.float().contiguous() for k, v in load_file(str(ship_dir / "model.safetensors")).items()}
    for name in manifest["shared_from_target"]:
        tensors[name] = embed.float().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(ship_dir / "config.json", out / "config.json")
    if manifest["kind"] == "draft_model":
        for name in _TOKENIZER_FILES:
            if (target_dir / name).exists():
                shutil.copy(target_dir / name, out / name)
    return out
