"""The access log: one line per request, `METHOD PATH STATUS TIMEms key NAME from ADDRESS`
(the key's name once the port knew it, the client's address), never a body; a 499 says
"stopped by the client" as the request inspector does.

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

__all__ = ["ACCESS_LOGGER", "KEY_NAME", "log_request", "loggable_path", "status_words"]

ACCESS_LOGGER = "gguf_studio.access"
#: Where the port notes the name of a request's key in its ASGI scope, for this log.
KEY_NAME = "gguf_studio.key"
access_log = logging.getLogger(ACCESS_LOGGER)
#: The statuses that are no HTTP reason phrase's, in the words of every view.
_WORDS = {499: "stopped by the client"}


def log_request(scope: Mapping[str, Any], status: int, elapsed_ms: float) -> None:
    if access_log.isEnabledFor(logging.INFO):
        words = status_words(status)
        key = scope.get(KEY_NAME)
        client = scope.get("client")
        access_log.info("%s %s %d%s %.1fms%s%s", _printable(scope["method"].encode("latin-1")),
                        loggable_path(scope), status, f" ({words})" if words else "",
                        elapsed_ms, f" key {key}" if key else "",
                        f" from {_printable(str(client[0]).encode())}" if client else "")


def status_words(status: int) -> str:
    """What a status the client got means, where no reason phrase says it ("" if none)."""
    return _WORDS.get(status, "")


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
