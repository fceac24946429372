import math

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tools.distill.eagle import ARCHITECTURE, EagleHead, expected_keys, init_from_target, rope, vllm_config
from tests.distill.conftest import tiny_config


def test_state_dict_is_what_vllm_llama_eagle_loads(target):
    cfg = tiny_config()
    head = EagleHead(cfg)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == expected_keys(cfg)
    # the HF decoder layer's tensors, minus the input norm vLLM drops for layer 0, under layers.0.
    hf = {f"layers.0.{k}" for k in LlamaDecoderLayer(cfg, 0).state_dict() if "input_layernorm" not in k}
    assert set(shapes) == hf | {"fc.weight"}
    assert shapes["fc.weight"] == (64, 128)
    assert not any("embed_tokens" in k or "lm_head" in k for k in shapes)
    c = vllm_config(cfg)
    assert c["architectures"] == [ARCHITECTURE] and c["num_hidden_layers"] == 1
    assert c["hidden_size"] == 64 and c["vocab_size"] == 256


def test_init_copies_the_targets_last_layer(target):
    head = EagleHead(target.config)
    init_from_target(head, target, torch.Generator().manual_seed(0))
    last = target.model.layers[-1]
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(head.layers[0].mlp.up_proj.weight, last.mlp.up_proj.weight)
    assert not head.layers[0].mlp.down_proj.weight.any() and not head.layers[0].self_attn.o_proj.weight.any()
    # so the head starts as the identity on the features: o_1[t] = fc([e, f_t]) ~ f_t
    ids, feats = torch.randint(0, 256, (1, 6)), torch.randn(1, 6, 64)
    (o1,) = head.unroll(target.model.embed_tokens, ids, feats, 1)
    assert torch.allclose(o1, feats, atol=0.1)
    assert torch.equal(head.fc.weight[:, 64:], torch.eye(64))


def test_step_one_equals_a_llama_layer_without_input_norm(target):
    cfg = tiny_config()
    torch.manual_seed(1)
    head = EagleHead(cfg)
    hf = LlamaDecoderLayer(cfg, 0)
    hf.input_layernorm = torch.nn.Identity()
    hf.load_state_dict({k: v for k, v in head.layers[0].state_dict().items()}, strict=False)
    ids = torch.randint(0, 256, (1, 10))
    feats = torch.randn(1, 10, 64)
    (o1,) = head.unroll(target.model.embed_tokens, ids, feats, 1)
    x = head.fc(torch.cat([target.model.embed_tokens(F.pad(ids[:, 1:], (0, 1))), feats], -1))
    pos = torch.arange(10)[None]
    ref = hf(x, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos), position_ids=pos)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(o1, ref, atol=1e-5)


def _naive_round(head, embed, ids, feats, t, steps):
    """vLLM's drafting for one start t: a KV cache of step-1 entries 0..t, then steps 2..K appended."""
    layer, attn = head.layers[0], head.layers[0].self_attn
    nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    xs, pos = [], []
    for s in range(t + 1):  # step-1 entries (recomputed from target features after verification)
        xs.append(head.fc(torch.cat([embed(ids[s + 1]), feats[s]], -1)))
        pos.append(s)
    outs, h = [], None
    for j in range(1, steps + 1):
        if j > 1:
            xs.append(head.fc(torch.cat([embed(ids[t + j]), h], -1)))
            pos.append(t + j - 1)
        x = torch.stack(xs)[None]  # [1, N, H]
        N, p = x.shape[1], torch.tensor(pos)
        q = rope(attn.q_proj(x).view(1, N, nh, d).transpose(1, 2), p, head.theta)
        k = rope(attn.k_proj(x).view(1, N, nkv, d).transpose(1, 2), p, head.theta).repeat_interleave(nh // nkv, 1)
        v = attn.v_proj(x).view(1, N, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1]  # [1, nh, d]
        r = x[0, -1] + attn.o_proj(a.reshape(-1))
        h = r + layer.mlp(layer.post_attention_layernorm(r))
        outs.append(h)
    return outs


def test_unroll_reproduces_vllms_drafting_with_a_kv_cache(target):
    torch.manual_seed(2)
    head = EagleHead(tiny_config())
    ids = torch.randint(0, 256, (12,))
    feats = torch.randn(12, 64)
    outs = head.unroll(target.model.embed_tokens, ids[None], feats[None], 3)
    for t in (0, 4, 7):
        for j, ref in enumerate(_naive_round(head, target.model.embed_tokens, ids, feats, t, 3)):
            assert torch.allclose(outs[j][0, t], ref, atol=1e-5), (t, j)


def test_rope_is_a_rotation():
    x = torch.randn(1, 2, 5, 8)
    y = rope(x, torch.arange(5), 10000.0)
    assert torch.allclose(x.norm(dim=-1), y.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rope(x, torch.zeros(5, dtype=torch.long), 1e4), x)
    assert not math.isclose(float((y - x).abs().sum()), 0.0)
