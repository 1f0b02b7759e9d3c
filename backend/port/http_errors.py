"""The one place where an error becomes an answer to a client.

* `error_response` / `http_error` — an HTTP answer: OpenAI-style JSON body
  `{"error": {"message", "type", "code", "param"}}` (code always a string), the error's
  status, and `Retry-After` (whole seconds, at least 1) when the error carries one.
* `stream_error` — the same error inside a stream whose headers are already sent:
  chat/completions `data: {"error":…}` then `data: [DONE]`; messages the same with
  `event: error`; responses `event: response.failed` with the response id the client
  already has.
* `as_request_error` — anything else (a bug) becomes a generic 500 `internal_error`;
  the exception is logged, its text never reaches the client.
* `upstream_error` — an error answer of llama-server, reduced to the four OpenAI keys
  with anything that looks like an internal (paths, addresses, URLs) cut out; its 500s
  that are about the request (a type error of its JSON library, unreadable messages or
  tools) become the 400s they are, without the library's text, and its 501s (what the
  load does not do, such as embeddings) 400s too.

Every refusal produced by the port is counted in
`gguf_studio_rejections_total{reason,model,engine}` here, exactly once: by the function
that renders it, under the labels of the `ModelCounts` it is given (a bare `Metrics`
counts it under no model).  Errors relayed from llama-server
(`UpstreamAnswer`) are its answers, not the port's refusals, and are not counted.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import TYPE_CHECKING, Any

from starlette.responses import Response
from starlette.types import Send

from backend.port import sse
from backend.errors import RETRY_SOON, RequestError, UpstreamFailed

if TYPE_CHECKING:
    from backend.port.metrics import Metrics, ModelCounts

    Counts = Metrics | ModelCounts

__all__ = [
    "INTERNAL_MESSAGE",
    "UpstreamAnswer",
    "as_request_error",
    "error_body",
    "error_response",
    "http_error",
    "scrub",
    "stream_error",
    "upstream_error",
    "upstream_stream_error",
]

log = logging.getLogger("gguf_studio.gateway")

INTERNAL_MESSAGE = "The server had an internal error while handling the request."



class UpstreamAnswer(RequestError):
    """An error answer of llama-server itself, relayed (cleaned) to the client."""

    def __init__(self, message: str, *, status: int, type: str, code: str,
                 param: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.type = type
        self.code = code
        self.extra = extra or {}


# --- bodies --------------------------------------------------------------------------


def error_body(error: RequestError) -> dict[str, Any]:
    body: dict[str, Any] = {
        "message": str(error),
        "type": error.type,
        "code": str(error.code),
        "param": error.param,
    }
    extra = getattr(error, "extra", None)
    if extra:
        body.update(extra)
    return {"error": body}


def retry_after_seconds(error: RequestError) -> int | None:
    if error.retry_after is None:
        return None
    value = error.retry_after
    if not math.isfinite(value):
        return 1
    return max(1, math.ceil(value))


def _count(error: RequestError, metrics: Counts | None) -> None:
    if metrics is not None and not isinstance(error, UpstreamAnswer):
        metrics.count_rejection(str(error.code))


def http_error(error: RequestError, metrics: Counts | None,
               extra_headers: dict[str, str] | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, raw headers, body) of the HTTP answer to `error`; counts the refusal."""
    _count(error, metrics)
    body = json.dumps(error_body(error), ensure_ascii=False).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    seconds = retry_after_seconds(error)
    if seconds is not None:
        headers.append((b"retry-after", str(seconds).encode()))
    for name, value in {**error.answer_headers(), **(extra_headers or {})}.items():
        headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return error.status, headers, body


def error_response(error: RequestError, metrics: Counts | None,
                   extra_headers: dict[str, str] | None = None) -> Response:
    """The HTTP answer to `error` as a Starlette response; counts the refusal."""
    status, headers, body = http_error(error, metrics, extra_headers)
    response = Response(body, status_code=status)
    response.raw_headers = headers
    return response


