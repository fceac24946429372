"""Hostile callers and a misbehaving Redis against the real cluster, each probe asserting the safe
behaviour:

- gRPC messages past api.limits.grpc_max_message_bytes (8 MiB) get RESOURCE_EXHAUSTED at once;
- GetTuning of an unknown model is NOT_FOUND, and many distinct (long) names grow no cache;
- HTTP bodies past api.limits.max_body_bytes are 413 (declared or chunked), a prompt past
  api.limits.max_prompt_chars in all its messages is 413 / INVALID_ARGUMENT naming the limit, and a
  non-JSON content type is 415;
- poisoned autoscale records (1e999, NaN, deep nesting, wrong types) neither fail requests nor
  the status page (clusters with a goodput-autoscaled pool);
- Redis refusing every write (`maxmemory 1`) fails no request, and tuning writes land once it
  accepts them again;
- a burst of requests that would poison the tuner (the caller's K on text that rejects, ignore_eos,
  temperature 2.0, a caller's class the classifier disagrees with) leaves GetTuning's cells of the
  class unchanged, while one ordinary request of the class moves them;
- a request whose caller gives up (a gRPC deadline, an HTTP client that hangs up) is aborted in
  vLLM: the engine's unfinished count falls back at once, not when the text would end;
- 300 connections that sent their headers and one byte of a 100 kB body are answered 408 and closed
  at api.limits.body_read_timeout_s, while a whole request still goes through;
- throughout, the router replica (and Ray's proxy, with api.door ray_proxy) stay within
  MEMORY_BOUND_MIB of resident memory growth (measured with psutil; a cluster this test started
  must be found on this machine).

Item 1 (the drafter wire) needs a cluster with a drafter deployment: its probes against the live
drafter are in tests/e2e/test_remote_drafter.py (`test_hostile_clients_neither_use_nor_stop_the_drafter`).

Against the dev cluster: SPECSERVE_TEST_ATTACH=/tmp/dev/cluster.yaml pytest -s tests/e2e/test_hostile.py
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
import redis

from cluster.autoscale.ray_policy import record_key
from cluster.config import parse_config
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.engine

MIB = 1 << 20
MEMORY_BOUND_MIB = 200  # resident growth of the router replica and of the proxy over the whole module
PREFIX = "specserve:v3"
MODEL = "smollm2-135m"


# -- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limits(cluster):
    return parse_config(cluster.raw).api.limits


@pytest.fixture(scope="module")
def channel(cluster):
    ch = grpc.insecure_channel(cluster.grpc_target, options=[("grpc.max_send_message_length", 64 * MIB),
                                                              ("grpc.max_receive_message_length", 64 * MIB)])
    grpc.channel_ready_future(ch).result(timeout=60)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.SpecServeStub(channel)


def _processes(app: str) -> dict[str, object]:
    """The router replica of application `app`, and the proxy when this machine runs one Ray
    cluster only, found by Ray's process titles (`ray::ServeReplica:<app>:router`)."""
    import psutil

    routers, proxies = [], []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(f"ray::ServeReplica:{app}:router"):
            routers.append(p)
        elif cmd.startswith("ray::ProxyActor"):
            proxies.append(p)
    return {**({"router": routers[0]} if routers else {}), **({"proxy": proxies[0]} if len(proxies) == 1 else {})}


def _rss_mib(procs: dict) -> dict[str, float]:
    return {name: p.memory_info().rss / MIB for name, p in procs.items()}


@pytest.fixture(scope="module", autouse=True)
def memory_bound(cluster):
    """Resident memory of the router replica and the proxy before and after every probe here."""
    procs = _processes(cluster.raw["name"])
    assert procs or cluster.proc is None, "the router replica of the cluster this test started is not found"
    before = _rss_mib(procs)
    yield
    if not procs:
        print("[hostile] router / proxy processes not on this machine: memory not measured")
        return
    after = _rss_mib(procs)
    print(f"[hostile] resident MiB before {before}, after {after}")
    for name in procs:
        assert after[name] - before[name] < MEMORY_BOUND_MIB, (name, before[name], after[name])


def _chat(url: str, text: str = "Say hi.", max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300,
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})


def _gen(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=1))


# -- item 2: gRPC message size -------------------------------------------------------------------------

