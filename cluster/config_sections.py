"""The cluster config's service sections (router, Redis, TLS, auth, size limits, API ports, Ray): strict
pydantic models that `cluster.config.ClusterConfig` assembles with the models and pools. What every section
is built on is `cluster.config_base`; a pool's SuffixDecoding section is `cluster.config_suffix`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from cluster.config_base import CustomResources, Strict
from cluster.speculation import SpecMode


class TeachingConfig(Strict):
    """What traffic teaches the tuner (`cluster/policy/teaching.py`; docs/security.md)."""

    max_temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="Requests sampled at a higher temperature teach the tuner nothing.")
    client_rate_per_s: float = Field(
        4.0, ge=0.0, description=(
            "Requests per second, on average, one client (its API key, else its peer address) may teach the "
            "tuner, per router replica; past it they are served but not learned from. 0: no bound."))
    client_burst: int = Field(240, ge=1, description="Requests one client may teach at once (its bucket's size).")
    trusted_clients: list[str] = Field(
        default_factory=list, description=(
            "Clients whose named K or class hint teaches, unbudgeted (calibration, benchmarks): 'key:<label>' "
            "of an API key, or 'peer:<address>' (e.g. 'peer:127.0.0.1' on a local cluster without keys)."))

    @field_validator("trusted_clients")
    @classmethod
    def _trusted(cls, v: list[str]) -> list[str]:
        for c in v:
            if not c.startswith(("key:", "peer:")) or len(c) <= 5:
                raise ValueError(f"trusted_clients: {c[:80]!r} must be 'key:<label>' or 'peer:<address>'")
        return v


class RouterConfig(Strict):
    default_mode: str = Field(
        "auto",
        description="Mode when a request names none: 'auto' (the router's policy) or a mode name.",
    )
    default_k: dict[str, int] = Field(
        default_factory=lambda: {"ngram": 3, "draft_model": 3, "eagle": 3, "eagle3": 3, "mtp": 1, "suffix": 4,
                                 "remote_draft": 3},
        description="Safe default K per mode when the router has no tuning state.",
    )
    replicas: int = Field(1, ge=1, description="Router (ingress) replicas.")
    resources: CustomResources = Field(
        default_factory=dict, description=(
            "Custom Ray resources of one router replica, so it lands on the nodes that advertise them (e.g. "
            "{specserve_head: 0.01} with ray.head_resources {specserve_head: 1}). Empty: any node."))
    max_ongoing_requests: Optional[int] = Field(
        None, ge=1, description=(
            "Requests one router replica admits at once. Unset: what its pools admit together (each pool's "
            "max_ongoing_requests times its most replicas, plus max_queued_requests) and 64 for status and "
            "model calls (`ClusterConfig.router_max_ongoing`), so a full pool answers 429 at once; set lower, "
            "the router is the gate and excess requests wait at its door (max_queued_requests) instead."))
    max_queued_requests: int = Field(
        512, ge=-1, description=(
            "Requests waiting for a place at a router replica (at its door, or with api.door ray_proxy at the "
            "proxies) before they are answered 503 / UNAVAILABLE (-1: no bound)."))
    request_timeout_s: float = Field(
        120.0, gt=0, description=(
            "End-to-end bound of one request at the router, from its arrival (an HTTP body read included) to its "
            "last output, across the retry: past it the request is aborted in vLLM and fails with "
            "DEADLINE_EXCEEDED / HTTP 504 (a body not received by then: 408). Ray's proxies get it plus 10 s."))
    first_token_timeout_s: float = Field(
        60.0, gt=0, description=(
            "One engine call that gives no first output within this (queued, or the pool stalled) fails with "
            "UNAVAILABLE; at most request_timeout_s."))
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="A stream that gets no output for this long fails with UNAVAILABLE; at most "
                                "request_timeout_s.")
    teaching: TeachingConfig = Field(default_factory=TeachingConfig,
                                     description="What traffic teaches the tuner, and each client's weight.")
    engine_lane: bool = Field(
        True, description=(
            "A router streams a generation straight from an engine replica on its own node, over a Unix socket "
            "in Ray's session folder (deployments/engine_lane.py), instead of through a Ray Serve handle call: "
            "while every replica of the pool is on the router's node. Off: every call by the handle."))

    @field_validator("default_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v != "auto":
            SpecMode.parse(v)
        return v

    @field_validator("default_k")
    @classmethod
    def _k(cls, v: dict[str, int]) -> dict[str, int]:
        for mode, k in v.items():
            SpecMode.parse(mode)
            if not 0 <= k <= 16:
                raise ValueError(f"default_k[{mode}] must be in 0..16, got {k}")
        return v

    @model_validator(mode="after")
    def _waits_within_the_deadline(self) -> "RouterConfig":
        for name in ("first_token_timeout_s", "stream_idle_timeout_s"):
            if getattr(self, name) > self.request_timeout_s:
                raise ValueError(f"router.{name} ({getattr(self, name):g} s) exceeds router.request_timeout_s "
                                 f"({self.request_timeout_s:g} s), so it could never fire; lower it or raise "
                                 "request_timeout_s")
        return self


class RedisConfig(Strict):
    url: str = Field("redis://127.0.0.1:6390/0", description="Redis holding the tuning state.")
    start_local: bool = Field(
        True, description="`specserve up` starts a local redis-server on the URL's port if none answers."
    )
    socket_timeout_s: float = Field(0.05, gt=0, description="Per-call timeout; past it the router serves on defaults.")
    key_prefix: str = Field("specserve:v3", description=(
        "Namespace of every key; its version changes with the tuning cells' fields (v2 added the "
        "accepted-run counts r{L}, v3 the steps and decode seconds per K s{K} / t{K}, which an "
        "older reader would reject as unknown)."))
    password_env: Optional[str] = Field(
        "SPECSERVE_REDIS_PASSWORD",
        description="Environment variable holding the Redis password (ACL user in the URL: redis://user@host/0).",
    )
    ca_file: Optional[str] = Field(None, description="rediss:// URLs: CA that signed the Redis server certificate.")
    certfile: Optional[str] = Field(None, description="rediss:// URLs: client certificate (PEM), if Redis asks for one.")
    keyfile: Optional[str] = Field(None, description="rediss:// URLs: key of `certfile`.")

    @field_validator("url")
    @classmethod
    def _no_password(cls, v: str) -> str:
        if urlsplit(v).password is not None:
            raise ValueError("no password in the URL; put it in the environment variable named by password_env")
        return v

    @model_validator(mode="after")
    def _tls_files(self) -> "RedisConfig":
        if (self.ca_file or self.certfile) and urlsplit(self.url).scheme != "rediss":
            raise ValueError("ca_file / certfile need a rediss:// url")
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("certfile and keyfile go together")
        return self


class TlsConfig(Strict):
    certfile: Optional[str] = Field(None, description="PEM server certificate (chain): HTTPS and gRPC over TLS.")
    keyfile: Optional[str] = Field(None, description="PEM private key of `certfile` (unencrypted).")
    client_ca_file: Optional[str] = Field(
        None, description="gRPC mTLS: callers must present a certificate signed by this CA (on HTTP too with "
                          "http_client_certs).")
    http_client_certs: bool = Field(
        False, description=(
            "HTTPS asks every caller for a certificate signed by client_ca_file and refuses the connection without "
            "one (mTLS on HTTP as on gRPC). The router's door only: Ray's HTTP proxy cannot ask for one."))
    grpc_tls_port: int = Field(
        9443, ge=1, le=65535, description=(
            "api.door ray_proxy only: the TLS gRPC port, forwarding to Ray's plaintext gRPC port (api.grpc_port), "
            "which must then be closed to the network. With the router's door, api.grpc_port itself speaks TLS."))

    @model_validator(mode="after")
    def _pair(self) -> "TlsConfig":
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("certfile and keyfile go together")
        if self.client_ca_file and not self.certfile:
            raise ValueError("client_ca_file needs certfile and keyfile")
        if self.http_client_certs and not self.client_ca_file:
            raise ValueError("http_client_certs needs client_ca_file (the CA that signs the callers' certificates)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.certfile)


class AuthConfig(Strict):
    enabled: bool = Field(False, description="Require `Authorization: Bearer <key>` on every HTTP and gRPC call.")
    api_keys_file: Optional[str] = Field(
        None, description="Key file on every router node (e.g. a mounted Secret): one `label:key` or `key` per line, "
                          "'#' comments; re-read within reload_interval_s of a change (rotation, revocation).")
    api_keys_env: Optional[str] = Field(
        "SPECSERVE_API_KEYS", description="Environment variable of the router replicas with comma-separated keys.")
    reload_interval_s: float = Field(1.0, gt=0, le=60, description="How often the key file's mtime is looked at.")
    allow_unauthenticated_health: bool = Field(
        True, description="grpc.health.v1 Check/Watch answer without a key (probes, load balancers).")
    allow_unauthenticated_reflection: bool = Field(
        False, description="Keep gRPC reflection on with auth enabled (Ray's proxy serves it and cannot check keys).")

    @model_validator(mode="after")
    def _source(self) -> "AuthConfig":
        if self.enabled and not (self.api_keys_file or self.api_keys_env):
            raise ValueError("enabled needs api_keys_file or api_keys_env")
        return self


class DrafterWireConfig(Strict):
    """Bounds of a drafter's per-step endpoint (`deployments/draft_server.py`; docs/security.md). A
    request past them gets an error reply and changes nothing; the targets keep inside them."""

    max_frame_bytes: int = Field(
        1 << 20, ge=64 << 10, le=16 << 20, description="Largest request frame (a whole batch's new tokens).")
    max_tokens_per_call: int = Field(
        16384, ge=16, description="Tokens in one call, all sequences together (more wait for the next step).")
    max_connections: int = Field(
        64, ge=1, description="Connections at once (a quarter of them, at least 4, may be in their handshake).")
    idle_timeout_s: float = Field(300.0, gt=0, description="A connection without a request this long is closed.")
    recv_timeout_s: float = Field(
        5.0, gt=0, description="A handshake, and each request frame from its first byte, must arrive within this.")


class LimitsConfig(Strict):
    """Size limits of the front doors, checked before a request costs more than its bytes."""

    max_body_bytes: int = Field(
        4 << 20, ge=1024, description=(
            "HTTP: largest body of a JSON endpoint; a larger one gets 413 (refused from its Content-Length before "
            "reading, or once that many bytes were read). Ray's HTTP proxy buffers a body before the router sees "
            "it: bound bodies at the load balancer or ingress too."))
    max_prompt_chars: int = Field(
        256 << 10, ge=1, description=(
            "Largest prompt in characters: `prompt`, or all `messages` contents together; more gets HTTP 413 / "
            "gRPC INVALID_ARGUMENT. (Each prompt or message is also at most 256 Ki characters.)"))
    body_read_timeout_s: float = Field(
        30.0, gt=0, description=(
            "HTTP, the router's door: a request's body must be all there within this many seconds of its headers; "
            "past it the request gets 408 and its connection is closed (a client holding connections open with a "
            "trickle of body). The whole request is also bounded by router.request_timeout_s."))
    max_connections_per_client: int = Field(
        512, ge=0, description=(
            "HTTP, the router's door: open connections one client address may hold at one router replica; one "
            "more is answered 429 with Retry-After and closed at once (0: no bound). Behind a load balancer that "
            "does not keep client addresses every connection comes from it: raise this, or set 0."))
    grpc_max_message_bytes: int = Field(
        8 << 20, ge=1024, le=(1 << 31) - 1, description=(
            "gRPC: largest message either way; a larger one gets RESOURCE_EXHAUSTED from grpc before any of our "
            "code runs. Set on Ray's gRPC proxy through Ray Serve's RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (the "
            "environment of the Ray nodes, which `specserve up` and the rendered manifests set) and on the TLS "
            "listener."))


class ApiConfig(Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP and gRPC doors listen on.")
    door: Literal["router", "ray_proxy"] = Field(
        "router", description=(
            "Who listens: `router`, each router replica itself (uvicorn and grpc.aio on host, sharing the ports, "
            "TLS natively; one hop fewer before the first token), or `ray_proxy`, Ray Serve's HTTP and gRPC proxies "
            "(a proxy on every node, as the KubeRay manifests run it; gRPC TLS through a forwarder on tls.grpc_tls_port)."))
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(9000, ge=0, le=65535, description="gRPC port (0 disables gRPC).")
    tls: TlsConfig = Field(default_factory=TlsConfig, description="TLS of the HTTP and gRPC endpoints.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Size limits of requests at both doors.")

    @model_validator(mode="after")
    def _door_can_do_it(self) -> "ApiConfig":
        if self.tls.http_client_certs and self.door != "router":
            raise ValueError("tls.http_client_certs needs door: router (Ray's HTTP proxy cannot ask for a certificate)")
        return self


class LocalNodeConfig(Strict):
    """One worker node of a local multi-node Ray cluster: a process tree of its own on this machine
    (raylet, object store, workers; cluster/ops/local_nodes.py), joined to the head `specserve up` starts."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$", description="Node name (Ray's node_name; `specserve status`).")
    num_cpus: int = Field(1, ge=0, le=1024, description="Logical CPUs the node advertises.")
    resources: CustomResources = Field(
        default_factory=dict, description=(
            "Custom resources the node advertises, which pool bundles, drafters and the router name to land "
            "on it (the names the GPU config's node groups advertise: specserve_target, specserve_drafter, specserve_mtp)."))
    object_store_mb: int = Field(128, ge=80, le=1 << 20, description="The node's object store (MiB).")