async def send_http_error(send: Send, error: RequestError, metrics: Counts | None,
                          extra_headers: dict[str, str] | None = None) -> None:
    status, headers, body = http_error(error, metrics, extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def stream_error(error: RequestError, metrics: Counts | None, *, kind: sse.StreamKind,
                 response_id: str | None = None, model: str | None = None) -> bytes:
    """The final bytes of a stream that ends with `error`; counts the refusal.

    The caller makes sure the bytes start at an event boundary.
    """
    _count(error, metrics)
    body = error_body(error)
    if kind is sse.StreamKind.RESPONSES:
        failure = {"code": str(error.code), "message": str(error)}
        response = sse.response_stub(response_id or sse.new_response_id(), model,
                                     status="failed", error=failure)
        return sse.named_event("response.failed",
                               {"type": "response.failed", "response": response})
    if kind is sse.StreamKind.MESSAGES:
        # Anthropic clients raise on `event: error`; OpenAI-style parsers find "error".
        return sse.named_event("error", {"type": "error", **body}) + sse.DONE
    return sse.data_event(body) + sse.DONE


def as_request_error(exc: BaseException) -> RequestError:
    """`exc` itself if it is a RequestError; else a logged, generic internal error."""
    if isinstance(exc, RequestError):
        return exc
    log.error("unexpected error while handling a request", exc_info=exc)
    return RequestError(INTERNAL_MESSAGE)


# --- llama-server's own errors -------------------------------------------------------


def upstream_stream_error(events: bytes) -> RequestError | None:
    """The error carried by llama-server's in-stream error event in `events` (whole SSE
    events), else None.  llama-server ends a stream that fails with `data:
    {"error": {"code": 500, ...}}` (chat, completions, Responses) or `event: error` then
    `data: {"code": 500, ...}` (messages); the code is numeric, so it is normalized like
    an error body, its status taken from that code."""
    for block in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        named_error = False
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                named_error = line[6:].strip() == b"error"
            elif line.startswith(b"data:"):
                try:
                    payload = json.loads(line[5:])
                except ValueError:
                    continue
                if not isinstance(payload, dict):
                    continue
                error = payload.get("error")
                if error is None and named_error:
                    error = payload
                if isinstance(error, dict):
                    code = error.get("code")
                    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
                    return upstream_error(status, json.dumps({"error": error}).encode())
    return None


#: The JSON library's tag in llama-server's messages (`[json.exception.type_error.302] `).
_JSON_EXCEPTION = re.compile(r"\[json\.exception\.[a-z_]+\.\d+\] ?")
_URL = re.compile(r"(?<![\w+.-])[a-z][a-z0-9+.-]*+://\S+", re.IGNORECASE)
_BRACKETED = re.compile(r"\[[0-9a-f.]*:[0-9a-f:.]*\](?::\d{1,5})?", re.IGNORECASE)
_HOST_PORT = re.compile(r"\b(?:\d{1,3}(?:\.\d{1,3}){3}|localhost)(?::\d{1,5})?\b", re.IGNORECASE)
# Any other name with a port ("gpu-box:8080", "models.lan:11434"): a word followed by
# ":digits" is taken for one (an "n:42" in a message is a small loss, a leak is not).
_NAME_PORT = re.compile(r"(?<![\w.-])[a-z][a-z0-9-]*+(?:\.[a-z0-9-]++)*+:\d{2,5}\b",
                        re.IGNORECASE)
# Paths: folders may hold spaces (they end at the next separator); the last part may
# too when it ends in an extension ("/models/My Llama 3.gguf"; the shortest such end).
_LAST_PART = r"(?:{name}+(?: {name}+)*?\.[A-Za-z][A-Za-z0-9]{{0,7}}\b|[^\s'\"(),;]*)"
_WIN_PATH = re.compile(r"\b[A-Za-z]:\\(?:[^\\'\"\n(),;]+\\)*"
                       + _LAST_PART.format(name=r"[^\s\\'\"(),;:]"))
_POSIX_PATH = re.compile(r"(?<![\w/<])(?:~|\.{1,2})?/(?:[^/'\"\n(),;<>]+/)+"
                         + _LAST_PART.format(name=r"[^\s/'\"(),;:]"))
# Scrubbing is linear in practice; the cut first keeps a huge message cheap regardless.
_MAX_SCANNED = 16_000
_MAX_MESSAGE = 2000
_KNOWN_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                "not_found_error", "server_error", "not_supported_error", "unavailable_error",
                "exceed_context_size_error", "rate_limit_error"}
_EXTRA_INTS = ("n_prompt_tokens", "n_ctx")
# llama-server's message (with the numeric code 500) when its KV cache ran out mid-batch.
_CONTEXT_FULL = "Context size has been exceeded"


