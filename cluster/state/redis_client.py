"""The one way specserve opens a Redis client (tuning state, autoscaler records, `specserve status`).

Every caller wants the same client: one that fails fast instead of stalling a thread (socket and
connect timeouts, no retry, no health-check ping before commands), with the ACL password from the
environment and TLS for `rediss://` URLs (`cluster.tls.redis_client_kwargs`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.tls import redis_client_kwargs


def redis_client(url: str, timeout_s: float, password_env: Optional[str] = "SPECSERVE_REDIS_PASSWORD",
                 ca_file: Optional[str] = None, certfile: Optional[str] = None, keyfile: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None) -> redis.Redis:
    """A client of `url` whose every call returns or raises within about `timeout_s`.

    >>> c = redis_client("redis://127.0.0.1:1/0", timeout_s=0.2, environ={})
    >>> kw = c.connection_pool.connection_kwargs
    >>> kw["socket_timeout"], kw["socket_connect_timeout"], kw["retry_on_timeout"], kw["health_check_interval"]
    (0.2, 0.2, False, 0)
    """
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
        retry=Retry(NoBackoff(), 0), health_check_interval=0,
        **redis_client_kwargs(url, password_env, ca_file, certfile, keyfile, environ=environ))


def redis_client_from(section: Any, timeout_s: float) -> redis.Redis:
    """`redis_client` for a config's `redis:` section (`RedisConfig`) or the same fields as a mapping
    (what the autoscaling policy receives from Serve)."""
    get = section.get if isinstance(section, Mapping) else (lambda name, default=None: getattr(section, name, default))
    return redis_client(get("url"), timeout_s, get("password_env"), get("ca_file"), get("certfile"), get("keyfile"))
