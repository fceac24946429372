"""A shipped drafter made whole at model preparation time (`shipped:<model>:<dir>` sources).

The repository keeps only a drafter's own tensors and a manifest (`tools.distill.ship.ship`
writes them); `assemble` adds the tensors it shares with its target, from the target's files, and
refuses a target whose shape or embeddings differ from the one the drafter was trained against.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MANIFEST = "drafter.json"
EMBED = "model.embed_tokens.weight"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def embed_digest(embed: torch.Tensor) -> str:
    return hashlib.sha256(embed.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


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
