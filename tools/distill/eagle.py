"""EAGLE-1 head for a Llama target, laid out exactly as vLLM's `llama_eagle.py` loads it.

Contract: `EagleHead(cfg)` owns only `fc.weight` [hidden, 2*hidden] and one decoder layer
`layers.0.*` (no input norm, no final norm); token embeddings and the LM head are the target's and
are passed in. Its state dict is the checkpoint vLLM expects, key for key.

vLLM's rule, which `unroll` reproduces for every start at once:
  draft step 1 at index t:  x = fc([embed(x_{t+1}), f_t]),       position t
  draft step j at index t:  x = fc([embed(x_{t+j}), o_{j-1}[t]]), position t+j-1
  layer: r = x + attn(x); o = r + mlp(post_attention_layernorm(r)); logits = lm_head(o)
Keys of step 1 at indices s <= t stay in the drafter's KV cache (vLLM recomputes them from the
target's features after every verification); the query of step j at index t attends to those and
to the keys of its own steps 2..j. o_j[t] predicts x_{t+j+1}.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig

ARCHITECTURE = "EagleLlamaForCausalLM"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def rope_theta(cfg: LlamaConfig) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ValueError(f"only default RoPE is supported, got {params}")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, heads, T, d]; positions: [T] -> x rotated (Llama's rotate_half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [d/2]
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [T, d]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        h, bias = cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Llama decoder layer without its input norm (vLLM replaces it with Identity for layer 0)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.theta = rope_theta(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Layer(cfg)])

    def unroll(self, embed: nn.Embedding, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """ids: [B, T] tokens x; feats: [B, T, H] target features f -> `steps` tensors o_j [B, T, H].

        o_j[:, t] is draft step j of the round started at t. Entries with t + j >= T read a padded
        token and are meaningless; callers mask them.
        """
        B, T = ids.shape
        layer = self.layers[0]
        attn = layer.self_attn
        nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
        rep, scale = nh // nkv, 1.0 / math.sqrt(d)
        base_pos = torch.arange(T, device=ids.device)  # [T]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()  # [T, T]
        h_in = feats  # [B, T, H]
        k1 = v1 = None
        own_k: list[torch.Tensor] = []  # steps 2..j: [B, nh, T, d] each, attended on the diagonal
        own_v: list[torch.Tensor] = []
        outs = []
        for j in range(1, steps + 1):
            tok = F.pad(ids[:, j:], (0, min(j, T)))[:, :T]  # [B, T]: x_{t+j}, 0 past the end
            x = self.fc(torch.cat([embed(tok), h_in], dim=-1))  # [B, T, H]
            pos = base_pos + (j - 1)
            q = rope(attn.q_proj(x).view(B, T, nh, d).transpose(1, 2), pos, self.theta)  # [B, nh, T, d]
            k = rope(attn.k_proj(x).view(B, T, nkv, d).transpose(1, 2), pos, self.theta).repeat_interleave(rep, 1)
            v = attn.v_proj(x).view(B, T, nkv, d).transpose(1, 2).repeat_interleave(rep, 1)  # [B, nh, T, d]
            if j == 1:
                k1, v1 = k, v
            else:
                own_k.append(k)
                own_v.append(v)
            s = (q @ k1.transpose(-1, -2)) * scale  # [B, nh, T, T]
            s = s.masked_fill(~causal, float("-inf"))
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in own_k]  # each [B, nh, T, 1]
            p = torch.softmax(torch.cat([s, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # [B, nh, T, T+j-1]
            a = p[..., :T] @ v1  # [B, nh, T, d]
            for i, vv in enumerate(own_v):
                a = a + p[..., T + i : T + i + 1] * vv
            r = x + attn.o_proj(a.transpose(1, 2).reshape(B, T, nh * d))  # [B, T, H]
            o = r + layer.mlp(layer.post_attention_layernorm(r))  # [B, T, H]
            outs.append(o)
            h_in = o
        return outs


def vllm_config(target_cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """config.json of the head: the target's Llama config with one layer and vLLM's EAGLE architecture."""
    cfg = target_cfg.to_dict()
    cfg["architectures"] = [ARCHITECTURE]
    cfg["num_hidden_layers"] = 1
    cfg.pop("layer_types", None)
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    return cfg


@torch.no_grad()
def init_from_target(head: EagleHead, target: nn.Module, gen: torch.Generator) -> None:
    """layers.0 <- the target's last decoder layer with its two output projections (o_proj,
    down_proj) zeroed, fc <- [small noise | identity]: the head starts as the identity on f_t.

    Copied whole, the last layer's branches are sized for the target's large residual stream and
    start the KL near 560 nats on SmolLM2; with zeroed outputs it starts near 12 (smoke-run check).
    """
    last = target.model.layers[-1]
    own = head.layers[0].state_dict()
    own.update({k: v for k, v in last.state_dict().items() if k in own})
    head.layers[0].load_state_dict(own)
    head.layers[0].self_attn.o_proj.weight.zero_()
    head.layers[0].mlp.down_proj.weight.zero_()
    H = head.cfg.hidden_size
    w = torch.randn(H, 2 * H, generator=gen) * 0.02  # [H, 2H]
    w[:, H:] = torch.eye(H)
    head.fc.weight.copy_(w)


COPIED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight")


def freeze_copied(head: EagleHead) -> int:
    """Keep the tensors `init_from_target` copied from the target's last layer (q, k, v, gate, up)
    frozen; only fc, the zero-initialised output projections and the norm train. Against
    memorising a small corpus (BENCHMARKS 9.2: a head reached acceptance length 2.81 on its training text
    and 1.43 held out): fewer free parameters, and the head keeps the target's own attention and MLP
    read-outs. Returns the number of parameters left trainable."""
    layer = head.layers[0]
    for name, p in layer.named_parameters():
        if name in COPIED:
            p.requires_grad_(False)
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def expected_keys(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM's EagleLlamaForCausalLM reads for this config (tied ones excluded)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = "layers.0."
    return {
        "fc.weight": (H, 2 * H),
        p + "self_attn.q_proj.weight": (q, H),
        p + "self_attn.k_proj.weight": (kv, H),
        p + "self_attn.v_proj.weight": (kv, H),
        p + "self_attn.o_proj.weight": (H, q),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
        p + "post_attention_layernorm.weight": (H,),
    }
