"""A request forwarded to the engine its ticket was admitted on, and its answer checked
before anything of it is relayed.

`upstream_request` is the request as the engine gets it: the checked body, with the
seat's slot as `id_slot` when its placement pinned it (`seated`).  `check_answer` lets
through only what llama-server answers; `read_error` reads as much of an error body as
arrives.  `named_failures` is the one place where the upstream client's failures become
the project's errors (`backend.errors`): the engine unreachable, or gone while answering,
or its load replaced meanwhile; a connection refused before anything was sent is
`NotReached`, for the exchange to try the next load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from backend.admission.admission_ticket import Ticket
from backend.api_paths import MESSAGES
from backend.errors import (RETRY_SOON, LoadReplaced, RequestError, UpstreamFailed,
                            UpstreamUnavailable)
from backend.llama.api import engine_headers
from backend.port import sse
from backend.port.prefill import PROGRESS_FIELD
from backend.port.upstream_errors import ConnectFailed, MalformedAnswer, UpstreamError

if TYPE_CHECKING:
    from backend.port.upstream_http import UpstreamClient, UpstreamRequest, UpstreamResponse

__all__ = ["ERROR_BODY_LIMIT", "NotReached", "UPSTREAM_HEADERS", "check_answer",
           "named_failures", "read_error", "seated", "upstream_request"]

UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
#: How much of an upstream error body is read.
ERROR_BODY_LIMIT = 64 * 1024


class NotReached(Exception):
    """The upstream refused the connection (or never accepted it): nothing was sent."""


def upstream_request(client: UpstreamClient, ticket: Ticket, path: str,
                     body: bytes, *, stream: bool = False) -> UpstreamRequest:
    """The request of checked body `body` to `path`, as the ticket's engine gets it; a
    `stream` asks for the engine's progress on its prompt (`backend.port.prefill`),
    but on the Anthropic wire, whose events never carry it."""
    return client.build_request("POST", ticket.serving.base_url + path,
                                content=seated(body, ticket,
                                               progress=stream and path != MESSAGES),
                                headers={**UPSTREAM_HEADERS, **engine_headers(ticket.api_key)})


def seated(body: bytes, ticket: Ticket, *, progress: bool = False) -> bytes:
    """The body as sent to the engine: with the seat's slot as `id_slot` when its
    placement pinned it (a client's own `id_slot` is refused before this), and
    `return_progress` when asked."""
    fields = []
    seat = ticket.seat
    if (seat is not None and seat.pinned and seat.slot is not None
            and ticket.serving.takes_slot_ids):
        fields.append(b'"id_slot":%d' % seat.slot)
    if progress:
        fields.append(b'"%s":true' % PROGRESS_FIELD.encode())
    if not fields:
        return body
    rest = body.lstrip()[1:]  # a checked body is one JSON object
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return b"{" + b",".join(fields) + comma + rest


def check_answer(upstream: UpstreamResponse, *, streamed: bool) -> None:
    """Relay only what llama-server answers: 200 with an event stream for a streamed
    request, JSON otherwise (a redirect, a 2xx without the body asked for, or another
    media type would reach the client as if it were the model's answer)."""
    media = (upstream.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    expected = "text/event-stream" if streamed else "application/json"
    if upstream.status_code != 200 or media != expected:
        raise MalformedAnswer(f"Unexpected answer: {upstream.status_code} {media!r}.")


async def read_error(upstream: UpstreamResponse) -> bytes:
    """As much of an error body as arrives (a cut one still says something)."""
    body = b""
    try:
        async for chunk in upstream.aiter_raw():
            body += chunk
            if len(body) > ERROR_BODY_LIMIT:
                break
    except UpstreamError:
        pass
    return body


@contextlib.contextmanager
def named_failures(ticket: Ticket, *, connecting: bool = False,
                   dropped: Callable[[], None] = lambda: None) -> Iterator[None]:
    """The upstream client's failures inside, as the project's errors; `dropped` is
    called when the engine dropped the request while answering (likely a crash)."""
    try:
        yield
    except UpstreamError as exc:
        if connecting and isinstance(exc, ConnectFailed):
            raise NotReached() from None  # nothing was sent: safe on the next load
        error: RequestError
        if ticket.engine is not None and ticket.engine.retired:
            error = LoadReplaced("The model was reloaded or unloaded while this request "
                                 "ran. Send it again.", retry_after=RETRY_SOON)
        elif isinstance(exc, MalformedAnswer):
            error = UpstreamFailed("The model server sent an invalid answer.")
        elif connecting:
            error = UpstreamUnavailable("The model server could not be reached. "
                                        "Try again shortly.", retry_after=RETRY_SOON)
        else:
            dropped()
            error = UpstreamFailed("The model server stopped while answering. Try again.")
        raise error from None
    except sse.BrokenStream:
        raise UpstreamFailed("The model server's answer broke off in the middle of an "
                             "event. Try again.") from None
