"""vLLM's own OpenAI server inside an engine replica: its FastAPI app over the replica's `AsyncLLM`,
called in process (ASGI), never listening on a socket.

Every protocol feature (chat and completions, tools and tool parsers, structured outputs, logprobs,
penalties, `n`, streaming usage, tokenize, errors) is vLLM's; specserve adds only the per-request
speculation, in `SamplingParams.extra_args` (read by the engine's scheduler, as vLLM's request
field `vllm_xargs` would set them), and reads back what the engine did. The router sends only the paths of `SERVED_PATHS` here.

Words: a *call* is one HTTP request run through the app; its `Capture` holds what the engine gave
vLLM's serving layer for it (token ids per choice, prompt length, finish, spec-decode metrics),
recorded by `CapturingEngine` in the call's context.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from argparse import Namespace
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from cluster.ops.models import resolve_server_args

# The paths of vLLM's app that the router forwards (anything else of the app, e.g. its admin and
# dev routes, is never reachable from outside).
SERVED_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/version", "/metrics")

DISCONNECT_GRACE_S = 5.0  # how long an abandoned call's app may take to notice the disconnect and end

_CAPTURE: contextvars.ContextVar[Optional["Capture"]] = contextvars.ContextVar("specserve_capture", default=None)


@dataclass
class Capture:
    """What the engine produced for one call, per choice index (vLLM's `CompletionOutput.index`)."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reason: dict[int, Optional[str]] = field(default_factory=dict)
    metrics: dict[int, Any] = field(default_factory=dict)  # RequestSpecDecodeMetrics of a finished choice
    prompt_tokens: int = 0
    finished: int = 0  # engine requests of this call that finished
    new_tokens: int = 0  # tokens of any choice since `take_new` last ran
    sent_first: int = 0  # tokens of choice 0 already handed out by `take_first_choice`
    notify: Optional[Callable[[], None]] = None  # called after every output (the call's loop wakes up)
    extra_args: dict[str, Any] = field(default_factory=dict)  # added to each engine request's SamplingParams.extra_args

    def add(self, out: Any, cumulative: bool = False) -> None:
        """One RequestOutput: DELTA (each output's token ids are new ones) or CUMULATIVE."""
        for c in out.outputs:
            ids = self.token_ids.setdefault(c.index, [])
            new = list(c.token_ids)[len(ids):] if cumulative else list(c.token_ids)
            ids.extend(new)
            self.new_tokens += len(new)
            if c.finish_reason is not None:
                self.finish_reason[c.index] = c.finish_reason
                self.metrics[c.index] = getattr(c, "spec_decode_metrics", None)
        if out.finished:
            self.finished += 1
            self.prompt_tokens = len(out.prompt_token_ids or [])
        if self.notify is not None:
            self.notify()

    def take_first_choice(self) -> list[int]:
        """Token ids of choice 0 not handed out before."""
        ids = self.token_ids.get(0, [])
        new, self.sent_first = ids[self.sent_first:], len(ids)
        return new

    def take_new(self) -> int:
        n, self.new_tokens = self.new_tokens, 0
        return n

    @property
    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids.values())


class CapturingEngine:
    """The replica's AsyncLLM as vLLM's serving layer sees it: every attribute is the engine's;
    `generate` adds the call's speculation to the request's `SamplingParams.extra_args` (after vLLM
    validated the body, which therefore stays the caller's) and records each output into the call's
    `Capture`."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, sampling_params: Any, *args: Any, **kwargs: Any):
        """The engine's outputs, recorded. A call that wants only the final output (FINAL_ONLY, a
        response that is not streamed) of one choice is asked for CUMULATIVE outputs, which end in
        the same final output, so that its progress (the first token) is seen; only the final one is
        passed on."""
        from vllm.sampling_params import RequestOutputKind

        capture = _CAPTURE.get()
        # n > 1 stays FINAL_ONLY: only then does vLLM gather the n choices into its final output.
        final_only = (capture is not None and getattr(sampling_params, "n", 1) == 1
                      and getattr(sampling_params, "output_kind", None) == RequestOutputKind.FINAL_ONLY)
        if final_only:
            sampling_params.output_kind = RequestOutputKind.CUMULATIVE
        if capture is not None and capture.extra_args:  # the router's decision, over the caller's vllm_xargs
            sampling_params.extra_args = {**(sampling_params.extra_args or {}), **capture.extra_args}
        gen = self._engine.generate(prompt, sampling_params, *args, **kwargs)
        try:
            async for out in gen:
                if capture is not None:
                    capture.add(out, cumulative=final_only)
                if not final_only or out.finished:
                    yield out
        finally:
            await gen.aclose()


def server_args(model_path: str, served_name: str, extra: Sequence[str] = (), pool_name: str = "?") -> Namespace:
    """vLLM's own server arguments (`vllm serve`'s parser) for a replica: the model and its served
    name, then the pool's `openai_server_args` (chat template, tool-call parser, ...), with a
    relative `--chat-template` path read from the repository root. A bad argument fails naming the
    pool's field."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    extra = resolve_server_args(list(extra))
    parser = make_arg_parser(FlexibleArgumentParser(prog="specserve-engine", exit_on_error=False))
    try:
        args = parser.parse_args(["--model", model_path, "--served-model-name", served_name, *extra])
        validate_parsed_serve_args(args)
    except (SystemExit, Exception) as e:  # argparse exits on a bad option: name the field instead
        raise ValueError(f"pools.{pool_name}.openai_server_args: {extra}: {e}") from None
    return args