def test_grpc_messages_past_the_bound_are_resource_exhausted_at_once(stub, limits):
    assert limits.grpc_max_message_bytes == 8 * MIB
    for _ in range(10):  # ~90 MiB offered in all: none of it may stay in the proxy
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(_gen("x" * (9 * MIB)), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert time.monotonic() - t0 < 10
    with pytest.raises(grpc.RpcError) as e:  # under the bound: our own validation answers
        stub.Generate(_gen("x" * (7 * MIB)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()


# -- item 3: GetTuning -----------------------------------------------------------------------------------

def test_get_tuning_of_an_unknown_model_is_not_found_and_grows_nothing(stub):
    ok = stub.GetTuning(pb.GetTuningRequest(model=MODEL), timeout=30)
    assert all(e.model == MODEL for e in ok.entries)
    assert stub.GetTuning(pb.GetTuningRequest(), timeout=30) is not None
    for i in range(40):  # 40 distinct 32 KiB names: a cache per name would hold hundreds of MiB
        with pytest.raises(grpc.RpcError) as e:
            stub.GetTuning(pb.GetTuningRequest(model=f"{i}-" + "m" * (32 << 10)), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model" in e.value.details()
        assert len(e.value.details()) < 1000  # the name is not echoed back whole


# -- item 4: total request size, body size, content type ------------------------------------------------

def test_http_body_past_the_limit_is_413_declared_or_chunked(cluster, limits):
    url = f"{cluster.http_url}/v1/chat/completions"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (limits.max_body_bytes + 1)}]}).encode()
    for _ in range(5):
        r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "body" and "api.limits.max_body_bytes" in err["message"], err

    def chunks():  # no Content-Length: the router stops reading at the limit
        for i in range(0, len(big), 64 << 10):
            yield big[i:i + (64 << 10)]
    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text


def test_total_prompt_size_is_capped_at_both_doors(cluster, stub, limits):
    n = limits.max_prompt_chars // 2048 + 1  # messages of 2 Ki characters, each far within its own limit
    assert n <= 256
    msgs = [{"role": "user", "content": "y" * 2048}] * n
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "api.limits.max_prompt_chars" in err["message"]
    assert str(limits.max_prompt_chars) in err["message"]
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="z" * (limits.max_prompt_chars // 2 + 1))] * 2,
                             sampling=pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in e.value.details() and "api.limits.max_prompt_chars" in e.value.details()


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                   None])
def test_non_json_content_types_are_415(cluster, ctype):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["param"] == "content-type"
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


# -- item 6: poisoned autoscale records ---------------------------------------------------------------------

