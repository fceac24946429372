"""No secret value in a manifest: `literal_secrets(objs)` lists the places where Kubernetes objects
carry what looks like a credential in plain text. Secrets reach pods by reference only (an env
var's `valueFrom.secretKeyRef`, a Secret volume, KubeRay's `redisPassword.valueFrom`); a finding
is a value written where such a reference belongs.

What counts as a finding (each names the object and the path, never the value):
- an env var whose name has a word like KEY, TOKEN, PASSWORD, SECRET, AUTH with a literal `value` (a file path is not one)
  (a `name`/`value` entry of an `env` list, or an entry of an `env` / `env_vars` mapping);
- any other field whose name has a word like password, secret, token, credential or api key, holding
  a string or a `{value: ...}` (a name ending in Env, File, Ref, Name, Path says where a secret is);
- a URL with a password in it (`redis://user:pw@host`);
- a redis.conf or ACL line with a plaintext password (`requirepass x`, `user u on >x`);
- a Secret object with data other than placeholders marked `PLACEHOLDER_PREFIX` (local development).
Strings that hold a YAML mapping (the RayService's embedded Serve config) are read and searched too.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Iterator

import yaml

PLACEHOLDER_PREFIX = "dev-placeholder-"  # a Secret value that is not a secret (local development only)

_ENV_WORDS = {"key", "keys", "apikey", "token", "tokens", "password", "passwd", "pass", "pw", "secret",
              "secrets", "credential", "credentials", "auth"}
_FIELD_WORDS = {"password", "passwd", "secret", "secrets", "token", "tokens", "credential", "credentials",
                "apikey", "apikeys"}
_POINTER_WORDS = {"env", "file", "ref", "name", "names", "path", "dir", "prefix", "id", "size", "len"}
_URL_PASSWORD = re.compile(r"\b[a-z][a-z0-9+.\-]*://[^\s/@:'\"]*:[^\s/@'\"]+@", re.I)
_REDIS_CONF_PASSWORD = re.compile(
    r"^\s*(?:requirepass|masterauth)\s+(?![\"']?\$)\S"      # a literal, not a shell variable
    r"|^\s*(?:user|acl\s+setuser)\s+\S+.*\s>(?![\"']?\$)\S",  # an ACL plaintext password
    re.I | re.M)


def _words(name: str) -> list[str]:
    """Words of a field or variable name: `redisPassword` -> [redis, password], `API_KEYS` -> [api, keys]."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def _names_a_secret(name: str, words: set[str]) -> bool:
    ws = _words(name)
    if not ws or ws[-1] in _POINTER_WORDS:
        return False
    joined = {a + b for a, b in zip(ws, ws[1:])}  # api_key -> apikey
    return bool((set(ws) | joined) & words)


_FILE_PATH = re.compile(r"^/[A-Za-z0-9_.\-/]+$")


def _literal(value: Any) -> bool:
    """A non-empty string, or a KubeRay-style `{value: <non-empty string>}`; an absolute file path is
    not one (it points to a mounted Secret: Ray's RAY_TLS_SERVER_KEY names its key file that way).

    >>> _literal("hunter2"), _literal({"value": "sk-1"}), _literal("/etc/specserve/ray-tls/tls.key"), _literal(" ")
    (True, True, False, False)
    """
    if isinstance(value, dict):
        value = value.get("value")
    return isinstance(value, str) and value.strip() != "" and not _FILE_PATH.match(value)


def _walk(node: Any, path: str, parent: Any = None) -> Iterator[tuple[str, Any, Any, Any]]:
    """(path, parent's key, key, value) of every mapping entry and list item below `node` (key None
    for list items)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", parent, k, v
            yield from _walk(v, f"{path}.{k}", k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield f"{path}[{i}]", parent, None, v
            yield from _walk(v, f"{path}[{i}]", parent)


def _embedded(text: str) -> Any:
    """The mapping a multi-line string holds as YAML, else None."""
    if "\n" not in text or ":" not in text:
        return None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return doc if isinstance(doc, dict) else None


def _findings_in(node: Any, where: str) -> list[str]:
    out = []
    for path, parent, key, value in _walk(node, ""):
        at = f"{where} {path.lstrip('.')}"
        if isinstance(value, list) and key == "env":
            for i, e in enumerate(value):
                if isinstance(e, dict) and _names_a_secret(str(e.get("name", "")), _ENV_WORDS) and _literal(e.get("value")):
                    out.append(f"{at}[{i}]: env var {e['name']} has a literal value (use valueFrom.secretKeyRef)")
        elif isinstance(value, dict) and key in ("env", "env_vars"):
            for name, v in value.items():
                if _names_a_secret(str(name), _ENV_WORDS) and _literal(v):
                    out.append(f"{at}.{name}: env var {name} has a literal value (set it from a Secret)")
        elif isinstance(key, str) and parent not in ("env", "env_vars") and _names_a_secret(key, _FIELD_WORDS) \
                and _literal(value):
            out.append(f"{at}: a literal secret (use a Secret reference)")
        if isinstance(value, str):
            if _URL_PASSWORD.search(value):
                out.append(f"{at}: a URL with a password in it")
            if _REDIS_CONF_PASSWORD.search(value):
                out.append(f"{at}: a plaintext Redis password (requirepass / ACL `>`): hash it or pass it from a Secret")
            inner = _embedded(value)
            if inner is not None:
                out += _findings_in(inner, f"{at} (embedded YAML)")
    return out


def _secret_object_findings(obj: dict, where: str) -> list[str]:
    out = []
    for field in ("data", "stringData"):
        for k, v in (obj.get(field) or {}).items():
            text = v
            if field == "data":
                try:
                    text = base64.b64decode(str(v), validate=True).decode("utf-8", "replace")
                except (binascii.Error, ValueError):
                    text = ""
            if not str(text).startswith(PLACEHOLDER_PREFIX):
                out.append(f"{where} {field}.{k}: a Secret with a real value in a manifest "
                           f"(create it out of band; only `{PLACEHOLDER_PREFIX}...` placeholders may be committed)")
    return out


def literal_secrets(objs: list[dict]) -> list[str]:
    """Findings (see the module docstring) over Kubernetes objects; empty: no literal secret."""
    out = []
    for obj in objs:
        where = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
        if obj.get("kind") == "Secret":
            out += _secret_object_findings(obj, where)
            obj = {k: v for k, v in obj.items() if k not in ("data", "stringData")}
        out += _findings_in(obj, where)
    return out