async def build_openai_app(engine: Any, args: Namespace) -> Any:
    """vLLM's FastAPI app with its state initialised over `engine` (wrapped in `CapturingEngine`)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    supported = await engine.get_supported_tasks()
    app = build_app(args, supported, engine.model_config)
    await init_app_state(CapturingEngine(engine), app.state, args, supported)
    # vLLM's error handler asks its uvicorn server to exit when the engine is dead; here no server
    # runs, and the replica's own death handling retires it (`deployments.engine_death`).
    app.state.server = SimpleNamespace(should_exit=False)
    return app


@dataclass
class AsgiEvent:
    """One message of the app's answer: its start (status, headers) or a piece of its body."""

    status: Optional[int] = None
    headers: Optional[list[tuple[str, str]]] = None
    body: bytes = b""
    more: bool = True
    progress: bool = False  # no message: the engine gave the call an output (see `Capture`)

    @property
    def media_type(self) -> Optional[str]:
        """The answer's Content-Type, on the event that carries its start."""
        return next((v for k, v in self.headers or () if k.lower() == "content-type"), None)


async def call_app(app: Any, method: str, path: str, body: bytes, capture: Capture,
                   headers: Sequence[tuple[str, str]] = (), query: str = "") -> AsyncIterator[AsgiEvent]:
    """Run one HTTP request through the ASGI `app` in process and yield its answer as it comes.
    Closing the iterator early is a client disconnect, which aborts the request in vLLM."""
    queue: asyncio.Queue = asyncio.Queue()
    sent = False
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers)]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": hdrs, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "state": {}}
    disconnect = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(None)

    capture.notify = lambda: queue.put_nowait({"type": "specserve.progress"})
    token = _CAPTURE.set(capture)
    try:
        task = asyncio.get_running_loop().create_task(run())  # copies the context: the capture goes along
    finally:
        _CAPTURE.reset(token)
    try:
        ended = False
        while not ended:
            # What the app sent together comes as one event: an engine output's progress, then the
            # SSE events vLLM made of it (a stream's first: its role, then its text), so that the
            # caller never sends a token apart from its text.
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            ended = None in batch
            batch = [m for m in batch if m is not None]
            if batch:
                yield merged(batch)
        await task  # the app's own failure, if any, surfaces here
    finally:
        if not task.done():
            # The caller went away: tell the app, whose own disconnect handling aborts the request in
            # vLLM (cancelling the handler's task alone would not: vLLM runs the handler in a task of
            # its own, `with_cancellation`). Cancel it only if it is still running after a grace.
            disconnect.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=DISCONNECT_GRACE_S)
            except BaseException:  # noqa: BLE001 - the app's failure or the grace's end: cancel below
                pass
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - cancelled on purpose
                    pass


def merged(messages: list[dict]) -> AsgiEvent:
    """ASGI messages sent one after another as one event: the start's status and headers, the
    bodies joined, progress if any was progress.

    >>> merged([{"type": "specserve.progress"}, {"type": "http.response.body", "body": b"a", "more_body": True},
    ...         {"type": "http.response.body", "body": b"b", "more_body": True}])
    AsgiEvent(status=None, headers=None, body=b'ab', more=True, progress=True)
    """
    ev = AsgiEvent(progress=any(m["type"] == "specserve.progress" for m in messages))
    for m in messages:
        if m["type"] == "http.response.start":
            ev.status = int(m["status"])
            ev.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in m.get("headers", [])]
        elif m["type"] == "http.response.body":
            ev.body += m.get("body", b"")
            ev.more = bool(m.get("more_body", False))
    return ev


# -- the response, with specserve's object added ------------------------------------------------

SSE_DONE = "data: [DONE]"


def split_sse(buffer: str) -> tuple[list[str], str]:
    """Complete SSE events of `buffer` (each without its blank-line terminator) and the rest.

    >>> split_sse('data: {"a":1}\\n\\ndata: [DONE]\\n\\ndata: {')
    (['data: {"a":1}', 'data: [DONE]'], 'data: {')
    """
    parts = buffer.split("\n\n")
    return parts[:-1], parts[-1]


def with_object(event: str, key: str, value: Any) -> str:
    """The SSE event `event` ("data: {json}") with `key` set in its JSON object; an event that is
    not a JSON object is returned as it is.

    >>> with_object('data: {"choices":[]}', "specserve", {"k": 2})
    'data: {"choices":[],"specserve":{"k":2}}'
    >>> with_object('data: [DONE]', "specserve", {})
    'data: [DONE]'
    """
    if not event.startswith("data: "):
        return event
    try:
        obj = json.loads(event[len("data: "):])
    except ValueError:
        return event
    if not isinstance(obj, dict):
        return event
    obj[key] = value
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_with_object(body: bytes, key: str, value: Any) -> bytes:
    """A JSON object body with `key` set; anything else unchanged.

    >>> json_with_object(b'{"id":"x"}', "specserve", {"k": 1})
    b'{"id":"x","specserve":{"k":1}}'
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict):
        return body
    obj[key] = value
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def add_to_stream_tail(tail: str, key: str, value: Any) -> str:
    """The held-back end of an SSE stream (its last events, `data: [DONE]` among them) with `key`
    set in the last JSON event before `[DONE]` (vLLM's last chunk: finish reason or usage).

    >>> add_to_stream_tail('data: {"a":1}\\n\\ndata: [DONE]\\n\\n', "s", 2)
    'data: {"a":1,"s":2}\\n\\ndata: [DONE]\\n\\n'
    """
    events, rest = split_sse(tail)
    for i in range(len(events) - 1, -1, -1):
        if events[i].startswith("data: {"):
            events[i] = with_object(events[i], key, value)
            break
    return "".join(e + "\n\n" for e in events) + rest
