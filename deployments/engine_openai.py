"""The engine replica's OpenAI door: calls served by vLLM's own serving layer over the replica's
engine (`deployments.vllm_openai`), with the request's speculation added. A mixin of
`deployments.engine.EngineServer` (it reads `openai_app`, `engine`, `pool`, `replica`, `_finished`,
`_check_alive`, `_errored`, `_engine_dead`)."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from cluster.engine.coalesce import flush
from deployments.engine_types import EngineChunk, EngineRequest, extra_args, stats_from_output
from deployments.vllm_openai import Capture, call_app


class OpenAIDoor:
    """See module doc."""

    openai_app: Any = None  # vLLM's OpenAI app over the replica's engine, set by the replica

    async def _openai_chunks(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """An OpenAI call through vLLM's serving layer (`deployments.vllm_openai`), with the request's
        speculation added to its `SamplingParams.extra_args` once vLLM has validated the body. Chunks are gathered as `generate`'s are
        (`cluster.engine.coalesce`); what comes after the engine finished the request is held for
        the last chunk, which carries the stats (the router adds them to vLLM's last event)."""
        if self.openai_app is None:
            raise RuntimeError(f"pool {self.pool_name}: this replica has no OpenAI serving layer")
        capture = Capture(extra_args=extra_args(req))
        status, media, raw, sent_any, t_sent = None, None, "", False, time.monotonic()
        pending_tokens = 0
        t_start, t_first = time.monotonic(), None
        body = req.openai["body"]  # JSON bytes, as the router forwards them
        async with aclosing(call_app(self.openai_app, "POST", req.openai["path"], body, capture,
                                     headers=[("x-request-id", req.request_id)])) as events:
            async for ev in events:
                if ev.status is not None:
                    status = ev.status
                    media = ev.media_type
                raw += ev.body.decode("utf-8", errors="replace")
                pending_tokens += capture.take_new()
                if t_first is None and capture.token_ids.get(0):
                    t_first = time.monotonic()
                # A streamed call's tokens go out with the event that carries their text (`call_app`
                # gives them together); an unstreamed call has no body until the end.
                if capture.finished or (req.streamed and not ev.body) or not flush(pending_tokens, sent_any, False,
                                                 self.engine.get_num_unfinished_requests(),
                                                 self.pool.stream_chunks_per_step, req.streamed,
                                                 time.monotonic() - t_sent):
                    continue
                ids = capture.take_first_choice()
                yield EngineChunk(text="", token_ids=ids, replica=self.replica, raw=raw, http_status=status,
                                  media_type=media)
                raw, pending_tokens, sent_any, t_sent = "", 0, True, time.monotonic()
        if status is not None and status >= 500 and self._errored():
            raise self._engine_dead("vLLM reports the engine errored")
        n = capture.completion_tokens
        stats = stats_from_output(req.mode, req.k, len(capture.token_ids.get(0, [])), capture.metrics.get(0))
        if capture.finished and not req.request_id.startswith("health-"):
            now = time.monotonic()
            first = t_first if t_first is not None else now
            self._finished.add(now, first - t_start, now - first, n, int(stats.accepted), req.k)
        yield EngineChunk(text="", token_ids=capture.take_first_choice(), replica=self.replica, raw=raw,
                          http_status=status, media_type=media,
                          finish_reason=capture.finish_reason.get(0) or ("stop" if status == 200 else "error"),
                          prompt_tokens=capture.prompt_tokens, completion_tokens=n,
                          stats=stats.to_dict() if capture.finished else None)

    async def openai_simple(self, method: str, path: str, body: bytes = b"", query: str = "") -> dict[str, Any]:
        """A call of vLLM's app that generates nothing (tokenize, detokenize, version, metrics), with
        its JSON body as bytes: {"status", "media_type", "body"}."""
        self._check_alive()
        if self.openai_app is None:
            raise RuntimeError(f"pool {self.pool_name}: this replica has no OpenAI serving layer")
        status, media, chunks = 500, None, []
        async with aclosing(call_app(self.openai_app, method, path, body, Capture(), query=query)) as events:
            async for ev in events:
                if ev.status is not None:
                    status = ev.status
                    media = ev.media_type
                chunks.append(ev.body)
        return {"status": status, "media_type": media, "body": b"".join(chunks).decode("utf-8", errors="replace")}
