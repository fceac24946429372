"""Drafter deployment: a draft model, apart from the targets, that proposes up to K draft tokens for a
whole batch of sequences per call, keeping each sequence's KV cache so that a step costs only the
sequence's new tokens (what the target accepted, plus its bonus token).

Three layers, each testable alone:

- `DraftModel`: a packed, batched forward of a Llama-architecture causal LM (Hugging Face module
  weights) over sequences of different lengths, each with its own growable KV cache.
- `Drafter`: per-sequence state keyed by (client, sequence id), bounded in number and idle time;
  `propose(client, seqs, evict)` is one target step (see `cluster.engine.draft_wire` for the contract).
- `DraftServer` (`deployments/draft_server.py`): the authenticated TCP endpoint that target engines
  call once per step (`cluster.engine.draft_wire`), one thread per connected target, every request checked
  against the drafter's limits (`cluster.engine.draft_limits`); `DrafterServer` is the Ray Serve deployment
  class (`deployments/app.py` applies `serve.deployment`), whose `endpoint()` tells targets where it is.

Greedy drafting: draft token i+1 is the argmax of the draft model after draft token i.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from cluster.engine.draft_wire import secret_from_env
from deployments.draft_server import DraftServer

__all__ = ["DraftModel", "Drafter", "DraftServer", "DrafterServer", "KVCache"]

log = logging.getLogger("specserve.drafter")


# -- the model ---------------------------------------------------------------------------------------


class KVCache:
    """One sequence's keys and values for every layer, in a buffer that doubles when full."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, capacity: int = 64):
        import torch

        # buf: [layers, 2 (k, v), kv_heads, capacity, head_dim]
        self.buf = torch.empty(num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0  # tokens whose keys/values are stored (all layers alike)

    def reserve(self, n: int) -> None:
        import torch

        need = self.length + n
        cap = self.buf.shape[3]
        if need > cap:
            while cap < need:
                cap *= 2
            grown = torch.empty(*self.buf.shape[:3], cap, self.buf.shape[4], dtype=self.buf.dtype)
            grown[:, :, :, : self.length] = self.buf[:, :, :, : self.length]
            self.buf = grown

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class DraftModel:
    """Batched greedy drafting with a Hugging Face Llama-architecture model (LlamaForCausalLM,
    and the families sharing its module names: Mistral, Qwen2 without sliding windows, SmolLM2)."""

    def __init__(self, hf_model):
        import torch

        self.hf = hf_model.eval()
        cfg = hf_model.config
        self.num_layers = cfg.num_hidden_layers
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.dtype = next(hf_model.parameters()).dtype
        # Token ids it can embed and score (a target's id past either would index out of range).
        self.vocab_size = min(hf_model.get_input_embeddings().num_embeddings, hf_model.lm_head.out_features)
        self._torch = torch

    @classmethod
    def load(cls, path: str, dtype: str = "float32") -> "DraftModel":
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype))

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def forward(self, chunks: list[tuple[list[int], KVCache]]):
        """Feed each sequence its new tokens after what its cache holds; append their keys/values.

        chunks: [(new token ids, the sequence's cache)], every list non-empty.
        Returns the logits after each chunk's last token: [len(chunks), vocab].
        """
        torch = self._torch
        from torch.nn.functional import scaled_dot_product_attention
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        with torch.inference_mode():
            m = self.hf.model
            lens = [len(toks) for toks, _ in chunks]
            n_total = sum(lens)
            ids = torch.tensor([t for toks, _ in chunks for t in toks], dtype=torch.long)  # [N]
            pos = torch.tensor([c.length + i for (_, c), n in zip(chunks, lens) for i in range(n)])  # [N]
            h = m.embed_tokens(ids)[None]  # [1, N, hidden]
            cos, sin = m.rotary_emb(h, pos[None])  # [1, N, head_dim] each
            for _, c in chunks:
                c.reserve(max(lens))
            for li, layer in enumerate(m.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                q = attn.q_proj(x).view(1, n_total, -1, self.head_dim).transpose(1, 2)  # [1, H, N, d]
                k = attn.k_proj(x).view(1, n_total, -1, self.head_dim).transpose(1, 2)  # [1, Hkv, N, d]
                v = attn.v_proj(x).view(1, n_total, -1, self.head_dim).transpose(1, 2)  # [1, Hkv, N, d]
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                outs, off = [], 0
                for (_, c), n in zip(chunks, lens):
                    past = c.length
                    c.buf[li, 0, :, past: past + n] = k[0, :, off: off + n]
                    c.buf[li, 1, :, past: past + n] = v[0, :, off: off + n]
                    keys = c.buf[li, 0, :, : past + n]  # [Hkv, T, d]
                    values = c.buf[li, 1, :, : past + n]  # [Hkv, T, d]
                    mask = None
                    if n > 1:  # causal among the new tokens: token j sees positions <= past + j
                        mask = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]  # [n, T]
                    o = scaled_dot_product_attention(
                        q[:, :, off: off + n], keys[None], values[None], attn_mask=mask,
                        scale=attn.scaling, enable_gqa=True,
                    )  # [1, H, n, d]
                    outs.append(o[0].transpose(0, 1).reshape(n, -1))
                    off += n
                h = h + attn.o_proj(torch.cat(outs)[None])
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            for (_, c), n in zip(chunks, lens):
                c.length += n
            last = torch.tensor(lens).cumsum(0) - 1  # [B]
            return self.hf.lm_head(m.norm(h[0, last]))  # [B, vocab]


