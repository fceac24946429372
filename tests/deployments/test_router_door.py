"""The router replica's own doors (`deployments/router_door.py`) on real sockets: uvicorn and
grpc.aio on free loopback ports, real HTTP and gRPC clients, the router with test-double engine
handles (as in test_router.py). What Ray's proxy did for the router must hold here: answers, the
bound on calls (503 / UNAVAILABLE with a retry hint), cancellation when the client goes away,
status codes and details on gRPC, undecodable messages refused, reflection."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.router_door import Doors, listening_socket
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc
from tests.deployments.test_router import BODY, FINAL, FakeCall, StallingCall, make_router


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doors(make_call, ongoing=4, queued=0, **limits):
    router, handles = make_router(make_call)
    cfg = router.config
    cfg.api.host, cfg.api.http_port, cfg.api.grpc_port = "127.0.0.1", _free_port(), _free_port()
    cfg.router.max_ongoing_requests, cfg.router.max_queued_requests = ongoing, queued
    for name, value in limits.items():
        setattr(cfg.api.limits, name, value)
    refused = []
    return Doors(router, cfg, on_refused=refused.append), router, handles, refused


async def _until(predicate, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_http_answers_through_the_router():
    async def main():
        doors, _, handles, refused = _doors(lambda: FakeCall([FINAL]))
        await doors.open()
        try:
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{doors.config.api.http_port}/v1/chat/completions",
                                      json=BODY)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == "ok"
            assert body["specserve"]["mode"] == "ngram" and body["specserve"]["replica"] == "r2"
            assert len(handles["ngram"].calls) == 1
        finally:
            await doors.close(1)
    run(main())


def test_http_past_the_bound_is_503_with_retry_after_and_counted():
    async def main():
        doors, _, handles, refused = _doors(lambda: StallingCall(), ongoing=1, queued=0)
        await doors.open()
        url = f"http://127.0.0.1:{doors.config.api.http_port}/v1/chat/completions"
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.ensure_future(client.post(url, json=BODY))
                await _until(lambda: doors.admission.running == 1)
                r = await client.post(url, json=BODY)
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["error"]["code"] == "unavailable"
                assert doors.admission.refused == 1 and refused == ["busy"]
                first.cancel()
            # the held call's client went away: the router cancelled its engine call, the place is free
            await _until(lambda: doors.admission.running == 0)
            await _until(lambda: handles["ngram"].calls[0].cancelled)
        finally:
            await doors.close(1)
    run(main())


def test_a_client_that_hangs_up_before_the_answer_cancels_the_engine_call():
    async def main():
        doors, router, handles, refused = _doors(lambda: StallingCall())
        await doors.open()
        try:
            raw = json.dumps(BODY).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", doors.config.api.http_port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         + f"content-length: {len(raw)}\r\n\r\n".encode() + raw)
            await writer.drain()
            await _until(lambda: len(handles["ngram"].calls) == 1)
            writer.close()
            await _until(lambda: handles["ngram"].calls[0].cancelled)
            await _until(lambda: doors.admission.running == 0)
            assert router.inflight == {"ngram": 0, "draft": 0}
        finally:
            await doors.close(1)
    run(main())


async def _half_open(port: int, body_bytes: int = 100_000):
    """A connection that sent its headers and one byte of a `body_bytes` body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {body_bytes}\r\n\r\n{{".encode())
    await writer.drain()
    return reader, writer


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes():
    """Trickled bodies hold connections, not the router's places: with one place, a whole request
    sent while twenty half-open ones wait is served."""
    async def main():
        doors, router, handles, refused = _doors(lambda: FakeCall([FINAL]), ongoing=1, body_read_timeout_s=1.5)
        await doors.open()
        port = doors.config.api.http_port
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            held = [await _half_open(port) for _ in range(20)]
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)
            assert r.status_code == 200 and loop.time() - t0 < 1.5
            assert len(handles["ngram"].calls) == 1  # only the whole request reached an engine
            answers = await asyncio.gather(*(reader.read() for reader, _ in held))  # read() ends at EOF: closed
            assert loop.time() - t0 < 6
            for answer in answers:
                assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
                assert b'"param":"body"' in answer.replace(b" ", b"")
            assert refused == ["body_timeout"] * 20 and doors.admission.running == 0
        finally:
            await doors.close(1)
    run(main())


def test_one_address_holds_at_most_its_cap_of_connections():
    async def main():
        doors, _, _, refused = _doors(lambda: FakeCall([FINAL]), max_connections_per_client=3)
        await doors.open()
        port = doors.config.api.http_port
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            await _until(lambda: doors.per_client.open.get("127.0.0.1") == 3)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 5)  # answered and closed at once
            assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: " in answer.lower(), answer
            assert b"max_connections_per_client" in answer and refused == ["per_client"]
            writer.close()
            held[0][1].close()  # one closes: a new one is let in and served
            await _until(lambda: doors.per_client.open.get("127.0.0.1") == 2)
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)
            assert r.status_code == 200
            for _, w in held[1:]:
                w.close()
            await _until(lambda: doors.per_client.open == {})
        finally:
            await doors.close(1)
    run(main())


