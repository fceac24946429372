"""What tests of the drafter wire share: the test secret, a tiny random Llama (no weights needed),
and a target's side of the wire at the frame level (to send what a real target never would)."""

from __future__ import annotations

import socket
import time

from cluster.engine.draft_limits import WireLimits
from cluster.engine.draft_wire import Channel, client_handshake

SECRET = b"test-drafter-secret-0123456789"


def tiny_llama(vocab_size: int = 97):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def greedy(hf_model, context: list[int], k: int) -> list[int]:
    """Reference: k greedy tokens after `context`, full recompute each token (no cache)."""
    import torch

    ids, out = list(context), []
    with torch.inference_mode():
        for _ in range(k):
            tok = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def connect(server, secret: bytes = SECRET, timeout_s: float = 10.0) -> tuple[Channel, WireLimits]:
    """An authenticated connection to `server` (a DraftServer) and the limits it announced."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)
    ch, raw = client_handshake(sock, secret, time.monotonic() + timeout_s, 1 << 20)
    return ch, WireLimits.from_wire(raw)


def call(ch: Channel, msg, timeout_s: float = 10.0):
    ch.send(msg, time.monotonic() + timeout_s)
    return ch.recv(time.monotonic() + timeout_s)


def send_body(ch: Channel, body: bytes, timeout_s: float = 10.0) -> None:
    """Send `body` as the next authentic frame, whatever it holds (msgpack or not)."""
    from cluster.engine.draft_wire import send_payload

    tag = ch._tag(ch._out, ch._sent, body)
    ch._sent += 1
    send_payload(ch.sock, tag + body, time.monotonic() + timeout_s)