# -- per-sequence state ------------------------------------------------------------------------------


@dataclass
class SequenceState:
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # what the cache holds: committed, then fed drafts
    committed: int = 0  # tokens the target has committed (sent to us)
    last_used_s: float = 0.0

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self.cache.length = min(self.cache.length, n)


@dataclass
class DrafterStats:
    calls: int = 0
    sequences: int = 0  # live
    drafted: int = 0
    fed_tokens: int = 0  # tokens run through the model (new committed tokens + drafts fed back)
    reused_tokens: int = 0  # accepted drafts whose keys/values were already cached
    resyncs: int = 0
    evicted_idle: int = 0
    evicted_lru: int = 0
    compute_s: float = 0.0
    connections: int = 0  # targets connected now
    connections_ended: int = 0  # connections whose serve loop ended other than by close() (WARNING each)
    connection_errors: int = 0  # ... of which on an error (a malformed frame, a failed send, a bug), not a peer's close
    accept_failures: int = 0  # the accept loop ended on an error: the endpoint is down (check_health fails)
    accept_errors: int = 0  # accept() failed for lack of resources (EMFILE ...) and the loop backed off
    connections_refused: int = 0  # closed at once: max_connections (or handshakes under way) reached
    handshake_failures: int = 0  # a peer that did not prove the secret in time (rate-limited WARNING)
    bad_frames: int = 0  # requests refused with an error reply (outside the limits, not msgpack, too large)
    idle_closed: int = 0  # connections closed after idle_timeout_s without a frame (INFO)