def _grpc(doors):
    return grpc.aio.insecure_channel(f"127.0.0.1:{doors.config.api.grpc_port}")


def test_grpc_generate_list_and_health():
    async def main():
        doors, _, handles, refused = _doors(lambda: FakeCall([FINAL]))
        await doors.open()
        try:
            async with _grpc(doors) as channel:
                stub = pb_grpc.SpecServeStub(channel)
                req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2),
                                         speculative=pb.SpeculativeOverride(mode="ngram", k=2))
                out = await stub.Generate(req, timeout=10)
                assert out.text == "ok" and out.spec.mode == "ngram"
                chunks = [m async for m in stub.GenerateStream(req, timeout=10)]
                assert "".join(c.text for c in chunks) == "ok"
                models = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
                assert models.models[0].name == "smollm2-135m"
                health = health_pb2_grpc.HealthStub(channel)
                checked = await health.Check(health_pb2.HealthCheckRequest(service="specserve.v1.SpecServe"))
                assert checked.status == health_pb2.HealthCheckResponse.SERVING
                listed = await health.List(health_pb2.HealthListRequest())
                assert listed.statuses["specserve.v1.SpecServe"].status == health_pb2.HealthCheckResponse.SERVING
            assert len(handles["ngram"].calls) == 2
        finally:
            await doors.close(1)
    run(main())


