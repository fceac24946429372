"""API keys (cluster.api.auth) and log redaction (cluster.ops.logsafe): parsing, rotation, revocation,
constant-time comparison, header edge cases. No Ray, no network."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

import pytest
from starlette.datastructures import Headers

from cluster.api import auth
from cluster.api.auth import (AUTH_ERROR_MESSAGE, ApiKeyStore, AuthConfigError, bearer_from_grpc, bearer_from_http,
                              bearer_token, parse_key_file)
from cluster.ops.logsafe import RedactTextFilter, install_redaction, redact, redact_message

K1 = "sk-alpha-0123456789abcdef"
K2 = "sk-bravo-0123456789abcdef"
K3 = "sk-charlie-0123456789abcd"


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def write_keys(path, text, bump_ns=0):
    path.write_text(text)
    if bump_ns:  # make the mtime change visible even on coarse-mtime file systems
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump_ns))


@pytest.fixture
def keyfile(tmp_path):
    p = tmp_path / "api-keys"
    write_keys(p, f"# team keys\nalice:{K1}\n\n  {K2}   # unlabelled, trailing comment\n")
    return p


def store(path=None, env=None, clock=None):
    return ApiKeyStore(api_keys_file=path, environ=env or {}, clock=clock or FakeClock())


# -- parsing --------------------------------------------------------------------------------------

def test_key_file_parsing_labels_comments_and_no_plain_keys_kept(keyfile):
    s = store(keyfile)
    assert s.labels() == ["alice", "api-keys:4"]
    assert all(len(k.digest) == 32 for k in s.keys)
    assert K1 not in repr(vars(s)) and K2 not in repr(vars(s))  # only digests in memory
    assert s.check(f"Bearer {K1}") == "alice"
    assert s.check(f"Bearer {K2}") == "api-keys:4"


def test_malformed_lines_skipped_without_logging_their_content(caplog):
    text = f"short\nbad label:{K1}\nok:{K2}\nwith space {K3}\n{K3}:{K1}\n"
    with caplog.at_level(logging.WARNING, "specserve.auth"):
        entries = parse_key_file(text, "f")
    # line 1 too short; lines 2 and 4 contain spaces; line 5's head is label-like, so it is label K3, key K1
    assert [e.label for e in entries] == ["ok", K3]
    assert entries[1].digest == hashlib.sha256(K1.encode()).digest()
    assert "line 1" in caplog.text and "line 2" in caplog.text and "line 4" in caplog.text
    assert "short" not in caplog.text and K3 not in caplog.text and K1 not in caplog.text


def test_key_containing_colon_needs_a_label():
    entries = parse_key_file(f"lbl:{K1}:tail\n", "f")
    assert entries[0].label == "lbl" and entries[0].digest == hashlib.sha256(f"{K1}:tail".encode()).digest()


def test_env_keys_comma_separated_and_combined_with_file(keyfile):
    s = store(keyfile, env={"SPECSERVE_API_KEYS": f" ci:{K3} , ,{K2}x"})
    assert s.check(f"Bearer {K3}") == "ci"
    assert s.check(f"Bearer {K2}x") == "env:SPECSERVE_API_KEYS:3"
    assert s.check(f"Bearer {K1}") == "alice"


def test_custom_env_name_and_from_config_dict(monkeypatch):
    monkeypatch.setenv("MY_KEYS", K1)
    s = ApiKeyStore.from_config({"api_keys_file": None, "api_keys_env": "MY_KEYS",
                                 "allow_unauthenticated_health": True})
    assert s.check(f"Bearer {K1}") == "env:MY_KEYS:1"


def test_start_fails_without_any_key_or_with_missing_file(tmp_path):
    with pytest.raises(AuthConfigError, match="no such file"):
        store(tmp_path / "nope")
    with pytest.raises(AuthConfigError, match="no valid API key"):
        store(None, env={})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(AuthConfigError, match="no valid API key"):
        store(tmp_path / "empty")


# -- rotation and revocation ---------------------------------------------------------------------

def test_rotation_and_revocation_by_rewriting_the_file(keyfile):
    clock = FakeClock()
    s = store(keyfile, clock=clock)
    # rotate: add K3 next to K1
    write_keys(keyfile, f"alice:{K1}\nalice-new:{K3}\n", bump_ns=1_000_000)
    assert s.check(f"Bearer {K3}") is None  # not looked at yet (within the 1 s interval)
    clock.t += 1.0
    assert s.check(f"Bearer {K3}") == "alice-new"
    assert s.check(f"Bearer {K2}") is None  # K2 was dropped from the file: revoked
    # revoke the old key
    write_keys(keyfile, f"alice-new:{K3}\n", bump_ns=2_000_000)
    clock.t += 1.0
    assert s.check(f"Bearer {K1}") is None
    assert s.check(f"Bearer {K3}") == "alice-new"


def test_atomic_replace_is_seen_even_with_the_same_mtime(keyfile, tmp_path):
    clock = FakeClock()
    s = store(keyfile, clock=clock)
    st = keyfile.stat()
    new = tmp_path / "api-keys.new"
    new.write_text(f"bob:{K3}\n")
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, keyfile)  # what `mv` and Kubernetes Secret updates do: a new inode
    clock.t += 1.0
    assert s.check(f"Bearer {K3}") == "bob" and s.check(f"Bearer {K1}") is None


def test_deleted_file_revokes_its_keys_but_keeps_env_keys(keyfile):
    clock = FakeClock()
    s = store(keyfile, env={"SPECSERVE_API_KEYS": K3}, clock=clock)
    keyfile.unlink()
    clock.t += 1.0
    assert s.check(f"Bearer {K1}") is None
    assert s.check(f"Bearer {K3}") is not None
    write_keys(keyfile, f"alice:{K1}\n")
    clock.t += 1.0
    assert s.check(f"Bearer {K1}") == "alice"


def test_file_is_not_statted_more_than_once_per_interval(keyfile, monkeypatch):
    clock = FakeClock()
    s = store(keyfile, clock=clock)
    calls = []
    real = type(keyfile).stat
    monkeypatch.setattr(type(keyfile), "stat", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for _ in range(50):
        s.check(f"Bearer {K1}")
    clock.t += 1.0
    for _ in range(50):
        s.check(f"Bearer {K1}")
    assert len(calls) == 1


# -- constant-time check --------------------------------------------------------------------------

@pytest.mark.parametrize("presented", [f"Bearer {K1}", f"Bearer {K3}", "Bearer x", "", None, "Basic abc"])
def test_every_digest_is_compared_whatever_is_presented(keyfile, monkeypatch, presented):
    s = store(keyfile, env={"SPECSERVE_API_KEYS": K3})
    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    s.check(presented)
    assert seen == [(32, 32)] * 3  # all keys, fixed-length digests, no early exit on a match


# -- header parsing --------------------------------------------------------------------------------

@pytest.mark.parametrize("value,token", [
    (f"Bearer {K1}", K1),
    (f"bearer {K1}", K1),
    (f"BEARER {K1}", K1),
    (f"  Bearer \t  {K1}  ", K1),
    ("Bearer", None),
    ("Bearer ", None),
    ("", None),
    (None, None),
    (K1, None),  # no scheme
    (f"Basic {K1}", None),
    (f"Bearer {K1} extra", None),
    (f"Bearer {K1}\u00e9", None),  # non-ASCII
    ("Bearer \u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9", None),
    (f"Bearer{K1}", None),
])
def test_bearer_token_edge_cases(value, token):
    assert bearer_token(value) == token


def test_store_check_header_cases(keyfile):
    s = store(keyfile)
    assert s.check(f"bearer   {K1} ") == "alice"
    for bad in (None, "", "Bearer", f"Bearer {K1[:-1]}", f"Bearer {K1}x", f"Token {K1}", f"Bearer {K1}\u00e9"):
        assert s.check(bad) is None


def test_http_extractor_case_insensitive_and_ambiguous():
    assert bearer_from_http(Headers(raw=[(b"authorization", f"Bearer {K1}".encode())])) == f"Bearer {K1}"
    assert bearer_from_http({"AUTHORIZATION": "Bearer x"}) == "Bearer x"
    assert bearer_from_http({}) is None
    two = Headers(raw=[(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")])
    assert bearer_from_http(two) is None
    # non-ASCII bytes reach starlette as latin-1 text; the check refuses them
    latin = Headers(raw=[(b"authorization", "Bearer caf\u00e9".encode("latin-1"))])
    assert bearer_token(bearer_from_http(latin)) is None


class FakeGrpcContext:
    def __init__(self, md):
        self._md = md

    def invocation_metadata(self):
        return self._md


def test_grpc_extractor_from_context_or_pairs():
    assert bearer_from_grpc(FakeGrpcContext([("x-other", "1"), ("authorization", "Bearer k")])) == "Bearer k"
    assert bearer_from_grpc([("authorization", b"Bearer k")]) == "Bearer k"
    assert bearer_from_grpc(FakeGrpcContext([])) is None
    assert bearer_from_grpc(None) is None
    assert bearer_from_grpc([("authorization", "Bearer a"), ("authorization", "Bearer b")]) is None


def test_error_message_does_not_say_what_was_wrong():
    assert AUTH_ERROR_MESSAGE == "missing or invalid API key"


# -- log redaction ---------------------------------------------------------------------------------

def test_redact_keeps_only_the_length():
    assert redact("secret prompt", debug=False) == "<redacted 13 chars>"
    assert redact([{"role": "user"}], debug=False) == "<redacted 1 items>"
    assert redact(None, debug=False) is None and redact(3, debug=False) == 3
    assert redact("secret prompt", debug=True) == "secret prompt"


def test_redact_message_forms():
    msg = ('req 1 {"prompt": "tell me \\"x\\"", "max_tokens": 5} text=\'hello, world\' '
           'messages: [{"role": "user", "content": "hi"}] completion=abc tokens=3')
    out = redact_message(msg)
    for secret in ("tell me", "hello, world", '"hi"', "abc"):
        assert secret not in out
    assert "max_tokens" in out and "tokens=3" in out and "req 1" in out


def _capture(debug):
    logger = logging.getLogger(f"specserve.test.redact.{debug}")
    logger.propagate = False
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(handler.format(r))
    logger.addHandler(handler)
    handler.addFilter(RedactTextFilter(debug=debug))
    return logger, records


def test_filter_strips_text_from_args_extra_and_message():
    logger, records = _capture(debug=False)
    logger.warning("request %s: %s", "r1", {"prompt": "my secret", "k": 3})
    logger.warning("request %(rid)s prompt=%(prompt)s", {"rid": "r2", "prompt": "my secret"})
    logger.warning("request r3", extra={"completion": "my secret"})
    logger.warning("engine said text: 'my secret'")
    assert len(records) == 4 and not any("my secret" in r for r in records), records
    assert "r1" in records[0] and "'k': 3" in records[0]


def test_filter_passes_text_with_debug_flag(monkeypatch):
    monkeypatch.setenv("SPECSERVE_DEBUG_LOG_TEXT", "1")
    assert RedactTextFilter().debug
    logger, records = _capture(debug=None)
    logger.warning("prompt=%s", "visible")
    assert records == ["prompt=visible"]


def test_install_redaction_is_idempotent():
    logger = logging.getLogger("specserve.test.install")
    h = logging.NullHandler()
    logger.addHandler(h)
    try:
        install_redaction(["specserve.test.install"], debug=False)
        install_redaction(["specserve.test.install"], debug=False)
        assert sum(isinstance(f, RedactTextFilter) for f in h.filters) == 1
    finally:
        logger.removeHandler(h)


def test_specserve_records_reach_the_serve_component_log_once_and_redacted():
    """route_to_serve_log: a specserve.* record goes to the handlers of the (non-propagating) Serve
    component logger, once however often replicas call it, through the redaction filter."""
    from cluster.ops.logsafe import route_to_serve_log

    serve = logging.getLogger("specserve-test.serve")
    serve.propagate = False
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    h = Capture()
    serve.addHandler(h)
    ours = logging.getLogger("specserve-test.ours")
    try:
        install_redaction(["specserve-test.serve"], debug=False)
        assert route_to_serve_log("specserve-test.ours", "specserve-test.serve") == 1
        assert route_to_serve_log("specserve-test.ours", "specserve-test.serve") == 0
        logging.getLogger("specserve-test.ours.tuning").warning("ignoring key %s: prompt=%s", "k1", "secret text")
        assert len(records) == 1
        assert records[0].startswith("ignoring key k1") and "secret text" not in records[0]
    finally:
        serve.removeHandler(h)
        ours.handlers.clear()