class Drafter:
    """Proposes drafts for batches of sequences; holds each sequence's state between steps.

    Memory is bounded: at most `max_sequences` sequences (least recently used go first) and none
    idle for more than `idle_ttl_s` (a target that died never says its sequences finished).
    """

    def __init__(self, model: DraftModel, max_sequences: int = 256, idle_ttl_s: float = 120.0,
                 max_context: int = 8192, max_k: int = 16, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.vocab_size = int(getattr(model, "vocab_size", 0))  # 0 without a model (tests of the endpoint)
        self.max_k = max_k
        self.max_sequences = max_sequences
        self.idle_ttl_s = idle_ttl_s
        self.max_context = max_context
        self.clock = clock
        self.stats = DrafterStats()
        self._seqs: "OrderedDict[tuple[str, str], SequenceState]" = OrderedDict()
        self._lock = threading.Lock()  # one model, many connected targets

    def propose(self, client: str, seqs: list, evict: list) -> tuple[list[list[int]], list[int]]:
        """One target step: `seqs` = [(seq_id, start, tokens, k)] -> (drafts, resync) per sequence.
        The arguments are trusted: the endpoint checked them (`cluster.engine.draft_limits.parse_request`)."""
        with self._lock:
            t0 = time.perf_counter()
            out = self._propose(client, seqs, evict)
            self.stats.compute_s += time.perf_counter() - t0
            return out

    def _propose(self, client, seqs, evict):
        now = self.clock()
        self.stats.calls += 1
        for sid in evict:
            self._seqs.pop((client, str(sid)), None)
        self._evict_idle(now)
        drafts: list[list[int]] = [[] for _ in seqs]
        resync = [-1] * len(seqs)
        work: list[tuple[int, SequenceState, list[int], int]] = []  # (index, state, tokens to feed, k)
        for i, (sid, start, tokens, k) in enumerate(seqs):
            key = (client, str(sid))
            st = self._seqs.get(key)
            if st is None and start != 0:
                resync[i] = 0
                self.stats.resyncs += 1
                continue
            if st is None:
                st = SequenceState(cache=self.model.new_cache())
                self._seqs[key] = st
            self._seqs.move_to_end(key)
            st.last_used_s = now
            if start > st.committed:
                resync[i] = st.committed
                self.stats.resyncs += 1
                continue
            feed = self._advance(st, int(start), [int(t) for t in tokens])
            if feed:  # K = 0 (or past max_context) still feeds, so the cache keeps up with the sequence
                work.append((i, st, feed, int(k) if st.committed < self.max_context else 0))
        self._evict_lru()
        self.stats.sequences = len(self._seqs)
        self._draft(work, drafts)
        return drafts, resync

    def _advance(self, st: SequenceState, start: int, tokens: list[int]) -> list[int]:
        """Commit `tokens` at `start`; keep the cached prefix that matches (accepted drafts included);
        return the tokens still to feed (at least the last one, whose logits give the first draft)."""
        if not tokens:
            return []
        p, j = start, 0
        while j < len(tokens) and p < len(st.tokens) and st.tokens[p] == tokens[j]:
            p, j = p + 1, j + 1
        if j == len(tokens):  # everything cached: re-feed the last token for its logits
            p, j = p - 1, j - 1
        self.stats.reused_tokens += max(0, p - min(start, len(st.tokens)))
        st.truncate(p)
        st.tokens.extend(tokens[j:])
        st.committed = start + len(tokens)
        return tokens[j:]

    def _draft(self, work, drafts) -> None:
        """Round r feeds every unfinished sequence its pending tokens and takes one greedy draft."""
        pending = [(i, st, feed, k) for i, st, feed, k in work]
        while pending:
            logits = self.model.forward([(feed, st.cache) for _, st, feed, _ in pending])  # [B, vocab]
            self.stats.fed_tokens += sum(len(feed) for _, _, feed, _ in pending)
            next_ids = logits.argmax(dim=-1).tolist()
            still = []
            for (i, st, _, k), tok in zip(pending, next_ids):
                if k <= 0:
                    continue
                drafts[i].append(tok)
                self.stats.drafted += 1
                if len(drafts[i]) < k:
                    st.tokens.append(tok)
                    still.append((i, st, [tok], k))
            pending = still

    def _evict_idle(self, now: float) -> None:
        stale = [key for key, st in self._seqs.items() if now - st.last_used_s > self.idle_ttl_s]
        for key in stale:
            del self._seqs[key]
        self.stats.evicted_idle += len(stale)

    def _evict_lru(self) -> None:
        while len(self._seqs) > self.max_sequences:
            self._seqs.popitem(last=False)
            self.stats.evicted_lru += 1

    def cache_bytes(self) -> int:
        with self._lock:
            return sum(st.cache.nbytes() for st in self._seqs.values())


# -- the deployment --------------------------------------------------------------------------------


class DrafterServer:
    """One drafter replica: a Drafter behind a DraftServer; `deployments/app.py` makes it a deployment.

    `endpoint()` is how targets find it (their engine replicas ask through a Serve handle and hand
    the address to the proposer in the engine process); per-step calls go straight over TCP.
    """

    def __init__(self, name: str, model_path: str, dtype: str = "float32", max_sequences: int = 256,
                 idle_ttl_s: float = 120.0, max_context: int = 8192, host: Optional[str] = None, port: int = 0,
                 num_threads: int = 0, model: Optional[DraftModel] = None, max_k: int = 16,
                 wire: Optional[dict[str, Any]] = None, secret: Optional[bytes] = None):
        """`wire`: DraftServer's bounds (max_frame_bytes, max_call_tokens, max_connections,
        idle_timeout_s, recv_timeout_s); `secret`: the wire's, by default from SECRET_ENV."""
        import torch

        secret = secret if secret is not None else secret_from_env()  # fails start-up, naming the variable
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.name = name
        t0 = time.monotonic()
        model = model if model is not None else DraftModel.load(model_path, dtype)
        self.drafter = Drafter(model, max_sequences=max_sequences, idle_ttl_s=idle_ttl_s, max_context=max_context,
                               max_k=max_k)
        self.server = DraftServer(self.drafter, host or _node_ip(), port, secret=secret, **(wire or {}))
        log.info("drafter %s: model %s up in %.1f s, serving drafts on %s", name, model_path,
                 time.monotonic() - t0, self.server.address)

    async def endpoint(self) -> str:
        return self.server.address

    async def stats(self) -> dict[str, Any]:
        s = self.drafter.stats
        return {**s.__dict__, "address": self.server.address, "cache_bytes": self.drafter.cache_bytes()}

    async def check_health(self) -> None:
        if not self.server.alive():
            raise RuntimeError(f"drafter {self.name}: TCP endpoint {self.server.address} is down")

    def shutdown(self) -> None:
        """Close the TCP endpoint (its listener and every connection). Idempotent."""
        server = getattr(self, "server", None)
        if server is not None:
            server.close()

    def __del__(self):  # Ray Serve's hook when it stops a replica
        self.shutdown()


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): loopback
        return "127.0.0.1"
