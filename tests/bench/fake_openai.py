"""A tiny fake of specserve's HTTP API for tests: real HTTP/1.1 on a loopback port, chunked SSE.

Deterministic: the greedy output of a prompt is a function of the prompt text; speculation emits
`accepted + 1` tokens per step (accepted = K // 2) with a `step_s` sleep per step, so client-side
TTFT and inter-chunk times are measurable. Knobs:
- `diverge`: {config name ("ngram:3", "auto", ...): position} makes that configuration's greedy
  output differ from the reference at `position`;
- `tie_positions`: positions where the reference's top-2 logprobs are a near-tie (gap 0.001;
  elsewhere the gap is 3.0);
- a prompt containing "FAIL429" gets 429 with Retry-After; "SHORT" stops after 5 tokens;
- `stock=True`: a stock vLLM server instead (`stock_k`: its fixed K): /v1/models lists no pools, the
  `specserve` extension is ignored and never sent back; streamed chunks carry `choices[0].token_ids`
  when the body asks `return_token_ids`, after a first role-only chunk, and a last usage-only chunk
  (`choices: []`) when `stream_options.include_usage`; `diverge` uses the name "stock".
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

POOLS = [
    {"name": "ngram", "method": "ngram", "max_k": 6, "modes": ["ngram", "none"]},
    {"name": "draft", "method": "draft_model", "max_k": 4, "modes": ["draft_model"]},
]
TIE_GAP, LARGE_GAP = 0.001, 3.0


def _base(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


class FakeServer:
    def __init__(self, prefill_s: float = 0.03, step_s: float = 0.01, diverge: Optional[dict[str, int]] = None,
                 tie_positions: frozenset = frozenset(), pools: Optional[list] = None, stock: bool = False,
                 stock_k: int = 0):
        self.prefill_s, self.step_s = prefill_s, step_s
        self.stock, self.stock_k = stock, stock_k
        self.diverge = diverge or {}
        self.tie_positions = tie_positions
        self.pools = POOLS if pools is None else pools
        self.requests: list[dict] = []  # bodies received
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                if self.path != "/v1/models":
                    return fake._error(self, 404, "no such path")
                entry = {"id": "fake-model", "object": "model"}
                if fake.pools and not fake.stock:
                    entry["specserve"] = {"pools": fake.pools}
                fake._json(self, 200, {"object": "list", "data": [entry]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.requests.append(body)
                fake._handle(self, body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up: not our concern
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- HTTP helpers ---------------------------------------------------------------------------
    @staticmethod
    def _json(h, status: int, obj: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _error(self, h, status: int, message: str, param: Optional[str] = None, headers=None) -> None:
        self._json(h, status, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": "x"}}, headers)

    # -- the model ------------------------------------------------------------------------------
    def reference_tokens(self, text: str, n: int) -> list[int]:
        b = _base(text)
        return [10 + (b + 7 * i) % 997 for i in range(n)]

    def _handle(self, h, body: dict) -> None:
        chat = h.path == "/v1/chat/completions"
        if h.path not in ("/v1/chat/completions", "/v1/completions"):
            return self._error(h, 404, "no such path")
        if body.get("model") not in (None, "fake-model"):
            return self._error(h, 404, f"model: {body['model']!r} is not served", "model")
        text = body["messages"][-1]["content"] if chat else body.get("prompt")
        if not text:
            return self._error(h, 400, "exactly one of `prompt` and `messages` must be given", "prompt")
        if "FAIL429" in text:
            return self._error(h, 429, "overloaded", None, {"Retry-After": "2"})
        ext = {} if self.stock else body.get("specserve") or {}
        spec = ext.get("speculative")
        if self.stock:
            mode, k, decided_by, name = "none" if not self.stock_k else "ngram", self.stock_k, "stock", "stock"
        elif spec is None:
            mode, k, decided_by, name = "ngram", 3, "policy", "auto"
        else:
            mode = spec["mode"]
            k = 0 if mode == "none" else int(spec.get("k") or 2)
            decided_by, name = "request", "none" if mode == "none" else f"{mode}:{k}"
        n = 5 if "SHORT" in text else int(body.get("max_tokens", 16))
        temp = float(body.get("temperature") or 0.0)
        tokens = self.reference_tokens(text + (f"|{body.get('seed')}" if temp > 0 else ""), n)
        if temp == 0 and name in self.diverge and self.diverge[name] < n:
            tokens[self.diverge[name]] += 1
        top_n = (body.get("top_logprobs") if chat else body.get("logprobs")) if body.get("logprobs") else None
        logprobs = None
        if top_n:
            logprobs = [{str(t): -0.1, str(t + 1): -0.1 - (TIE_GAP if i in self.tie_positions else LARGE_GAP)}
                        for i, t in enumerate(tokens)]
        accepted_per_step = k // 2
        steps, chunks, i = 0, [], 0
        while i < n:
            take = min(accepted_per_step + 1, n - i)
            chunks.append(tokens[i:i + take])
            i += take
            steps += 1
        accepted = n - steps
        stats = {"request_id": ext.get("request_id") or "req-fake", "pool": "draft" if mode == "draft_model" else "ngram",
                 "replica": "r0", "mode": mode, "k": k, "decided_by": decided_by, "workload_class": "chat",
                 "steps": steps, "drafted": steps * k, "accepted": accepted,
                 "acceptance_length": round(1 + accepted / steps, 4) if steps else 1.0,
                 "acceptance_rate": round(accepted / (steps * k), 4) if k and steps else 0.0,
                 "accepted_per_position": [steps] * accepted_per_step, "token_ids": tokens,
                 "ttft_s": self.prefill_s, "latency_s": self.prefill_s + steps * self.step_s}
        if logprobs is not None:
            stats["logprobs"] = logprobs
        finish = "stop" if n < int(body.get("max_tokens", 16)) else "length"
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": n, "total_tokens": len(text.split()) + n}
        content = "".join(f" t{t}" for t in tokens)
        if not body.get("stream"):
            time.sleep(self.prefill_s + steps * self.step_s)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                      if chat else {"index": 0, "text": content, "finish_reason": finish})
            return self._json(h, 200, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                       "model": "fake-model", "choices": [choice], "usage": usage,
                                       **({} if self.stock else {"specserve": stats})})
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(obj) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        if self.stock:
            return self._stream_stock(h, body, chat, chunks, finish, usage, send)

        def chunk(toks: list[int], fin: Optional[str], ext_obj: dict) -> dict:
            piece = "".join(f" t{t}" for t in toks)
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": fin} if chat
                      else {"index": 0, "text": piece, "finish_reason": fin})
            obj = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                   "choices": [choice], "specserve": ext_obj}
            if fin:
                obj["usage"] = usage
            return obj

        time.sleep(self.prefill_s)
        for j, toks in enumerate(chunks):
            if j:
                time.sleep(self.step_s)
            if j == len(chunks) - 1:  # the last chunk: its new tokens, finish reason, usage and the stats
                final = {k: v for k, v in stats.items() if k != "token_ids"}
                send(chunk(toks, finish, {**final, "token_ids": toks}))
            else:
                send(chunk(toks, None, {"token_ids": toks}))
        send("[DONE]")
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    def _stream_stock(self, h, body: dict, chat: bool, chunks: list[list[int]], finish: str, usage: dict,
                      send) -> None:
        """vLLM's stream: a role-only first chunk, token chunks (token_ids when asked), then usage."""
        with_ids = bool(body.get("return_token_ids"))

        def chunk(toks: list[int], fin: Optional[str], first: bool = False) -> dict:
            piece = "".join(f" t{t}" for t in toks)
            if chat:
                choice = {"index": 0, "delta": {"role": "assistant", "content": ""} if first else {"content": piece},
                          "finish_reason": fin}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": fin}
            if with_ids and not first:
                choice["token_ids"] = toks
            return {"id": "chatcmpl-stock", "object": "chat.completion.chunk" if chat else "text_completion",
                    "choices": [choice], "model": "fake-model"}

        time.sleep(self.prefill_s)
        if chat:
            send(chunk([], None, first=True))
        for j, toks in enumerate(chunks):
            if j:
                time.sleep(self.step_s)
            send(chunk(toks, finish if j == len(chunks) - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            send({"id": "chatcmpl-stock", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        send("[DONE]")
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()
