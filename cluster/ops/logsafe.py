"""Logs without user text: prompt and completion text never reach a log line unless the operator
sets `SPECSERVE_DEBUG_LOG_TEXT=1` (read when the filter is built, i.e. at replica start).

`redact(text)` is for code that wants to mention a text ("<redacted 1234 chars>"); `RedactTextFilter`
is a safety net on log handlers: it replaces the values of text-carrying fields (prompt, messages,
content, text, completion, ...) found in a record's `extra` attributes, in dict arguments, and in
`key: "value"` / `'key': 'value'` / `key=value` forms inside the formatted message. It cannot
recognise text logged with no field name at all: code must not do that.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Mapping, Optional

DEBUG_ENV = "SPECSERVE_DEBUG_LOG_TEXT"
TEXT_FIELDS = ("prompt", "messages", "content", "text", "completion", "output", "stop", "delta")
_FIELD_ALT = "|".join(TEXT_FIELDS)
# "prompt": "..." | 'prompt': '...' | prompt="..." | prompt='...' | prompt: [ ... ] (one level of nesting)
_QUOTED = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\''
_LIST = r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
_TEXT_IN_MESSAGE = re.compile(
    rf"""(?P<key>["']?\b(?:{_FIELD_ALT})\b["']?\s*[:=]\s*)(?P<val>{_QUOTED}|{_LIST}|[^\s,}})]+)""",
    re.IGNORECASE,
)


def debug_text_enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def redact(text: Any, debug: Optional[bool] = None) -> Any:
    """User text -> '<redacted N chars>' (the length helps debugging, the content stays out);
    returned unchanged when the debug flag is on. Non-strings (None, numbers) pass through."""
    if debug is None:
        debug = debug_text_enabled()
    if debug or text is None or isinstance(text, (int, float, bool)):
        return text
    if isinstance(text, (list, tuple)):
        return f"<redacted {len(text)} items>"
    return f"<redacted {len(str(text))} chars>"


def redact_message(message: str) -> str:
    """Replace the values of text-carrying fields inside an already formatted log message."""
    return _TEXT_IN_MESSAGE.sub(lambda m: m.group("key") + "<redacted>", message)


def _redact_mapping(d: Mapping) -> dict:
    return {k: (redact(v, debug=False) if str(k).lower() in TEXT_FIELDS else v) for k, v in d.items()}


class RedactTextFilter(logging.Filter):
    """Handler filter that strips user text from every record passing through (see module doc)."""

    def __init__(self, debug: Optional[bool] = None):
        super().__init__()
        self.debug = debug_text_enabled() if debug is None else debug

    def filter(self, record: logging.LogRecord) -> bool:
        if self.debug:
            return True
        for field in TEXT_FIELDS:  # extra={"prompt": ...}
            if field in record.__dict__:
                setattr(record, field, redact(record.__dict__[field], debug=False))
        args = record.args
        if isinstance(args, Mapping):
            args = _redact_mapping(args)
        elif isinstance(args, tuple):
            args = tuple(_redact_mapping(a) if isinstance(a, Mapping) else a for a in args)
        record.args = args
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a broken format string: let the handler report it
            return True
        record.msg, record.args = redact_message(message), None
        return True


def install_redaction(logger_names: Iterable[str] = ("", "ray", "ray.serve", "vllm"),
                      debug: Optional[bool] = None) -> RedactTextFilter:
    """Add one RedactTextFilter to every handler of the named loggers (idempotent); call it in each
    replica's __init__, after Ray and vLLM have set up their handlers."""
    filt = RedactTextFilter(debug=debug)
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactTextFilter) for f in handler.filters):
                handler.addFilter(filt)
    return filt


def route_to_serve_log(logger_name: str = "specserve", serve_logger: str = "ray.serve") -> int:
    """Give the `specserve.*` loggers the handlers of Ray Serve's component logger (idempotent).

    In a Serve replica, Ray Serve writes its own records to the replica's log file
    (`logs/serve/replica_<app>_<deployment>_*.log`) through handlers on `ray.serve`, which does not
    propagate; specserve's loggers propagate to the root logger, whose handler is the worker's stderr
    (`logs/worker-*.err`), so an operator reading the Serve logs missed specserve's warnings. With
    these handlers added they land in both places. Returns how many handlers were added."""
    target = logging.getLogger(logger_name)
    added = 0
    for handler in logging.getLogger(serve_logger).handlers:
        if handler not in target.handlers:
            target.addHandler(handler)
            added += 1
    return added


def setup_replica_logging(debug: Optional[bool] = None) -> None:
    """What every specserve replica calls first in __init__: redaction on every handler, then
    specserve's records into the replica's Serve log too."""
    install_redaction(debug=debug)
    route_to_serve_log()
