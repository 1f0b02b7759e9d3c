"""The access log: one line per request, `METHOD PATH STATUS TIMEms`, never a body.

The path is the one the client sent, still percent-encoded, with any byte outside
printable ASCII escaped as well: a decoded path would let a client write its own lines
into the log (`/x%0aPOST /v1/chat/completions 200` is two lines once decoded), and the
window shows this log to the person running the server.  An enrolment poll's id (which
fetches a teammate's new key, once) is left out: `/v1/enrolments/…`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping
from urllib.parse import quote

from backend.api_paths import ENROLMENTS

__all__ = ["ACCESS_LOGGER", "log_request", "loggable_path"]

ACCESS_LOGGER = "gguf_studio.access"
access_log = logging.getLogger(ACCESS_LOGGER)


def log_request(scope: Mapping[str, Any], status: int, elapsed_ms: float) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s %s %d %.1fms", _printable(scope["method"].encode("latin-1")),
                        loggable_path(scope), status, elapsed_ms)


def loggable_path(scope: Mapping[str, Any]) -> str:
    """The request's path as sent (no query), every unprintable byte as `%XX`."""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes):  # a server that does not give it: re-encode
        raw = quote(scope["path"], safe="/:@!$&'()*+,;=-._~").encode("ascii")
    if raw.startswith(_ENROLMENT_POLLS) and len(raw) > len(_ENROLMENT_POLLS):
        return _ENROLMENT_POLLS.decode() + "…"
    return _printable(raw)


_ENROLMENT_POLLS = ENROLMENTS.encode() + b"/"


def _printable(raw: bytes) -> str:
    return "".join(chr(b) if 0x21 <= b <= 0x7E else f"%{b:02X}" for b in raw)