POISON = [b'{"target": 1e999, "time_unix_s": %d}', b'{"target": NaN, "time_unix_s": %d}',
          b"[" * 100_000 + b"]" * 100_000, b'{"target": "2", "time_unix_s": %d}', b"1e999",
          b'{"target": 2, "time_unix_s": %d, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"]


def test_poisoned_autoscale_records_fail_no_request(cluster):
    pools = [n for n, p in cluster.raw["pools"].items() if (p.get("autoscaling") or {}).get("policy", "goodput")
             == "goodput" and p.get("autoscaling")]
    if not pools:
        pytest.skip("no pool of this cluster is autoscaled by the goodput policy (the router reads no records)")
    client = redis.Redis.from_url(cluster.redis_url)
    keys = [record_key(PREFIX, p) for p in pools]
    saved = {k: client.get(k) for k in keys}
    try:
        for raw in POISON:
            value = raw % int(time.time()) if b"%d" in raw else raw
            for k in keys:
                client.set(k, value, ex=60)
            time.sleep(2)  # the router reads the records every second
            assert _chat(cluster.http_url).status_code == 200
            status = httpx.get(f"{cluster.http_url}/v1/specserve/status", timeout=30)
            assert status.status_code == 200, status.text  # valid JSON: no NaN or Infinity passed through
            for rec in status.json().get("autoscale", {}).values():  # the policy may have republished by now
                assert isinstance(rec["target"], int)
    finally:
        for k, v in saved.items():
            client.delete(k) if v is None else client.set(k, v, ex=60)


# -- item 8: Redis refusing writes ---------------------------------------------------------------------------

def _tuning_requests(client: redis.Redis) -> int:
    total = 0
    for k in client.scan_iter(f"{PREFIX}:{MODEL}:*"):
        try:
            total += int(client.hget(k, "requests") or 0)
        except redis.ResponseError:  # not a hash (another probe's poison)
            pass
    return total


def test_redis_out_of_memory_fails_no_request_and_writes_resume(cluster, stub):
    client = redis.Redis.from_url(cluster.redis_url)
    limit = client.config_get("maxmemory")["maxmemory"]
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    assert _chat(cluster.http_url).status_code == 200
    time.sleep(2)  # flushed
    before = _tuning_requests(client)
    client.config_set("maxmemory-policy", "noeviction")  # refuse writes instead of evicting the tuning state
    client.config_set("maxmemory", 1)
    try:
        for i in range(3):
            r = _chat(cluster.http_url, f"Say hi {i}.")
            assert r.status_code == 200, r.text
        time.sleep(3)  # several flushes refused with OOM
        assert _tuning_requests(client) == before
    finally:
        client.config_set("maxmemory", limit)
        client.config_set("maxmemory-policy", policy)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _tuning_requests(client) < before + 3:
        time.sleep(0.5)
    assert _tuning_requests(client) >= before + 3  # the batch kept during the refusal landed
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not stub.GetTuning(pb.GetTuningRequest(model=MODEL), timeout=30).redis_ok:
        time.sleep(0.5)
    assert stub.GetTuning(pb.GetTuningRequest(model=MODEL), timeout=30).redis_ok


# -- item 5: tuning poisoning through the front door --------------------------------------------------------

TRANSLATION = "Translate German to English: Der Hund spielt im Garten mit dem Ball."
CODE = "Write a Python function that reverses a list."


def _class_cells(stub, wclass: str) -> dict[tuple[str, str], tuple[int, float]]:
    """GetTuning's cells of `wclass` that hold measurements: (mode, load bucket) -> (samples,
    acceptance length). A cell with no samples carries only the router's incumbent K, which any
    routed request may set (the policy's own choice, not the caller's data)."""
    out = stub.GetTuning(pb.GetTuningRequest(model=MODEL), timeout=30)
    return {(e.mode, e.load_bucket): (e.samples, round(e.acceptance_length, 4)) for e in out.entries
            if e.workload_class == wclass and e.samples > 0}


def _hostile(url: str, body: dict) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={"prompt": TRANSLATION, "max_tokens": 24, **body})
    assert r.status_code == 200, r.text


def test_a_poisoning_burst_leaves_the_class_cells_unchanged(cluster, stub):
    url = cluster.http_url
    _hostile(url, {})  # the class has cells (and this client's requests are flushed)
    time.sleep(3)  # flushed (0.5 s) and read back (1 s) by the router
    before = _class_cells(stub, "translation")
    assert before, "an ordinary translation request made no cell"
    for _ in range(6):
        _hostile(url, {"specserve": {"speculative": {"mode": "ngram", "k": 6}}})  # the caller's K
        _hostile(url, {"ignore_eos": True, "max_tokens": 64})  # past the end of the answer
        _hostile(url, {"temperature": 2.0})  # hot sampling
        _hostile(url, {"prompt": CODE, "specserve": {"workload_class": "translation"}})  # code filed as translation
    time.sleep(3)
    assert _class_cells(stub, "translation") == before
    # The observable moves for ordinary traffic (within this client's budget: router.teaching).
    _hostile(url, {})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _class_cells(stub, "translation") == before:
        time.sleep(1)
    after = _class_cells(stub, "translation")
    assert sum(n for n, _ in after.values()) == sum(n for n, _ in before.values()) + 1, (before, after)


# -- item 10: a caller's deadline aborts the request in vLLM -------------------------------------------------

# Long text: greedy counting goes on for many hundreds of tokens (HTTP adds ignore_eos; gRPC has no
# such field). K = 0 goes to the pool with the cheapest proposer, ngram here.
LONG = {"prompt": "Count from 1 to 2000, separated by commas: 1, 2, 3,", "max_tokens": 1500,
        "speculative": {"mode": "none"}}


def _unfinished(url: str, pool: str = "ngram") -> float:
    status = httpx.get(f"{url}/v1/specserve/status", timeout=30).json()
    return float(status["pools"][pool]["engine"]["unfinished"])


def _wait_idle(url: str, within_s: float) -> float:
    """Seconds until the pool's engine has no unfinished request (fails after `within_s`)."""
    t0 = time.monotonic()
    while _unfinished(url) > 0:
        assert time.monotonic() - t0 < within_s, f"engine still busy after {within_s} s: the request was not aborted"
        time.sleep(0.25)
    return time.monotonic() - t0