def test_grpc_errors_keep_their_status_details_and_retry_hint():
    async def main():
        doors, _, _, refused = _doors(lambda: StallingCall(), ongoing=1, queued=0)
        await doors.open()
        try:
            async with _grpc(doors) as channel:
                stub = pb_grpc.SpecServeStub(channel)
                bad = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2), speculative=pb.SpeculativeOverride(mode="nope"))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(bad, timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mode" in e.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [m async for m in stub.GenerateStream(bad, timeout=10)]
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mode" in e.value.details()
                # an undecodable message: INVALID_ARGUMENT naming the request, not UNKNOWN
                raw = channel.unary_unary("/specserve.v1.SpecServe/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw(b"\xff\xff\xff", timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in e.value.details()
                # the one place held by a stalled call: the next is UNAVAILABLE with retry-after-s
                ok = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2), speculative=pb.SpeculativeOverride(mode="ngram"))
                held = asyncio.ensure_future(stub.Generate(ok, timeout=30))
                await _until(lambda: doors.admission.running == 1)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(ok, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert dict(e.value.trailing_metadata())["retry-after-s"] and refused == ["busy"]
                held.cancel()
                await _until(lambda: doors.admission.running == 0)
        finally:
            await doors.close(1)
    run(main())


def test_grpc_reflection_lists_the_services():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        doors, _, _, refused = _doors(lambda: FakeCall([FINAL]))
        await doors.open()
        try:
            async with _grpc(doors) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                services = set()
                async for answer in stub.ServerReflectionInfo(iter([request])):
                    services |= {s.name for s in answer.list_services_response.service}
            assert {"specserve.v1.SpecServe", "grpc.health.v1.Health"} <= services
        finally:
            await doors.close(1)
    run(main())


def test_closed_doors_take_no_more_connections():
    async def main():
        doors, _, _, refused = _doors(lambda: FakeCall([FINAL]))
        await doors.open()
        port = doors.config.api.http_port
        await doors.close(1)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    run(main())


def test_a_port_taken_by_another_program_is_named():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            listening_socket("127.0.0.1", port)


def test_a_bug_in_a_router_method_is_internal_naming_its_type_not_unknown():
    async def main():
        doors, router, _, _ = _doors(lambda: FakeCall([FINAL]))

        async def broken(request, grpc_context=None):
            raise KeyError("x")
        router.ListModels = broken
        await doors.open()
        try:
            async with _grpc(doors) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.SpecServeStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in e.value.details()
            assert doors.admission.running == 0
        finally:
            await doors.close(1)
    run(main())


def test_two_replicas_share_the_ports_and_one_closing_leaves_the_other_answering():
    """Router replicas of one node bind the same HTTP and gRPC ports (SO_REUSEPORT): while one
    stops (or is replaced), the other keeps taking calls."""
    async def main():
        first, _, _, _ = _doors(lambda: FakeCall([FINAL]))
        second, _, handles, _ = _doors(lambda: FakeCall([FINAL]))
        api = second.config.api
        api.http_port, api.grpc_port = first.config.api.http_port, first.config.api.grpc_port
        await first.open()
        await second.open()
        try:
            await first.close(1)
            async with httpx.AsyncClient() as client:
                for _ in range(3):
                    r = await client.post(f"http://127.0.0.1:{api.http_port}/v1/chat/completions", json=BODY)
                    assert r.status_code == 200
            async with _grpc(second) as channel:
                models = await pb_grpc.SpecServeStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
            assert models.models[0].name == "smollm2-135m"
            assert len(handles["ngram"].calls) == 3  # all answered by the replica left
        finally:
            await second.close(1)
    run(main())


def test_https_with_client_certificates_required_refuses_a_caller_without_one(tmp_path):
    from cluster.tls import client_ssl_context, make_test_ca_and_cert

    pki = make_test_ca_and_cert(tmp_path)

    async def main():
        doors, _, handles, _ = _doors(lambda: FakeCall([FINAL]))
        tls = doors.config.api.tls
        tls.certfile, tls.keyfile = str(pki.server_cert), str(pki.server_key)
        tls.client_ca_file, tls.http_client_certs = str(pki.ca_cert), True
        await doors.open()
        url = f"https://localhost:{doors.config.api.http_port}/v1/chat/completions"
        try:
            with_cert = client_ssl_context(str(pki.ca_cert), str(pki.client_cert), str(pki.client_key))
            async with httpx.AsyncClient(verify=with_cert) as client:
                assert (await client.post(url, json=BODY)).status_code == 200
            async with httpx.AsyncClient(verify=client_ssl_context(str(pki.ca_cert))) as client:
                with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                    await client.post(url, json=BODY)
            assert len(handles["ngram"].calls) == 1
        finally:
            await doors.close(1)
    run(main())


def test_http_client_certificates_need_a_ca_and_the_routers_door():
    from pydantic import ValidationError

    from cluster.config_sections import ApiConfig

    with pytest.raises(ValidationError, match="http_client_certs needs client_ca_file"):
        ApiConfig(tls={"certfile": "c", "keyfile": "k", "http_client_certs": True})
    with pytest.raises(ValidationError, match="needs door: router"):
        ApiConfig(door="ray_proxy", tls={"certfile": "c", "keyfile": "k", "client_ca_file": "ca",
                                         "http_client_certs": True})
