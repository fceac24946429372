"""Round trip of one small drafter call on loopback, by transport: the choice behind the drafter
wire (`cluster.engine.draft_wire`; docs/security.md, "The drafter wire").

Every transport carries the same call (8 sequences with 2 new tokens each, K = 4) and the same
reply (8 x 4 draft ids) between two threads of this process; the drafter side answers at once
(no model), so the time is the transport's and the (de)serialisation's:

- `tcp`: the wire before authentication (4-byte length + msgpack, no checks);
- `tcp+hmac`: the wire as it is, through the real DraftServer and TcpDraftClient: the HMAC
  handshake at connect, a tag on every frame, every request checked against the drafter's limits;
- `tcp+tls`: the old framing inside TLS 1.3 with client certificates (Python's ssl module);
- `grpc`, `grpc+mtls`: a unary gRPC call (sync server, thread pool; msgpack bodies), with a
  per-call deadline and a bearer token in metadata checked in constant time.

Runs interleave the transports in rounds, so a busy machine weighs on all of them alike.

    nice -n 19 python -m tools.bench.drafter_wire [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hmac
import json
import socket
import ssl
import struct
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import msgpack

from cluster.engine.draft_client import TcpDraftClient
from cluster.percentile import percentile
from cluster.tls import grpc_channel_credentials, grpc_server_credentials, make_test_ca_and_cert
from deployments.draft_server import DraftServer

SECRET = b"bench-secret-0123456789abcdef"
REQUEST = {"client": "bench", "evict": [],
           "seqs": [[f"req-{i:08x}", 100 + i, [17 + i, 4242 + i], 4] for i in range(8)]}
REPLY = {"drafts": [[11, 12, 13, 14]] * 8, "resync": [-1] * 8, "compute_s": 0.0}
_LEN = struct.Struct(">I")


# -- the old framing, plain or inside TLS --------------------------------------------------------


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _send(sock, obj) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv(sock):
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    return msgpack.unpackb(_recv_exact(sock, n), raw=False)


class FramedServer:
    def __init__(self, wrap=None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.wrap = self.sock.getsockname()[1], wrap
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.wrap is not None:
            conn = self.wrap(conn)
        try:
            while True:
                msg = _recv(conn)
                _send(conn, {**REPLY, "drafts": REPLY["drafts"][: len(msg["seqs"])]})
        except (ConnectionError, OSError):
            conn.close()

    def close(self):
        self.sock.close()


def framed_client(port: int, wrap=None):
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if wrap is not None:
        sock = wrap(sock)

    def call():
        sock.settimeout(1.0)
        _send(sock, REQUEST)
        return _recv(sock)

    return call, sock.close


# -- the wire as it is -----------------------------------------------------------------------------


@dataclass
class StubDrafter:
    """What DraftServer needs of a Drafter: limits, stats, and an immediate propose."""

    vocab_size: int = 49152
    max_k: int = 16
    max_context: int = 8192
    max_sequences: int = 256
    stats: object = field(default_factory=lambda: _Counters())

    def propose(self, client, seqs, evict):
        return [[11, 12, 13, 14][:k] for _, _, _, k in seqs], [-1] * len(seqs)


class _Counters:
    def __getattr__(self, name):  # every counter DraftServer bumps starts at 0
        return 0


def authenticated():
    server = DraftServer(StubDrafter(), "127.0.0.1", 0, secret=SECRET)
    client = TcpDraftClient(server.address, SECRET)

    def call():
        deadline = time.monotonic() + 1.0
        client.open(deadline)
        return client.call(REQUEST, deadline)

    return call, lambda: (client.close(), server.close())


# -- gRPC ------------------------------------------------------------------------------------------


def grpc_pair(pki=None):
    import grpc

    token = "Bearer " + SECRET.decode()

    def propose(req, context):
        md = dict(context.invocation_metadata())
        if not hmac.compare_digest(md.get("authorization", "").encode(), token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no")
        return {**REPLY, "drafts": REPLY["drafts"][: len(req["seqs"])]}

    opts = [("grpc.max_receive_message_length", 1 << 20), ("grpc.max_send_message_length", 1 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    handler = grpc.unary_unary_rpc_method_handler(
        propose, request_deserializer=lambda b: msgpack.unpackb(b, raw=False),
        response_serializer=lambda o: msgpack.packb(o, use_bin_type=True))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specserve.Drafter", {"Propose": handler}),))
    if pki is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", grpc_server_credentials(
            str(pki.server_cert), str(pki.server_key), str(pki.ca_cert)))
    server.start()
    if pki is None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
    else:
        channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc_channel_credentials(
            str(pki.ca_cert), str(pki.client_cert), str(pki.client_key)), options=opts)
    stub = channel.unary_unary("/specserve.Drafter/Propose",
                               request_serializer=lambda o: msgpack.packb(o, use_bin_type=True),
                               response_deserializer=lambda b: msgpack.unpackb(b, raw=False))
    md = (("authorization", token),)

    def call():
        return stub(REQUEST, timeout=1.0, metadata=md)

    return call, lambda: (channel.close(), server.stop(None))


# -- the run ---------------------------------------------------------------------------------------


def transports(pki) -> dict:
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(pki.server_cert, pki.server_key)
    sctx.load_verify_locations(pki.ca_cert)
    sctx.verify_mode = ssl.CERT_REQUIRED
    cctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    cctx.load_cert_chain(pki.client_cert, pki.client_key)
    plain, tls = FramedServer(), FramedServer(wrap=lambda c: sctx.wrap_socket(c, server_side=True))
    return {
        "tcp": framed_client(plain.port),
        "tcp+hmac": authenticated(),
        "tcp+tls": framed_client(tls.port, wrap=lambda s: cctx.wrap_socket(s, server_hostname="127.0.0.1")),
        "grpc": grpc_pair(),
        "grpc+mtls": grpc_pair(pki),
    }


def run(calls: int, rounds: int, warmup: int = 200) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        pki = make_test_ca_and_cert(tmp, ["127.0.0.1"])
        pairs = transports(pki)
        samples: dict[str, list[float]] = {name: [] for name in pairs}
        try:
            for name, (call, _) in pairs.items():
                for _ in range(warmup):
                    assert len(call()["drafts"]) == 8, name
            for _ in range(rounds):
                for name, (call, _) in pairs.items():
                    xs = samples[name]
                    for _ in range(calls // rounds):
                        t0 = time.perf_counter()
                        call()
                        xs.append(time.perf_counter() - t0)
        finally:
            for _, close in pairs.values():
                close()
    return {name: {"n": len(xs), **{f"p{p}_us": round(percentile(xs, p, "nearest_rank") * 1e6, 1) for p in (50, 90, 99)}}
            for name, xs in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per transport")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    out = run(args.calls, args.rounds)
    for name, q in out.items():
        print(f"{name:10s} n={q['n']:5d}  p50 {q['p50_us']:7.1f} us  p90 {q['p90_us']:7.1f} us  p99 {q['p99_us']:7.1f} us")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
