"""What an engine replica takes and gives: `EngineRequest`, `EngineChunk`, the stats and extra
arguments derived from them, and a stream's chunks joined into one (`join_chunks`, `collect`) (no vLLM
import at module level)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_K_STEP, EXTRA_ARGS_MODE, SpecStats, accepted_runs


@dataclass
class EngineRequest:
    """One generation request as the router hands it to an engine replica."""

    request_id: str
    mode: str  # SpecMode value actually used (none when k == 0)
    k: int  # per-request speculation length, 0..pool.max_k: fixed, or the ceiling of the engine's per-step K
    prompt: Optional[str] = None  # raw prompt, used as is
    messages: Optional[list[dict[str, str]]] = None  # chat messages, templated by the engine
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # top-N logprobs per output token (for lossless diagnostics)
    ignore_eos: bool = False
    k_step_alpha: Optional[float] = None  # class α: the engine picks K (<= k) at every step (cluster.engine.step_k)
    streamed: bool = True  # False: the caller wants the whole text; the replica sends first token + final chunk
    # An OpenAI call served by vLLM's own serving layer (`deployments.vllm_openai`): {"path": ...,
    # "body": the JSON body as bytes}. The body carries the prompt and sampling fields; the fields above
    # other than the request id and the speculation (mode, k, k_*) are then unused.
    openai: Optional[dict[str, Any]] = None


@dataclass
class EngineChunk:
    """A piece of a streamed response; the last one has finish_reason and stats set."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: Optional[dict[str, Any]] = None  # SpecStats.to_dict() on the last chunk
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token id: logprob}
    replica: str = ""
    # OpenAI calls only (`EngineRequest.openai`): vLLM's answer, as it is, in pieces (SSE events or a
    # JSON body), with its HTTP status and media type.
    raw: str = ""
    http_status: Optional[int] = None
    media_type: Optional[str] = None


def stats_from_output(mode: str, k: int, completion_tokens: int, metrics: Any) -> SpecStats:
    """Turn vLLM's per-request RequestSpecDecodeMetrics (may be None) into our SpecStats.

    histogram[j] = verification steps in which exactly j drafts were accepted, so
    spec_steps = sum(histogram), accepted = sum(j * histogram[j]) and draft position i was accepted
    in sum(histogram[j > i]) steps. The completion_tokens - 1 tokens after the first come from
    `steps` decode steps, each giving accepted + 1 tokens; a stop (EOS, stop string, max_tokens)
    inside an accepted run discards its tail, so delivered accepted tokens are capped at
    completion_tokens - 1 - spec_steps (every spec step delivers at least its bonus token).
    """
    stats = SpecStats(mode=mode, k=k)
    decode_tokens = max(completion_tokens - 1, 0)
    if metrics is not None:
        hist = list(metrics.histogram)
        stats.spec_steps = sum(hist)
        raw_accepted = sum(j * c for j, c in enumerate(hist))
        stats.accepted = max(0, min(raw_accepted, decode_tokens - stats.spec_steps))
        stats.drafted = int(metrics.num_draft_tokens)
        per_pos = [sum(hist[i + 1:]) for i in range(max(len(hist) - 1, 0))]
        drafted_steps = list(getattr(metrics, "per_step_drafted", []) or [])
        width = max([k, *drafted_steps]) if drafted_steps else k
        stats.accepted_per_position = per_pos[:width]
        stats.drafted_per_position = [sum(1 for n in drafted_steps if n > i) for i in range(width)]
        accepted_steps = list(getattr(metrics, "per_step_accepted", []) or [])
        if accepted_steps and len(accepted_steps) == len(drafted_steps):
            # vLLM records only the steps that verified drafts, in order; a step that drafted
            # nothing between two of them is not seen, so a full step followed by one is taken as
            # continuing its run (rare: after a full step n-gram lookup and drafters go on drafting).
            stats.run_lengths = accepted_runs(accepted_steps, drafted_steps)
    stats.steps = decode_tokens - stats.accepted
    return stats


def extra_args(req: EngineRequest) -> dict[str, Any]:
    """The request's speculation as `SamplingParams.extra_args`, which the engine's scheduler reads
    (`cluster.engine.vllm_scheduler`).

    >>> extra_args(EngineRequest("r", "ngram", 3)), extra_args(EngineRequest("r", "ngram", 6, k_step_alpha=0.5))
    ({'specserve_k': 3, 'specserve_mode': 'ngram'}, {'specserve_k': 6, 'specserve_mode': 'ngram', 'specserve_k_step': 0.5})
    """
    return {EXTRA_ARGS_K: int(req.k), EXTRA_ARGS_MODE: req.mode,
            **({EXTRA_ARGS_K_STEP: float(req.k_step_alpha)} if req.k_step_alpha is not None else {})}


async def collect(stream: AsyncIterator[EngineChunk]) -> EngineChunk:
    """Drain a stream into one chunk (`join_chunks`)."""
    chunks = [chunk async for chunk in stream]
    if not chunks:
        raise RuntimeError("engine stream ended without output")
    return join_chunks(chunks)


def join_chunks(chunks: list[EngineChunk]) -> EngineChunk:
    """Consecutive chunks as one: text and tokens joined, the last chunk's end-of-request fields."""
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    last = chunks[-1]
    return EngineChunk(
        text="".join(c.text for c in chunks), token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
        stats=last.stats, logprobs=logprobs or None, replica=last.replica,
    )