class RayTlsConfig(Strict):
    """Ray's own mutual TLS (cluster/ops/ray_tls.py): every gRPC server of Ray, the Serve replicas'
    inter-deployment servers among them, asks for a certificate signed by the cluster's CA."""

    enabled: bool = Field(
        True, description=(
            "A local cluster: `specserve up` signs a node certificate and starts Ray with RAY_USE_TLS. The KubeRay "
            "manifests: every Ray pod signs its own in an init container, with the CA from a Secret. A joined "
            "cluster (ray.address): its nodes' own environment decides."))
    ca_cert: Optional[str] = Field(
        None, description="A local cluster's CA certificate (PEM); unset: a CA made for each start, its key discarded.")
    ca_key: Optional[str] = Field(None, description="The key of ca_cert (PEM, unencrypted), to sign the node certificate.")

    @model_validator(mode="after")
    def _pair(self) -> "RayTlsConfig":
        if bool(self.ca_cert) != bool(self.ca_key):
            raise ValueError("ca_cert and ca_key go together")
        for name in ("ca_cert", "ca_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: {path}: no such file")
        return self


class RayConfig(Strict):
    address: Optional[str] = Field(
        None, description="Ray cluster to join ('auto', 'ray://...'); None starts a local one."
    )
    num_cpus: Optional[int] = Field(
        None, ge=1, description="CPUs a local Ray cluster advertises (None: detect)."
    )
    metrics_export_port: Optional[int] = Field(
        None, ge=1, le=65535, description="Prometheus port of a local Ray cluster's metrics agent (None: Ray picks)."
    )
    node_ip_address: Optional[str] = Field(
        "127.0.0.1", description=(
            "Address a local Ray cluster's processes bind to and advertise (GCS, raylet, object manager, workers: "
            "Serve replicas unpickle what reaches them, unauthenticated). Loopback keeps all of it off the network; "
            "the API is served on api.host either way. None: Ray picks this machine's address (other machines may "
            "then join, and reach it)."))
    head_resources: CustomResources = Field(
        default_factory=dict, description="Custom resources the head of a local cluster advertises (e.g. for the router).")
    nodes: list[LocalNodeConfig] = Field(
        default_factory=list, description=(
            "Worker nodes of a local cluster, each a separate process tree on this machine with its "
            "own resources (cluster/ops/local_nodes.py): the multi-node path on one machine. Empty: one node."))
    tls: RayTlsConfig = Field(default_factory=RayTlsConfig, description="Ray's own mutual TLS.")
    pin_serving_cpus: bool = Field(
        False, description=(
            "A local cluster on vLLM's CPU backend: keep the serving processes (proxies, router, replicas' front "
            "ends, engine-core schedulers, Ray's daemons) on the cores vLLM leaves free of its model workers, so they "
            "do not preempt a worker on its core (cluster/ops/cpu_pinning.py). No effect on GPU engines or a joined cluster."))
    @model_validator(mode="after")
    def _local_nodes(self) -> "RayConfig":
        if self.nodes and self.address:
            raise ValueError("nodes: local worker nodes are started only for a local cluster (ray.address unset)")
        if self.head_resources and self.address:
            raise ValueError("head_resources: only for a local cluster (ray.address unset)")
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1} | ({"head"} & set(names)))
        if dup:
            raise ValueError(f"nodes: names must be unique and not 'head': {dup}")
        return self
