import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)


def tiny_config(**kw) -> LlamaConfig:
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(kw)
    c = LlamaConfig(**cfg)
    c._attn_implementation = "sdpa"
    return c


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(tiny_config()).eval()
    m.requires_grad_(False)
    return m


@pytest.fixture
def target():
    return tiny_target(0)


def make_samples(target, n: int = 6, T: int = 24, prompt_len: int = 6, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 256, (T - (i % 3),), generator=gen)
        with torch.no_grad():
            feats = target.model(input_ids=ids[None]).last_hidden_state[0]
        out.append({"ids": ids, "prompt_len": prompt_len, "feats": feats.half()})
    return out
