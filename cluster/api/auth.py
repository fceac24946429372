"""API keys: who may call the router. Keys come from a file and/or an environment variable (never
from the cluster config), live in memory only as SHA-256 digests, and are checked in constant time.

Words: a *key* is the secret a caller presents (`Authorization: Bearer <key>` on HTTP, metadata
`authorization: Bearer <key>` on gRPC); its *label* names it in logs (`name:key` in the file, else
`<source>:<line>`), so a log can say which key was used without ever holding the key.

Rotation and revocation: rewrite the file (add the new key, later delete the old line); the store
notices the change of mtime/size/inode at most every `reload_interval_s` and swaps its digest set.
A refused call never learns why (missing, malformed or wrong): every refusal says `AUTH_ERROR_MESSAGE`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

log = logging.getLogger("specserve.auth")

AUTH_ERROR_MESSAGE = "missing or invalid API key"
DEFAULT_KEYS_ENV = "SPECSERVE_API_KEYS"
MIN_KEY_CHARS = 16  # shorter keys are refused at load: they can be guessed
_LABEL = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KEY = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no whitespace (what an HTTP header carries safely)


class AuthConfigError(ValueError):
    """The key source is unusable at start-up (file missing, no valid key); the message names it."""


@dataclass(frozen=True)
class KeyEntry:
    label: str
    digest: bytes  # SHA-256 of the key; the key itself is not kept


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def parse_key_line(text: str, default_label: str) -> Optional[KeyEntry]:
    """One `key` or `label:key` (surrounding whitespace ignored) -> KeyEntry, or None if malformed.

    The part before the first ':' is a label only if it looks like one ([A-Za-z0-9_.-], 1..64);
    a key that itself contains ':' therefore needs a label in front."""
    text = text.strip()
    label, key = default_label, text
    head, sep, tail = text.partition(":")
    if sep and _LABEL.match(head) and tail:
        label, key = head, tail
    if len(key) < MIN_KEY_CHARS or not _KEY.match(key):
        return None
    return KeyEntry(label=label, digest=_digest(key))


def parse_key_file(text: str, source: str) -> list[KeyEntry]:
    """Key file: one key per line, `label:key` or `key`; blank lines and `#` comments (whole line or
    after the key, separated by whitespace) are skipped. A malformed line is logged by number (never
    its content) and skipped."""
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].split("\t#", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        entry = parse_key_line(line, f"{source}:{lineno}")
        if entry is None:
            log.warning("%s line %d: not a key (need [label:]key, key of %d+ printable ASCII characters, "
                        "no spaces); line skipped", source, lineno, MIN_KEY_CHARS)
            continue
        out.append(entry)
    return out


def parse_key_env(value: str, name: str) -> list[KeyEntry]:
    """Comma-separated keys (`label:key` or `key`) from an environment variable."""
    out = []
    for i, part in enumerate(value.split(","), 1):
        if not part.strip():
            continue
        entry = parse_key_line(part, f"env:{name}:{i}")
        if entry is None:
            log.warning("env %s item %d: not a key; skipped", name, i)
            continue
        out.append(entry)
    return out


def bearer_token(header_value: Optional[str]) -> Optional[str]:
    """`Bearer <token>` (scheme case-insensitive, any spaces/tabs around) -> token; else None.
    A token with inner whitespace or non-ASCII characters is malformed."""
    if not header_value:
        return None
    parts = header_value.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1].strip()
    if not token or not token.isascii() or any(c.isspace() for c in token):
        return None
    return token


def bearer_from_http(headers: Mapping[str, str] | Any) -> Optional[str]:
    """The `Authorization` header value (starlette Headers or a plain dict, any case), or None.
    Two Authorization headers are ambiguous and count as none."""
    if hasattr(headers, "getlist"):  # starlette.datastructures.Headers (case-insensitive)
        values = headers.getlist("authorization")
    else:
        values = [v for k, v in headers.items() if k.lower() == "authorization"]
    return values[0] if len(values) == 1 else None


def bearer_from_grpc(metadata: Iterable[tuple[str, Any]] | Any) -> Optional[str]:
    """The `authorization` metadata value, from a gRPC context (anything with
    `invocation_metadata()`, e.g. Ray's RayServegRPCContext) or (key, value) pairs; else None."""
    if metadata is None:
        return None
    if hasattr(metadata, "invocation_metadata"):
        metadata = metadata.invocation_metadata() or ()
    values = [v for k, v in metadata if str(k).lower() == "authorization"]
    if len(values) != 1:
        return None
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value


class ApiKeyStore:
    """Keys from `api_keys_file` and/or the environment variable `api_keys_env`; `check()` says
    whether a header value carries one of them.

    The file is re-read when its (mtime, size, inode) changes, looked at no more than every
    `reload_interval_s`. If it disappears or cannot be read after start-up, its keys are dropped
    (fail closed: that is also how to revoke every file key at once). Environment keys are read once.
    """

    def __init__(
        self,
        api_keys_file: Optional[str | os.PathLike] = None,
        api_keys_env: Optional[str] = DEFAULT_KEYS_ENV,
        reload_interval_s: float = 1.0,
        environ: Optional[Mapping[str, str]] = None,
        clock: Callable[[], float] = time.monotonic,
        **_ignored: Any,  # other AuthConfig fields (allow_unauthenticated_health, ...) are the caller's
    ):
        self.path = Path(api_keys_file) if api_keys_file else None
        self.env_name = api_keys_env or None
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        environ = os.environ if environ is None else environ
        self._env_keys: tuple[KeyEntry, ...] = ()
        if self.env_name and environ.get(self.env_name):
            self._env_keys = tuple(parse_key_env(environ[self.env_name], self.env_name))
        self._file_keys: tuple[KeyEntry, ...] = ()
        self._file_sig: Optional[tuple] = None
        self._next_look = 0.0
        if self.path is not None:
            if not self.path.is_file():
                raise AuthConfigError(f"auth.api_keys_file: {self.path}: no such file")
            self._reload(force=True)
            self._next_look = self._clock() + self.reload_interval_s
        if not self.keys:
            raise AuthConfigError(
                f"auth: no valid API key in {self.path or '(no file)'} or ${self.env_name or '(no env)'}; "
                "every call would be refused")
        log.info("API keys loaded: %d (%s)", len(self.keys), ", ".join(k.label for k in self.keys))

    @classmethod
    def from_config(cls, cfg: Any) -> "ApiKeyStore":
        """From an AuthConfig-like object or a plain dict of its fields."""
        data = cfg if isinstance(cfg, Mapping) else cfg.model_dump()
        return cls(**data)

    @property
    def keys(self) -> tuple[KeyEntry, ...]:
        return self._file_keys + self._env_keys

    def labels(self) -> list[str]:
        self.maybe_reload()
        return [k.label for k in self.keys]

    def maybe_reload(self) -> None:
        if self.path is None:
            return
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + self.reload_interval_s
        self._reload(force=False)

    def _reload(self, force: bool) -> None:
        try:
            st = self.path.stat()
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if not force and sig == self._file_sig:
                return
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            if self._file_keys or self._file_sig is not None:
                log.error("API key file %s unreadable (%s): its keys are revoked until it is back",
                          self.path, type(e).__name__)
            with self._lock:
                self._file_keys, self._file_sig = (), None
            return
        keys = tuple(parse_key_file(text, self.path.name))
        with self._lock:
            old = {k.label for k in self._file_keys}
            self._file_keys, self._file_sig = keys, sig
        new = {k.label for k in keys}
        if not force:
            log.info("API key file %s reloaded: %d keys (added %s, removed %s)", self.path, len(keys),
                     sorted(new - old) or "-", sorted(old - new) or "-")

    def check(self, header_value: Optional[str]) -> Optional[str]:
        """Authorization header value -> the matching key's label, or None (missing, malformed or
        wrong: the caller must not tell which). Compares the presented key's digest with every
        stored digest through `hmac.compare_digest`, with no early exit, so the time depends on the
        number of keys only, not on how much of a key was right."""
        self.maybe_reload()
        token = bearer_token(header_value)
        presented = _digest(token or "")
        match = None
        for entry in self.keys:
            if hmac.compare_digest(presented, entry.digest) and match is None:
                match = entry.label
        return match if token is not None else None