def test_a_grpc_deadline_aborts_the_request_in_vllm(cluster, stub):
    _wait_idle(cluster.http_url, 120)
    req = pb.GenerateRequest(prompt=LONG["prompt"], speculative=pb.SpeculativeOverride(mode="none"),
                             sampling=pb.SamplingParams(max_tokens=LONG["max_tokens"]))
    for call in (lambda: stub.Generate(req, timeout=2), lambda: list(stub.GenerateStream(req, timeout=2))):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 10
        # 1500 tokens take a minute or more on a CPU: an engine idle well before that aborted it
        # (the bound leaves room for a machine busy with other work).
        assert _wait_idle(cluster.http_url, 25) < 25


def test_an_http_client_that_hangs_up_aborts_the_request_in_vllm(cluster):
    _wait_idle(cluster.http_url, 120)
    body = {"prompt": LONG["prompt"], "max_tokens": LONG["max_tokens"], "ignore_eos": True,
            "specserve": {"speculative": LONG["speculative"]}}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s and closes its connection
        httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    assert time.monotonic() - t0 < 10
    assert _wait_idle(cluster.http_url, 25) < 25


def test_half_open_bodies_are_closed_at_the_deadline_and_hold_no_place(cluster):
    """The slow-body probe: 300 connections send headers and 1 byte of a 100 kB body. A whole
    request sent meanwhile is served; every half-open one is answered 408 naming the body and
    closed within api.limits.body_read_timeout_s (+ 5 s); the router's memory stays flat
    (the module's bound)."""
    import asyncio

    limits = parse_config(cluster.raw).api.limits
    if parse_config(cluster.raw).api.door != "router":
        pytest.skip("the body deadline is the router door's (api.door ray_proxy: Ray's proxy reads bodies)")
    port = cluster.raw["api"]["http_port"]

    async def probe():
        held = []
        for _ in range(300):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000\r\n\r\n{")
            held.append((reader, writer))
        await asyncio.gather(*(w.drain() for _, w in held))
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{cluster.http_url}/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        whole_s = time.monotonic() - t0

        async def closed(reader):
            answer = await reader.read()  # to EOF
            return answer, time.monotonic() - t0
        answers = await asyncio.wait_for(asyncio.gather(*(closed(r) for r, _ in held)),
                                         limits.body_read_timeout_s + 30)
        for _, w in held:
            w.close()
        return r, whole_s, answers

    r, whole_s, answers = asyncio.run(probe())
    assert r.status_code == 200 and whole_s < limits.body_read_timeout_s, (r.text, whole_s)
    closed_s = sorted(dt for _, dt in answers)
    print(f"[hostile] half-open bodies: a whole request in {whole_s:.2f} s; 300 closed after "
          f"{closed_s[0]:.1f}-{closed_s[-1]:.1f} s (deadline {limits.body_read_timeout_s:g} s)")
    assert all(a.startswith(b"HTTP/1.1 408") and b"body_read_timeout_s" in a for a, _ in answers), answers[0][0][:200]
    assert closed_s[-1] < limits.body_read_timeout_s + 5


def test_requests_past_the_routers_deadline_are_504_and_aborted(cluster):
    """Sixteen 1900-token streams on the CPU take minutes; each is cut at router.request_timeout_s
    with 504 naming it, and the engine is idle soon after. (Hardware that finishes them in time
    cannot show this: skipped.)"""
    import asyncio

    limit_s = parse_config(cluster.raw).router.request_timeout_s
    _wait_idle(cluster.http_url, 120)
    body = {"prompt": LONG["prompt"], "max_tokens": 1900, "ignore_eos": True,
            "specserve": {"speculative": LONG["speculative"]}}

    async def run():
        async with httpx.AsyncClient(timeout=limit_s + 60) as client:
            async def one():
                r = await client.post(f"{cluster.http_url}/v1/completions", json=body)
                return r, time.monotonic()
            return await asyncio.gather(*[one() for _ in range(16)])

    t0 = time.monotonic()
    results = asyncio.run(run())
    cut = [(r, t - t0) for r, t in results if r.status_code == 504]
    assert all(r.status_code in (200, 504) for r, _ in results), [r.text[:200] for r, _ in results]
    if not cut:
        pytest.skip(f"every 1900-token request finished within {limit_s:g} s here")
    for r, dt in cut:
        err = r.json()["error"]
        assert err["code"] == "deadline_exceeded" and "router.request_timeout_s" in err["message"], err
        assert limit_s - 1 <= dt <= limit_s + 15, dt
    assert _wait_idle(cluster.http_url, 15) < 15
