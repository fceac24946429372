"""The router's internal result (`Completion`) and the specserve.v1 protobuf built from it; the
protobuf request parses into `cluster.api.types.GenerateRequest` (validation lives there). The
OpenAI JSON of the HTTP door is vLLM's own (`deployments.vllm_openai`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.api.types import ApiError, ErrorCode, GenerateRequest, parse_request


@dataclass
class Completion:
    """What the router knows of a finished (or partial) generation."""

    request_id: str
    model: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # SpecStats.to_dict() + pool/replica/decision
    logprobs: Optional[list[dict[int, float]]] = None

    @property
    def tpot_s(self) -> float:
        n = self.completion_tokens - 1
        return (self.latency_s - self.ttft_s) / n if n > 0 else 0.0


# -- protobuf ---------------------------------------------------------------------------------

def from_proto(msg: Any) -> GenerateRequest:
    """specserve.v1.GenerateRequest -> validated GenerateRequest (unset optionals keep defaults)."""
    data: dict[str, Any] = {}
    if msg.model:
        data["model"] = msg.model
    if msg.prompt and msg.messages:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "exactly one of `prompt` and `messages` must be given",
                       field="prompt")
    if msg.messages:
        data["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
    else:
        data["prompt"] = msg.prompt
    if msg.HasField("sampling"):
        s = msg.sampling
        for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
            if s.HasField(name):
                data[name] = getattr(s, name)
        if s.stop:
            data["stop"] = list(s.stop)
    if msg.workload_class:
        data["workload_class"] = msg.workload_class
    if msg.HasField("speculative"):
        spec: dict[str, Any] = {"mode": msg.speculative.mode}
        if msg.speculative.HasField("k"):
            spec["k"] = msg.speculative.k
        if msg.speculative.HasField("k_grow"):  # not served: `parse_request` refuses it by name
            spec["k_grow"] = msg.speculative.k_grow
        data["speculative"] = spec
    if msg.request_id:
        data["request_id"] = msg.request_id
    return parse_request(data)


def spec_stats_proto(pb: Any, c: Completion):
    s = c.stats
    return pb.SpecStats(
        mode=str(s.get("mode", "none")), k=int(s.get("k", 0)), steps=int(s.get("steps", 0)),
        drafted=int(s.get("drafted", 0)), accepted=int(s.get("accepted", 0)),
        acceptance_length=float(s.get("acceptance_length", 1.0)),
        accepted_per_position=[int(x) for x in s.get("accepted_per_position", [])],
        pool=str(s.get("pool", "")), workload_class=str(s.get("workload_class", "")),
        decided_by=str(s.get("decided_by", "")), explored=bool(s.get("explored", False)),
        load_bucket=str((s.get("decision") or {}).get("load_bucket", "")),
    )


def timing_proto(pb: Any, c: Completion):
    return pb.Timing(ttft_s=c.ttft_s, latency_s=c.latency_s, tpot_s=c.tpot_s)


def generate_response_proto(pb: Any, c: Completion):
    return pb.GenerateResponse(
        request_id=c.request_id, model=c.model, text=c.text, token_ids=c.token_ids,
        finish_reason=c.finish_reason or "", prompt_tokens=c.prompt_tokens,
        completion_tokens=c.completion_tokens, timing=timing_proto(pb, c), spec=spec_stats_proto(pb, c),
    )