def _request_fault(message: str) -> UpstreamAnswer | None:
    """A 500 of llama-server that is about the request, as the 400 it is; else None.

    llama-server answers with 500 whatever exception reading a request raises: its JSON
    library's errors (`[json.exception.type_error.302] type must be string, but is
    number`), messages or tools it could not convert, media the model cannot take, values
    it does not know (`Unknown reasoning format: x`).  The port checks the fields it knows
    first (backend.port.request_fields); this catches the rest, by the way llama-server's
    messages for them begin.  The JSON library's text says nothing a client can act on
    and is left out; the others are kept (scrubbed)."""
    for prefix, param, text in _REQUEST_FAULTS:
        if message.startswith(prefix):
            return UpstreamAnswer(text or scrub(message), status=400,
                                  type="invalid_request_error", code="invalid_request",
                                  param=param)
    return None


#: (how the engine's message starts, the field it is about, the client's message: None
#: keeps the engine's own).
_REQUEST_FAULTS: tuple[tuple[str, str | None, str | None], ...] = (
    ("[json.exception.", None, "The model server could not read the request: a field has "
                               "the wrong type or an unusable value."),
    ("Failed to parse messages", "messages", "The model server could not read 'messages': "
                                             "check each message's role, content and tool "
                                             "calls."),
    ("Failed to parse tools", "tools", "The model server could not read 'tools': each tool "
                                       "must be a function with a name."),
    ("image input is not supported", None, "This model does not take images."),
    ("audio input is not supported", None, "This model does not take audio."),
    ("video input is not supported", None, "This model does not take video."),
    ("Multimodal data provided", None, "This model does not take images or audio."),
    ("for mtmd, input prompt must be a string", "prompt", None),
    ("Failed to load image or audio file", None, None),
    ("Failed to download image", None, None),
    ("Invalid base64 value", None, None),
    ("Unknown reasoning format", "reasoning_format", None),
    ('"prompt"', "prompt", None),
    ("'messages' is required", "messages", None),
    ("Only no echo is supported", "echo", None),
    ("Unsupported param: ", None, None),
    ("Cannot use both json_schema and grammar", None, None),
    ("tools param requires --jinja", "tools", None),
    ("tool_choice param requires --jinja", "tool_choice", None),
)


def scrub(text: str) -> str:
    """`text` without URLs, addresses, ports and file-system paths."""
    text = text[:_MAX_SCANNED]
    text = _URL.sub("<url>", text)
    text = _WIN_PATH.sub("<path>", text)
    text = _POSIX_PATH.sub("<path>", text)
    text = _BRACKETED.sub("<address>", text)
    text = _HOST_PORT.sub("<address>", text)
    text = _NAME_PORT.sub("<address>", text)
    if "Traceback" in text:
        text = text.split("Traceback", 1)[0].rstrip() or "The model server reported an error."
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + "…"
    return text


def upstream_error(status: int, body: bytes) -> RequestError:
    """The cleaned-up error for a non-2xx answer of llama-server."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, str):
        error = {"message": error}
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        if status >= 500:
            return UpstreamFailed("The model server failed to answer the request.")
        return UpstreamAnswer("The model server refused the request.", status=status,
                              type="invalid_request_error", code="upstream_error")
    fault = _request_fault(error["message"]) if status == 500 else None
    if fault is not None:
        return fault
    if status == 501:
        # What this load does not do (embeddings without --embeddings, a feature its
        # model lacks): asking for it is the request's problem, as OpenAI answers it.
        status = 400
    raw_type = error.get("type")
    default_type = "server_error" if status >= 500 else "invalid_request_error"
    type_ = raw_type if raw_type in _KNOWN_TYPES else default_type
    code = error.get("code")
    if not isinstance(code, str) or not code:
        context_full = (raw_type == "exceed_context_size_error"
                        or error["message"].startswith(_CONTEXT_FULL))
        code = "context_length_exceeded" if context_full else type_
    # The engine's param names a field of the request, but it is its text: scrubbed too.
    param = scrub(error["param"])[:100] or None if isinstance(error.get("param"), str) else None
    extra = {key: error[key] for key in _EXTRA_INTS
             if isinstance(error.get(key), int) and not isinstance(error.get(key), bool)}
    if not 400 <= status <= 599:
        status = 502
    message = _JSON_EXCEPTION.sub("", error["message"])  # "Field 'x': [json.exception...] ..."
    answer = UpstreamAnswer(scrub(message) or "The model server refused the request.",
                            status=status, type=type_, code=scrub(code)[:100], param=param,
                            extra=extra)
    if status == 503:  # llama-server still loading, or busy: a retry will do
        answer.retry_after = RETRY_SOON
    return answer
