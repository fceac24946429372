"""What a drafter call may carry (`cluster.engine.draft_wire` for the messages): the limits a drafter
announces when a target connects, and the pure checks of both directions.

- `parse_request` (drafter side) turns a request into the arguments of `Drafter.propose`, or raises
  BadFrame naming the field and the bound; nothing is applied before the whole request passed, so a
  refused request changes no sequence's state.
- `parse_reply` (target side) turns a reply into drafts per sequence, or raises BadFrame: a
  malformed reply is a failed call (no drafts that step), and every draft id is inside the
  vocabulary before it reaches vLLM.
- The target keeps its requests inside the announced limits (`cluster.engine.draft_client.plan_call`); a
  request outside them comes from a broken or hostile peer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

CLIENT_MAX_CHARS = 64
ID_MAX_CHARS = 256
_INT_MAX = (1 << 31) - 1


class BadFrame(ValueError):
    """A request or reply outside the wire's contract; the message names the field (not its value)."""


@dataclass(frozen=True)
class WireLimits:
    max_k: int  # drafts per sequence per call
    vocab_size: int  # token ids are in [0, vocab_size)
    max_seq_tokens: int  # a sequence's committed length (start + its tokens)
    max_call_tokens: int  # tokens in one call, all sequences together
    max_seqs: int  # sequences in one call
    max_evict: int  # finished sequence ids in one call
    max_frame_bytes: int  # one request frame, tag included
    idle_timeout_s: float  # the drafter closes a connection idle this long
    max_id_chars: int = ID_MAX_CHARS

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> "WireLimits":
        """The limits a drafter sent (checked: they shape what the target sends next)."""
        if not isinstance(raw, dict):
            raise BadFrame("limits: not a map")
        out = {}
        for name in cls.__dataclass_fields__:
            v = raw.get(name)
            if name == "idle_timeout_s":
                out[name] = _number(v, f"limits.{name}", positive=True)
            else:
                out[name] = _int(v, 0, _INT_MAX, "limits.%s", name)
        return cls(**out)


def _int(x: Any, lo: int, hi: int, what: str, *args: Any) -> int:
    """x if an int in [lo, hi]; `what % args` names the field (formatted only on failure)."""
    if type(x) is not int:
        raise BadFrame(f"{what % args}: not an integer")
    if not lo <= x <= hi:
        raise BadFrame(f"{what % args}: outside [{lo}, {hi}]")
    return x


def _number(x: Any, what: str, positive: bool = False) -> float:
    if type(x) not in (int, float) or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise BadFrame(f"{what}: not a finite {'positive' if positive else 'non-negative'} number")
    return float(x)


def _str(x: Any, max_chars: int, what: str, *args: Any) -> str:
    if type(x) is not str:
        raise BadFrame(f"{what % args}: not a string")
    if not 0 < len(x) <= max_chars:
        raise BadFrame(f"{what % args}: length outside [1, {max_chars}]")
    return x


def _list(x: Any, max_len: int, what: str, *args: Any) -> list:
    if type(x) is not list:
        raise BadFrame(f"{what % args}: not a list")
    if len(x) > max_len:
        raise BadFrame(f"{what % args}: {len(x)} entries, more than {max_len}")
    return x


def token_ids(x: Any, max_len: int, vocab_size: int, what: str, *args: Any) -> list[int]:
    """A list of at most `max_len` token ids, each an int in [0, vocab_size)."""
    toks = _list(x, max_len, what, *args)
    for t in toks:  # a plain loop: the fastest form for the few tokens of a step, and for long prompts
        if type(t) is not int or not 0 <= t < vocab_size:
            bad = next(i for i, u in enumerate(toks) if u is t)
            raise BadFrame(f"{what % args}[{bad}]: not a token id in [0, {vocab_size})")
    return toks


def parse_request(msg: Any, lim: WireLimits) -> tuple[str, list[tuple[str, int, list[int], int]], list[str]]:
    """A request frame -> (client, [(seq_id, start, tokens, k)], evict), every bound checked."""
    if type(msg) is not dict:
        raise BadFrame("request: not a map")
    unknown = set(msg) - {"client", "seqs", "evict"}
    if unknown:
        raise BadFrame(f"request: unknown fields {sorted(map(str, unknown))[:3]}")
    client = _str(msg.get("client"), CLIENT_MAX_CHARS, "client")
    evict = _list(msg.get("evict", []), lim.max_evict, "evict")
    for i, sid in enumerate(evict):
        _str(sid, lim.max_id_chars, "evict[%d]", i)
    seqs, seen, total = [], set(), 0
    for i, s in enumerate(_list(msg.get("seqs", []), lim.max_seqs, "seqs")):
        if type(s) is not list or len(s) != 4:
            raise BadFrame(f"seqs[{i}]: not [seq_id, start, tokens, k]")
        sid, start, toks, k = s
        _str(sid, lim.max_id_chars, "seqs[%d].seq_id", i)
        if sid in seen:
            raise BadFrame(f"seqs[{i}].seq_id: repeated in the call")
        seen.add(sid)
        _int(start, 0, lim.max_seq_tokens, "seqs[%d].start", i)
        token_ids(toks, lim.max_seq_tokens - start, lim.vocab_size, "seqs[%d].tokens", i)
        total += len(toks)
        if total > lim.max_call_tokens:
            raise BadFrame(f"seqs[{i}].tokens: more than {lim.max_call_tokens} tokens in the call")
        _int(k, 0, lim.max_k, "seqs[%d].k", i)
        seqs.append((sid, start, toks, k))
    return client, seqs, evict


def parse_reply(reply: Any, ks: list[int], lengths: list[int], vocab_size: int) -> tuple[list[list[int]], list[int], float]:
    """A reply to a call of len(ks) sequences (asked K, tokens committed) -> (drafts, resync, compute_s).

    Drafts: at most K each, ids in [0, vocab_size). Resync: -1, or a position in [0, committed]."""
    if type(reply) is not dict:
        raise BadFrame("reply: not a map")
    if "error" in reply:
        raise BadFrame(f"drafter refused the call: {str(reply['error'])[:200]}")
    n = len(ks)
    drafts, resync = _list(reply.get("drafts"), n, "drafts"), _list(reply.get("resync"), n, "resync")
    if len(drafts) != n or len(resync) != n:
        raise BadFrame(f"reply: {len(drafts)} drafts and {len(resync)} resyncs for {n} sequences")
    compute_s = _number(reply.get("compute_s"), "compute_s")
    for i in range(n):
        token_ids(drafts[i], ks[i], vocab_size, "drafts[%d]", i)
        _int(resync[i], -1, lengths[i], "resync[%d]", i)
    return drafts, resync, compute_s
