"""The port's enrolment endpoint: a teammate without a key asks for one.

    POST /v1/enrolments        {"name": "alice"}  -> 202 {"id", "code", "expires_in",
                                                     "address", "port_address", ...}
    GET  /v1/enrolments/{id}?wait=S               -> {"status": "pending", ...} after at
                                                     most S seconds (30 at most), or the
                                                     approved key once (made
                                                     then), or 403 refused (once),
                                                     404 expired or unknown

The code is bound to the connection (`backend.keys.enrolment_code`); `address` and
`port_address` echo its two ends as the port sees them (the requester's address; the
address and port number it reached), so `connect` shows where the port sees it from.
Both are open without a key (the requester has none yet): the owner's approval is what
grants anything, the id is 192 random bits only the requester learns, and the state
behind them is bounded and rate-limited (`backend.keys.enrolments`).  Open only while the
owner accepts requests (`backend.keys.enrolment_window`: the port announced, or an accept
window open); else 404 `enrolment_closed`, saying why.

**Doors anyone can open hold little.**  Anyone on the network reaches these two routes,
so what they hold of the port is bounded here: a request body is read under the gated
routes' deadline (`header_timeout` for each part, the whole at `MIN_BODY_RATE`; 408
after, and the connection closed); at most `MAX_IN_FLIGHT` of these requests run at
once (past it 429 `keyless_requests_full`, the connection closed, its body unread); an
id is polled by at most `POLLS_PER_REQUEST` connections at once and the port holds at
most `MAX_POLLS` polls (429 `too_many_polls`).  Each marks its connection keyless
(`backend.port.server.KEYLESS_EXTENSION`), so that a full port closes it before it
turns away a newcomer.  A client that leaves, mid-body or mid-poll, ends its request
at once (`ClientGone`: 499 in the log), and a poll whose client left collects nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from backend.api_paths import ENROLMENTS
from backend.keys.enrolment_window import EnrolmentWindow
from backend.keys.enrolments import APPROVED, PENDING, Enrolments
from backend.errors import (EnrolmentClosed, InvalidRequest, KeylessRequestsFull,
                            TooManyPolls)
from backend.keys.key_store import KeyRecord
from backend.port.request_body import ClientGone, read_body
from backend.port.server import KEYLESS_EXTENSION
from backend.settings import Settings

__all__ = ["MAX_BODY", "MAX_IN_FLIGHT", "MAX_POLLS", "MAX_WAIT",
           "POLLS_PER_REQUEST", "EnrolmentEndpoint"]

#: Seconds one poll may be held open before it is answered "pending".
MAX_WAIT = 30.0
#: Bytes of a request body: a name fits in far less.
MAX_BODY = 4096
#: Enrolment requests (asks and polls) running at once, from everyone: a few teammates
#: connecting need a handful; a slow sender holds one for `header_timeout` at most.
MAX_IN_FLIGHT = 64
#: Polls of one enrolment request held at once: `gguf-studio connect` keeps one open,
#: and a second covers its next poll arriving before the port saw the first one go.
POLLS_PER_REQUEST = 2
#: Polls the port holds at once, over every request (at most `MAX_REQUESTS` are kept,
#: so `POLLS_PER_REQUEST` bounds them first; this holds should that bound grow).
MAX_POLLS = 32
#: Retry-After of a poll turned away: held polls are answered within `MAX_WAIT`.
POLL_RETRY_AFTER = 5.0
#: Retry-After of a request turned away while `MAX_IN_FLIGHT` run: a slow one holds its
#: place for `header_timeout` at most, a quick one for milliseconds.
BUSY_RETRY_AFTER = 5.0


class EnrolmentEndpoint:
    """`enrolments`: the port's requests; `window()`: whether the port takes them now;
    `describe(record)`: what a client of that key needs to know of the port's models;
    `settings()`: the port's settings as they are now (its body deadline)."""

    def __init__(self, enrolments: Enrolments, window: Callable[[], EnrolmentWindow],
                 describe: Callable[[KeyRecord], dict[str, Any]],
                 settings: Callable[[], Settings]) -> None:
        self._enrolments = enrolments
        self.window = window
        self._describe = describe
        self._settings = settings
        #: Requests running now (asks and polls).
        self.in_flight = 0
        #: Polls held now, by enrolment id.
        self._polls: dict[str, int] = {}

    async def create(self, request: Request) -> Response:
        enrolments = self._open()
        with self._held(request):
            body = await read_body(request.receive, request.scope["headers"], MAX_BODY,
                                   self._settings().header_timeout)
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):
                data = None
            client = request.client.host if request.client is not None else "unknown"
            # Where this connection reached the port (its socket's own address): the code
            # binds both ends, and the answer echoes them so `connect` can compare.
            host, port = request.scope.get("server") or ("", 0)
            reached_at = (str(host), int(port or 0))
            # Not JSON, or no name: refused by `request`, which takes a token for every try.
            enrolment = enrolments.request(data.get("name") if isinstance(data, dict) else None,
                                           client, reached_at)
            return JSONResponse({"id": enrolment.token, "name": enrolment.name,
                                 "code": enrolment.code, "status": PENDING,
                                 "address": client, "port_address": list(reached_at),
                                 "expires_in": math.ceil(enrolments.seconds_left(enrolment)),
                                 "poll": f"{ENROLMENTS}/{enrolment.token}"}, status_code=202)

    async def poll(self, request: Request) -> Response:
        enrolments = self._open(polling=True)
        try:
            wait = min(MAX_WAIT, max(0.0, float(request.query_params.get("wait", "0"))))
        except ValueError:
            raise InvalidRequest("wait is a number of seconds.", param="wait") from None
        if not math.isfinite(wait):
            wait = 0.0
        # 404 if unknown; the refusal (once) if the owner refused it.
        token = enrolments.find(str(request.path_params["token"])).token
        with self._held(request), self._polling(token):
            enrolment = await _unless_gone(enrolments.wait(token, wait), request.receive)
            if enrolment.state == PENDING:
                return JSONResponse({"status": PENDING, "name": enrolment.name,
                                     "code": enrolment.code,
                                     "expires_in": math.ceil(enrolments.seconds_left(enrolment))})
            record, secret = enrolments.collect(enrolment)  # the key is made now, once
            return JSONResponse({"status": APPROVED, "name": record.name, "api_key": secret,
                                 "port": self._describe(record)},
                                headers={"Cache-Control": "no-store"})

    @property
    def polls(self) -> int:
        """Polls held now."""
        return sum(self._polls.values())

    def _open(self, *, polling: bool = False) -> Enrolments:
        window = self.window()
        if not (window.answers_polls if polling else window.open):
            raise EnrolmentClosed(window.closed_message())
        return self._enrolments

    @contextlib.contextmanager
    def _held(self, request: Request) -> Iterator[None]:
        """One of the `MAX_IN_FLIGHT` places, its connection marked keyless."""
        if self.in_flight >= MAX_IN_FLIGHT:
            raise KeylessRequestsFull("The server is answering as many requests without a key "
                                      "as it takes at once. Try again shortly.",
                                      retry_after=BUSY_RETRY_AFTER)
        mark = request.scope.get("extensions", {}).get(KEYLESS_EXTENSION)
        if mark is not None:
            mark()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextlib.contextmanager
    def _polling(self, token: str) -> Iterator[None]:
        held = self._polls.get(token, 0)
        if held >= POLLS_PER_REQUEST:
            raise TooManyPolls(f"This enrolment request is polled by {held} connections "
                               "already; wait for their answer.", retry_after=POLL_RETRY_AFTER)
        if self.polls >= MAX_POLLS:
            raise TooManyPolls("The server holds as many enrolment polls as it keeps open. "
                               "Try again shortly.", retry_after=POLL_RETRY_AFTER)
        self._polls[token] = held + 1
        try:
            yield
        finally:
            left = self._polls.pop(token) - 1
            if left:
                self._polls[token] = left


async def _unless_gone(waiting: Any, receive: Receive) -> Any:
    """What `waiting` returns; ClientGone as soon as the client disconnects first (a
    poll held for half a minute must not outlive its connection, nor collect a key no
    one will read)."""
    task = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone):
            pending.cancel()
    if gone.done():  # the client left: what the wait found goes unsaid (and uncollected)
        for finished in (gone, task):
            if finished.done() and not finished.cancelled():
                finished.exception()  # retrieved: no "never retrieved" warning
        raise ClientGone()
    return task.result()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request itself has no body left)."""
    while (await receive())["type"] != "http.disconnect":
        pass
