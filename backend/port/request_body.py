"""Reading and checking the JSON body of a gated request, and its one output limit.

The body must be standard JSON as llama-server reads it: UTF-8, no `NaN` or `Infinity`,
no number beyond a double's range, no half of a surrogate pair (Python's reader takes all
of these, llama-server's answers them with a 500).  The gateway checks what it depends on
(a JSON object, `model`, `stream`, the token limits), and `backend.port.request_fields` the
shapes of the fields the engine reads; everything else is forwarded untouched.

A request may give its output limit in several fields, and llama-server obeys the first
it reads (`backend.admission.output_limits`), not the smallest: `{"max_tokens": 1, "n_predict": 40}`
generates 40.  The port works out that one limit as the engine would (`requested_output`),
holds it to the operator's cap (`output_limit`), and writes it into every limit field the
route's engine reads, so that what admission reserves (`backend.admission.prompt_tokens.
output_budget`) and what the engine generates are the same number.  The body is
re-encoded only when that changed it.

A body of `PARSE_OFF_LOOP_BYTES` or more is parsed in a worker thread (`check_body`).
The C JSON decoder never lets go of the GIL by itself, so a thread alone would not help:
in the thread every JSON object is built by a Python-level hook, where the interpreter
hands the GIL back to the event loop every few milliseconds.  Measured on the test
machine (2 cores) with 25 MiB of tiny messages: the loop stood still 0.57-0.71 s for a
parse on the loop, at most 0.05-0.07 s while the port parsed it
(tests/backend/port/test_request_body.py prints both).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from starlette.types import Receive

from backend.admission.output_limits import CLIENT_LIMIT, ENGINE_LIMITS, output_limit
from backend.api_paths import EMBEDDINGS
from backend.errors import BodiesInFlightFull, BodyTooLarge, InvalidRequest, RequestTimeout
from backend.port.request_fields import check_fields

__all__ = ["BodyBudget", "BodyHold", "ClientGone", "MIN_BODY_RATE", "PARSE_OFF_LOOP_BYTES",
           "Parsed", "check_body", "name_model", "parse_body", "read_body"]

#: Bodies at least this large are parsed off the event loop.  Below it a parse takes
#: about 10 ms at most (the slowest JSON, tiny objects, parses at ~25 MB/s here), less
#: than the thread hand-off is worth; almost every chat turn is far smaller.
PARSE_OFF_LOOP_BYTES = 256 * 1024

#: The least average rate of a request body, in bytes per second, once its first
#: `header_timeout` seconds are spent (Apache's mod_reqtimeout asks 500): a phone on a
#: poor link still sends far more, a client trickling a byte per part timeout far less.
MIN_BODY_RATE = 1024

#: Retry-After of a request refused while the budget of incoming bodies is full: bodies
#: leave it as fast as they are read and checked.
BUSY_RETRY_AFTER = 1.0

_ALL_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
#: The largest limit llama-server takes (a 32-bit int; beyond it, an error of its parser).
_MAX_LIMIT = 2**31 - 1
#: A `\\uD800`-`\\uDFFF` escape (only where one is found is the parsed body searched for a
#: half of a surrogate pair, which Python's reader accepts and llama-server's refuses).
_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


@dataclass(slots=True)
class Parsed:
    body: bytes
    stream: bool
    model: str | None
    #: The parsed body (its one output limit written), for counting its prompt tokens.
    data: dict[str, Any] = field(default_factory=dict)


class BodyBudget:
    """The request-body bytes a port reads, parses and counts at once (before they wait
    in line or run, where the queue's own bounds hold them).  Each request takes a
    `BodyHold` that grows with its body and is released when it is admitted or refused;
    past `limit` bytes (read live: 0 = no bound) a request gets 429, unless it is alone
    (its own size is `max_body_bytes`' business)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        #: Bytes held now.
        self.used = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)


class BodyHold:
    """One request's share of a `BodyBudget`; `release()` is safe to call twice."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def reserve(self, total: int) -> None:
        """Hold `total` bytes (no change if it holds as many); BodiesInFlightFull if the
        budget cannot take them."""
        budget = self._budget
        if total <= self.size:
            return
        others = budget.used - self.size
        limit = budget.limit()
        if limit > 0 and others > 0 and others + total > limit:
            raise BodiesInFlightFull(
                f"The server is reading and checking as many request bytes as it takes at "
                f"once ({_size(limit)}). Try again shortly.", retry_after=BUSY_RETRY_AFTER)
        budget.used = others + total
        self.size = total

    def release(self) -> None:
        self._budget.used -= self.size
        self.size = 0


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int,
                    timeout: float = 0.0, hold: BodyHold | None = None) -> bytes:
    """The whole request body; BodyTooLarge past `limit` bytes (at least 1), and
    RequestTimeout when the next part takes longer than `timeout` seconds, or the whole
    body longer than `timeout` plus a second per `MIN_BODY_RATE` bytes received (0:
    never): a client sending a byte just before each part's timeout is not idle, but
    it would hold its connection and its place in the in-flight budget for ever.

    The declared Content-Length is checked first, then the bytes actually received (a
    chunked upload has no Content-Length, and a lying one is no excuse).  `hold` grows
    with the bytes received, not with the length declared: declaring costs a client
    nothing, so it must not take the budget from others.
    """
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise InvalidRequest("The Content-Length header is not a number.") from None
            if declared > limit:
                raise _too_large(limit)
            break
    chunks: list[bytes] = []
    total = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            async with asyncio.timeout(min(timeout, deadline - loop.time()) if timeout else None):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout("The request body arrived too slowly.") from None
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            deadline += len(chunk) / MIN_BODY_RATE
            total += len(chunk)
            if total > limit:
                raise _too_large(limit)
            if hold is not None:
                hold.reserve(total)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is larger than the limit of {_size(limit)}.")


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


async def check_body(route: str, raw: bytes, max_output_tokens: int) -> Parsed:
    """`parse_body`, in a worker thread for a large body (see the module's docstring)."""
    if len(raw) < PARSE_OFF_LOOP_BYTES:
        return parse_body(route, raw, max_output_tokens)
    return await asyncio.to_thread(parse_body, route, raw, max_output_tokens, yielding=True)


def parse_body(route: str, raw: bytes, max_output_tokens: int, *,
               yielding: bool = False) -> Parsed:
    """Check `raw` for `route` and write its one output limit (`output_limit`, with the
    operator's cap `max_output_tokens`, 0: none); InvalidRequest when unusable.

    `yielding`: build objects in Python, so that another thread (the event loop) runs
    while this one parses."""
    try:
        text = raw.decode("utf-8")
        data = json.loads(text, parse_constant=_not_a_number, parse_float=_finite,
                          parse_int=_int_literal, object_pairs_hook=_dict if yielding else None)
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not UTF-8 text.") from None
    except _NotStandard as error:
        raise InvalidRequest(f"The request body is not valid JSON: {error}") from None
    except (ValueError, RecursionError):
        raise InvalidRequest("The request body is not valid JSON.") from None
    if _LONE_SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise InvalidRequest("The request body is not valid JSON: a \\u escape names half "
                             "of a UTF-16 surrogate pair.")
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string.", param="model")
    stream = data.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false.", param="stream")
    for name in _ALL_LIMITS:
        value = data.get(name)
        if value is not None and not (_positive_int(value) and value <= _MAX_LIMIT):
            raise InvalidRequest(f"'{name}' must be a positive whole number (at most "
                                 f"{_MAX_LIMIT}).", param=name)
    n_predict = data.get("n_predict")
    if n_predict is not None and (not _int(n_predict) or not -1 <= n_predict <= _MAX_LIMIT):
        raise InvalidRequest(f"'n_predict' must be a whole number from -1 to {_MAX_LIMIT}.",
                             param="n_predict")

    check_fields(route, data)

    changed = _write_limit(route, data, output_limit(route, data, max_output_tokens))
    if route == EMBEDDINGS:
        stream = False
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() if changed else raw
    return Parsed(body=body, stream=stream, model=model, data=data)


def name_model(parsed: Parsed, model: str) -> None:
    """`parsed` sent naming `model` (it named none): its body encoded again with it."""
    parsed.data["model"] = parsed.model = model
    parsed.body = json.dumps(parsed.data, ensure_ascii=False, separators=(",", ":")).encode()


def _write_limit(route: str, data: dict[str, Any], limit: int | None) -> bool:
    """Make every limit field of `route`'s engine that `data` holds say `limit` (the
    client's field when it holds none); whether `data` changed.  A limit of 0 (only
    `n_predict` says that) leaves `n_predict` alone: the client fields it overrides go,
    as they cannot say 0."""
    if limit is None:
        return False  # nothing set, or only an n_predict of -1 the engine reads alone
    changed = False
    given = False
    for name in ENGINE_LIMITS[route]:
        if name not in data:
            continue
        given = True
        if limit == 0 and name != "n_predict":
            del data[name]
            changed = True
        elif data[name] != limit:
            data[name] = limit
            changed = True
    if not given:
        data[CLIENT_LIMIT[route]] = limit
        changed = True
    return changed


class _NotStandard(Exception):
    """JSON that Python's reader takes and llama-server's (standard JSON) refuses."""


def _not_a_number(name: str) -> Any:
    raise _NotStandard(f"{name} is not a JSON number.")


def _finite(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _NotStandard(f"the number {literal[:20]}… is too large.")
    return value


def _int_literal(literal: str) -> int:
    if len(literal) > 300 and math.isinf(float(literal)):
        raise _NotStandard(f"the number {literal[:20]}… is too large.")
    return int(literal)


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string (or key) in `data` holds half of a surrogate pair (a whole pair
    is decoded to one character, so any surrogate left is half of one)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            items: Any = (item,)
        elif isinstance(item, dict):
            stack.extend(item.values())
            items = item.keys()
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in items:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A Python frame per JSON object: a point where the GIL can change hands.
    return dict(pairs)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0
