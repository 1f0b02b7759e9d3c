"""One gated request, from admission to the last byte sent to the client.

`Exchange.run` owns the request for its whole life: it takes the ticket from the
admission queue, waits for it (sending keep-alives when the client streams), forwards
the request to the load the ticket was admitted on, has its answer relayed (a stream by
its `backend.port.stream_relay.StreamRelay`, as the chunks come; a whole answer at
once), releases the ticket, and decides what a cancellation means (the client left, the
load went away, the port closes).  A request for a model that is loading waits for its
engine, then is planned by the port's `RequestPlanner` as the others were at once.

What it did: the exchange and its stream relay keep what the books need as the answer
passes (its last bytes, its time to first token, the longest silence between chunks,
its events) and hand it over once, when it ends (`Exchange._settle`, to
`backend.port.settlement`: its usage, its session's place, its prompt cache's verdict,
its record in the request inspector).

Failures of the upstream client become the project's errors in one place
(`backend.port.forwarding.named_failures`); errors become answers through
`backend.port.http_errors`: an HTTP answer while no header was sent, a final in-stream
error event afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from starlette.types import Message, Receive, Send

from backend.port import http_errors
from backend.port import sse
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.admission_ticket import Ticket
from backend.port.metrics import UNROUTED
from backend.admission.need_planner import Plan
from backend.port.gated_request import GatedRequest
from backend.port.own_prefix import own_prefix
from backend.port.audience import Audience, Listener
from backend.port.exchange_host import ExchangeHost
from backend.port.prefill import until_content
from backend.port.refusal_retry import refusal_backoff, wait_turn
from backend.port.resends import JOINED_RUNNING, ORPHAN_BYTES, twin_key
from backend.port.settlement import Ending, Settlement
from backend.port.stream_relay import StreamRelay
from backend.port.client_watch import DisconnectWatch
from backend.errors import (RETRY_SOON, ModelNotReady, QueueTimeout, RequestError,
                            UpstreamUnavailable)
from backend.port.forwarding import (NotReached, check_answer, named_failures, read_error,
                                     upstream_request)

if TYPE_CHECKING:
    from backend.port.metrics import ModelCounts
    from backend.port.server import BodyWriter
    from backend.port.upstream_http import UpstreamResponse

__all__ = ["Exchange", "SSE_HEADERS"]

log = logging.getLogger("gguf_studio.gateway")

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: Seconds a slot freed by a request the engine dropped stays empty (see `run`): a
#: crashed engine is noticed well within it, a live one loses only this much.
ENGINE_FAILURE_HOLD = 0.5


class Exchange:
    """A gated request and its ticket; `run()` answers every RequestError itself."""

    def __init__(self, host: ExchangeHost, line: Line[AdmissionQueue], request: GatedRequest,
                 send: Send, receive: Receive, *,
                 abort_connection: Callable[[], None] | None = None,
                 body_writer: BodyWriter | None = None) -> None:
        self.host = host
        self.client = host.client
        settings = host.settings
        self.queue_timeout = settings.queue_timeout
        self.keepalive_interval = settings.keepalive_interval
        self.line = line
        self.request = request
        self.kind = request.kind
        #: Who the answer goes to: the client, or a buffer while its resend may join
        #: (`backend.port.audience`, `backend.port.resends`).
        self.first = Listener(send, receive, writer=body_writer, abort=abort_connection)
        self.audience = Audience(self.first, limit=ORPHAN_BYTES, overflow=self._cut)
        self.send: Send = self.audience.send
        self.ticket: Ticket | None = None
        self.watch: DisconnectWatch | None = None
        self.stage = "queued"
        self.headers_sent = False
        #: Set when the client went away before its answer was complete.
        self.client_gone = False
        self._task: asyncio.Task[Any] | None = None
        self._abort: RequestError | None = None
        #: Set when the engine dropped the request while answering (see `run`).
        self._engine_dropped = False
        self._stall_timeout = settings.client_stall_timeout
        #: Its twin key once its client left before its answer began (a resend may join
        #: it until `_grace` ends), and whether one did (`RequestRecord.joined`).
        self._twin: str | None = None
        self._grace: asyncio.TimerHandle | None = None
        self.joined: str | None = None
        #: Its wait for its model's load, held from the load until its ticket is taken.
        self._awaiting: asyncio.Future[None] | None = None
        #: Counting a prompt admitted on its byte bound, while it runs.
        self._counting: asyncio.Future[None] | None = None
        self.passage = request.passage
        self.caller = request.passage.caller
        key = self.caller.key
        #: A named key's answers tell nothing of the prompt cache all keys share: what it
        #: held for a prompt would tell how much of another key's prompt a guess matches.
        self._hide_cache = key is not None and not key.is_owner
        #: ... but what its own session's earlier turn left there, which it sent itself
        #: (`own_prefix`, once it has its seat): its own cache hits.
        self._cache_told = 0
        #: Its answer's stream, relayed (`backend.port.stream_relay`), and what it did.
        self.stream = StreamRelay(self.kind, hide_cache=self._hide_cache)
        #: The answer's extra headers (OpenAI's x-ratelimit-* for a key with limits).
        self._extra_headers: list[tuple[bytes, bytes]] = []
        #: The last bytes relayed, where the engine's `usage` is.
        self._tail = b""
        #: Set once the engine's whole answer was relayed.
        self._answered = False
        #: The error the request ended with, if it did.
        self._failed: RequestError | None = None
        #: The status its client got (an error after the stream began leaves 200).
        self._status = 200
        #: For the inspector (`_settle`), all `time.monotonic`: when it arrived and its
        #: wait for its model to load (the stream's own times are the stream relay's).
        self._arrived = request.arrived or time.monotonic()
        self._loading = 0.0

    @property
    def metrics(self) -> ModelCounts:
        """The counts of this request's model and of the engine it was admitted on
        (none before admission, or back in line after a refused connection)."""
        ticket = self.ticket
        engine = ticket.engine if ticket is not None and ticket.admitted_at is not None else None
        return self.host.metrics.of(self.request.model_id or UNROUTED,
                                    engine.label if engine is not None else UNROUTED)

    # --- the whole exchange ---------------------------------------------------------

    async def run(self) -> None:
        """Admit, wait, forward, answer.  The last messages go out after the upstream
        request is closed and the ticket released, so a client that has seen the end of
        its answer can count on its slot being free."""
        if self.request.plan is not None:  # refused at once, before anything else starts
            try:
                self._take_ticket(self.request.plan)
            except RequestError as error:
                last = self._failure(error)
                self._settle()
                self._release_body()
                await self._send_all(last)
                return
        self._task = asyncio.current_task()
        watch = self.watch = DisconnectWatch(self.first.receive, self._orphan)
        self.first.guard(self._stall_timeout, self._stalled)
        self.passage.start(self)
        try:
            try:
                last = await self._admitted_and_forwarded()
            except RequestError as error:
                last = self._failure(error)
            except Exception as exc:  # a bug: a generic 500 / in-stream error, logged
                last = self._failure(http_errors.as_request_error(exc))
        except asyncio.CancelledError:
            if not self._cancelled_by_us():
                raise
            if watch.disconnected:
                self.client_gone = True
                self.metrics.count_cancellation(self.stage)
                last = []
            else:
                last = self._failure(self._abort or ModelNotReady(
                    "The server is shutting down.", retry_after=RETRY_SOON))
        finally:
            self._stop_awaiting()
            if self._counting is not None:
                self._counting.cancel()  # its answer is of no use once the ticket goes
            ticket = self.ticket
            if ticket is None:
                pass  # it never had a place in line
            elif self._engine_dropped:
                # Likely a crash: the waiters wait for the supervisor to say so (it
                # retires the load within milliseconds), not for a dying engine.
                ticket.release(hold=True)
                asyncio.get_running_loop().call_later(ENGINE_FAILURE_HOLD,
                                                      ticket.line.admit_waiting)
            else:
                ticket.release()
            watch.stop()
            self._task = None  # nothing left to abort
            self.passage.close()
            if self.audience.listener is None:
                self.client_gone = True  # left, and no resend came (yet)
            self._settle()
            self._release_body()
        try:
            await self._send_all(last)
        finally:
            self._ended()

    def _release_body(self) -> None:
        """Settled: the request's body (up to `max_body_bytes`) is of no more use, while
        the exchange lives on until its last messages are sent (a slow client's).  (When
        an exchange and its stall guard referred to each other, it lived on until the
        collector found it: 20 requests of 30 MiB left `serve` 420 MiB larger.)"""
        self.request.parsed.body = b""
        self.request.parsed.data = {}

    def _stalled(self) -> None:
        """The client left its answer unread for the stall timeout: drop it (the task
        then ends as for a client that left: upstream request closed, slot freed)."""
        log.info("dropping a client that read nothing for %.0f s", self._stall_timeout)
        self.metrics.count_stalled_client()
        listener = self.audience.listener
        if listener is not None and listener.abort is not None:
            listener.abort()
        if self.watch is not None:
            self.watch.gone()

    # --- a client that left before its answer began, and its resend (`backend.port.resends`)

    def _orphan(self) -> bool:
        """True: the request runs on without its client, that its resend may join it."""
        resends, request = self.host.resends, self.request
        if (resends is None or self.stream.first_at is not None or self._abort is not None
                or self.host.closing or self._task is None):
            return False
        key = self._twin or twin_key(self.caller.flow, request.path, request.model_id or
                                     UNROUTED, request.headers, request.parsed.body)
        if not resends.orphaned(key, self, self.caller.name):
            return False
        self._twin = key
        self.audience.leave()
        self._grace = asyncio.get_running_loop().call_later(resends.grace, self._cut)
        return True

    def _cut(self) -> None:
        """The grace ended (or the answer outgrew what is kept) with nobody there."""
        if self.audience.listener is None and self.watch is not None:
            self.watch.cut()

    async def adopt(self, listener: Listener) -> bool:
        """A resend takes the place of the client that left (`Resends.orphan`); returns
        once it is served no more: True when it had the answer's end."""
        if self._grace is not None:
            self._grace.cancel()
        self.joined = JOINED_RUNNING
        listener.guard(self._stall_timeout, self._stalled)
        if self.watch is not None:
            self.watch.follow(listener.receive)
        await self.audience.join(listener)
        return not await listener.done

    def _ended(self) -> None:
        """An orphan's whole answer, nobody there, is kept for its resend."""
        if self._grace is not None:
            self._grace.cancel()
        resends, audience = self.host.resends, self.audience
        if self._twin is not None and resends is not None:
            resends.claimed(self._twin, self)
            if (audience.listener is None and self._answered and self._failed is None
                    and not audience.overflowed):
                resends.finished(self._twin, audience.recording())
        audience.end(left=self.client_gone)

    def abort(self, key: str, error: RequestError) -> bool:
        """End this request with `error` if it runs on the engine with admission key
        `key` (and close its upstream request, so the engine stops at once).  True when
        it will."""
        ticket = self.ticket
        if (self._task is None or self._abort is not None or ticket is None
                or not ticket.admitted or ticket.serving.key != key):
            return False
        self._abort = error
        self._task.cancel()
        return True

    def end(self, error: RequestError) -> bool:
        """End this request with `error` wherever it is (its key was revoked): waiting,
        or answering (an in-stream error event after what was sent; its upstream request
        closed, so the engine's slot frees at once).  True when it will."""
        if self._task is None or self._abort is not None:
            return False
        self._abort = error
        self._task.cancel()
        return True

    def _cancelled_by_us(self) -> bool:
        """The cancellation came from the client leaving, an abort, or the port closing
        (not from someone else, whose cancellation is re-raised)."""
        watch = self.watch
        ours = watch is not None and (watch.disconnected or self._abort is not None
                                      or self.host.closing)
        task = asyncio.current_task()
        return ours and task is not None and task.uncancel() == 0

    async def _send_all(self, messages: list[Message]) -> None:
        for message in messages:
            await self.send(message)

    def _settle(self) -> None:
        """Close the request's books (`backend.port.settlement`): once, as it ends."""
        stream = self.stream
        Settlement(self.host, self.line, self.request, Ending(
            ticket=self.ticket, failed=self._failed, events=stream.events,
            answered=self._answered,
            tail=self._answer_tail(),
            arrived=self._arrived, loading=self._loading, first_at=stream.first_at,
            last_at=stream.last_at, longest_gap=stream.longest_gap,
            client_gone=self.client_gone, status=self._status, progress=stream.progress,
            joined=self.joined)).close()

    def _failure(self, error: RequestError) -> list[Message]:
        """The last messages for `error`: an HTTP answer, or a final stream event."""
        self._failed = error
        if not self.headers_sent:
            status, headers, body = http_errors.http_error(error, self.metrics)
            self._status = status
            self.headers_sent = True
            return [{"type": "http.response.start", "status": status, "headers": headers},
                    {"type": "http.response.body", "body": body, "more_body": False}]
        self.stream.framer.drop()  # an incomplete event is never completed: leave it out
        rewriter = self.stream.rewriter
        response_id = rewriter.client_id if rewriter else None
        tail = http_errors.stream_error(error, self.metrics, kind=self.kind,
                                           response_id=response_id, model=self.request.model_id)
        return [{"type": "http.response.body", "body": tail, "more_body": False}]

    # --- waiting ----------------------------------------------------------------------

    def _take_ticket(self, plan: Plan) -> Ticket:
        self._stop_awaiting()  # its place in line follows at once: the model stays busy
        passage = self.passage
        tokens = plan.need.total if plan.need is not None else (
            self.request.body_bytes + self.host.settings.default_output_tokens)
        passage.reserve(tokens)  # RateLimitExceeded: 429
        ticket = self.ticket = self.line.request(
            plan.need, size=len(self.request.parsed.body),
            max_waiting_bytes=self.host.settings.max_waiting_body_bytes,
            flow=passage.flow, band=self.request.band, hint=plan.hint)
        self._extra_headers = [(name.encode("latin-1"), value.encode("latin-1"))
                               for name, value in passage.headers().items()]
        if plan.settle_later:
            self._counting = asyncio.ensure_future(plan.settle(ticket))
        return ticket

    async def _admitted_and_forwarded(self) -> list[Message]:
        """Wait for a slot and forward; a load that refused the connection (nothing of
        the request reached it) sends the ticket back to its place in line, to be
        served by the next admission, on this load or the restarted one, within what
        is left of the queue timeout.  A request for a model that is loading first
        waits for its engine, then is planned and takes its place."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout if self.queue_timeout > 0 else None
        ticket = self.ticket
        if ticket is None:
            await self._served(None if deadline is None else deadline - loop.time())
            self.host.recheck(self.caller)  # its key may have gone while the model loaded
            request = self.request
            parsed = request.parsed
            plan = await self.host.planner.plan_after_load(
                self.line, request.path, request.model_id or UNROUTED, parsed.data,
                request.body_bytes, request.hint, request.blocks)
            parsed.data = {}
            ticket = self._take_ticket(plan)
        while True:
            timeout = None if deadline is None else max(deadline - loop.time(), 0.001)
            await self._admitted(ticket, timeout)
            parking = self.host.parking
            pending = None if parking is None else await parking.before_send(
                ticket, self.request.model_id, self.request.parsed.body)
            try:
                try:
                    last = await self._forward(ticket)
                except asyncio.CancelledError:
                    if not self._left_with_whole_answer():
                        raise
                    last = []
                if parking is not None:
                    parking.after_answer(pending, self._answer_tail())
                    parking.remember(ticket, self.request.model_id, self.request.path,
                                     self.request.parsed.body)
                return last
            except NotReached:
                refused_by = self.metrics  # the engine's counts, before the ticket leaves it
                if not ticket.requeue():
                    raise UpstreamUnavailable("The model server could not be reached. "
                                              "Try again shortly.", retry_after=RETRY_SOON) from None
                refused_by.count_requeue()
                self.stage = "queued"

    def _left_with_whole_answer(self) -> bool:
        """Did the client hang up once it had its whole answer, before the engine's
        stream was over (clients stop reading at `[DONE]` or the final usage)?  Then the
        answer was answered, not cancelled: its turn is judged, its session's prefix
        placed and remembered like any other, and the task's cancellation withdrawn."""
        watch = self.watch
        if watch is None or not watch.disconnected or not self.headers_sent:
            return False
        if not self.stream.whole():
            return False
        task = asyncio.current_task()
        if task is None or task.cancelling() != 1:
            return False  # cancelled by someone else too
        task.uncancel()
        self._tail = b"".join(self.stream.last_sent)
        self._answered = True
        return True

    def _answer_tail(self) -> bytes:
        """What the answer's figures are read from: its first event (an Anthropic stream
        names its prompt there only) and its last bytes."""
        stream = self.stream
        return stream.start + (self._tail or b"".join(stream.last_sent))

    def _stop_awaiting(self) -> None:
        """The wait for the model's load (`_served`) is over: it took its ticket or
        gave up."""
        if self._awaiting is not None:
            self.line.stop_awaiting(self._awaiting)
            self._awaiting = None

    async def _served(self, timeout: float | None) -> None:
        """Returns once an engine serves the request's model (it was loading); a
        streaming client sees life meanwhile.  Its queue timeout counts."""
        served = self._awaiting = self.request.served or self.line.when_served()
        started = time.monotonic()
        try:
            if self.request.parsed.stream:
                if not self.headers_sent:
                    await self._start_stream()
                await self._keep_alive_until(asyncio.wait_for(served, timeout))
            else:
                await asyncio.wait_for(served, timeout)
        except TimeoutError:
            raise QueueTimeout("The model is still loading. Try again shortly.",
                               retry_after=RETRY_SOON) from None
        finally:
            self._loading = time.monotonic() - started

    async def _admitted(self, ticket: Ticket, timeout: float | None) -> None:
        """Returns once `ticket` holds a slot; a streaming client sees life meanwhile."""
        if not ticket.admitted:
            turn = asyncio.ensure_future(wait_turn(ticket, timeout))
            try:
                if self.request.parsed.stream and not self.headers_sent and ticket.requeues:
                    # Quiet through the refusal backoff: a load that keeps refusing is
                    # still a plain 502, a restart noticed meanwhile gets keep-alives.
                    # (Twice the backoff: the retry comes at once after it.)
                    await asyncio.wait((turn,), timeout=2 * refusal_backoff(ticket))
                if self.request.parsed.stream and not turn.done():
                    if not self.headers_sent:
                        await self._start_stream()
                    await self._keep_alive_until(turn)
                else:
                    await turn
            finally:
                if not turn.done():
                    turn.cancel()
        self.stage = "running"
        if ticket.admitted_at is not None and ticket.requeues == 0:
            self.metrics.observe_queue_wait(ticket.admitted_at - ticket.enqueued_at)
            self.passage.admitted(ticket.admitted_at - ticket.enqueued_at)

    async def _start_stream(self) -> None:
        """Headers, then at once something the client counts as life: our own
        `response.created` on the Responses wire, a comment elsewhere."""
        await self._send_stream_headers()
        # Bytes at once, not only after the first interval: the client (and any proxy in
        # between) sees a live stream from the start.
        await self._send_keepalive()

    async def _send_stream_headers(self) -> None:
        headers = SSE_HEADERS + self._extra_headers if self._extra_headers else SSE_HEADERS
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        self.headers_sent = True

    async def _send_keepalive(self) -> None:
        """What the stream says while it waits (`StreamRelay.keepalive`): why, where its
        client may act on it."""
        ticket = self.ticket
        waiting = ticket.wait_reason if ticket is not None and not ticket.admitted else None
        body = self.stream.keepalive(self.request.model_id, waiting)
        audience = self.audience
        if not audience.opening:
            audience.opening = body  # what a resend that joins sees first, too
        if audience.listener is not None:  # else nobody is there to keep alive
            await self.send({"type": "http.response.body", "more_body": True, "body": body})

    async def _keep_alive_until(self, pending: Awaitable[T]) -> T:
        """`pending`'s result, sending a keep-alive every interval until it comes (while
        waiting in line, or for a model to load)."""
        interval = self.keepalive_interval if self.keepalive_interval > 0 else None
        future = asyncio.ensure_future(pending)
        try:
            while True:
                done, _ = await asyncio.wait((future,), timeout=interval)
                if done:
                    return future.result()
                await self._send_keepalive()
        finally:
            if not future.done():
                future.cancel()  # a waiting ticket leaves the line
            elif not future.cancelled():
                future.exception()  # retrieved: no "never retrieved" noise

    # --- forwarding ------------------------------------------------------------------

    async def _forward(self, ticket: Ticket) -> list[Message]:
        """Forward to the ticket's load; returns the last messages still to send."""
        if self._hide_cache:
            self._cache_told = self.stream.cache_told = own_prefix(self.host.sessions,
                                                                    self.request, ticket)
        request = upstream_request(self.client, ticket, self.request.path,
                                   self.request.parsed.body, stream=self.request.parsed.stream)
        with named_failures(ticket, connecting=True):
            upstream = await self.client.send(request, stream=True)
        # Its headers came: a slot took it (a stream's come when the slot starts).
        ticket.seated()
        try:
            if upstream.status_code >= 400:
                raise http_errors.upstream_error(upstream.status_code,
                                                 await read_error(upstream))
            with named_failures(ticket, dropped=self._dropped):
                check_answer(upstream, streamed=self.request.parsed.stream)
                if self.request.parsed.stream:
                    await self._until_first_bytes(upstream, ticket)
                    last = await self.stream.relay(upstream, self.send, self.audience.writer,
                                                   self.audience.stall)
                    self._tail = self.stream.tail
                    self._answered = True
                    return last
                return await self._answer(upstream)
        finally:
            await upstream.aclose()

    async def _until_first_bytes(self, upstream: UpstreamResponse, ticket: Ticket) -> None:
        """The stream's start sent, keep-alives until the answer's first event while the
        engine reads the prompt (`backend.port.prefill`: longer than a client's idle
        timeout for a long conversation on a CPU).  Then the prompt is computed: the next
        long one may start."""
        if not self.headers_sent:
            await self._send_stream_headers()
        await until_content(upstream, self.stream, self._send_keepalive, self.keepalive_interval)
        ticket.prefilled()

    def _dropped(self) -> None:
        """The engine dropped the request while answering (see `run`)."""
        self._engine_dropped = True

    async def _answer(self, upstream: UpstreamResponse) -> list[Message]:
        body = await upstream.aread()
        content_type = upstream.headers.get("content-type")
        if content_type is None:
            content_type = "application/json"
        self.headers_sent = True
        self._tail = body
        self._answered = True
        if self._hide_cache:
            body = sse.without_cache_figures(body, stream=False, told=self._cache_told)
        return [{"type": "http.response.start", "status": upstream.status_code,
                 "headers": [(b"content-type", content_type.encode("latin-1")),
                             (b"content-length", str(len(body)).encode()),
                             *self._extra_headers]},
                {"type": "http.response.body", "body": body, "more_body": False}]

