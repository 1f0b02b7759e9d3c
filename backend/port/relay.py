"""One gated request, from admission to the last byte sent to the client.

`Exchange.run` owns the request for its whole life: it takes the ticket from the
admission queue, waits for it (sending keep-alives when the client streams), forwards
the request to the load the ticket was admitted on, relays the answer, releases the
ticket, and decides what a cancellation means (the client left, the load went away, the
port closes).  Stream bytes are relayed as they come, cut only at event boundaries: past
the first chunk, from the upstream connection's own callback straight to the client's
(`_pump`, with the server's `BodyWriter`); only a `/v1/responses` stream has its head
read, to keep one response id throughout.

What it costs: a cut stream is charged one token per event relayed, counted with one
`bytes.count` per chunk.  A named key's answers carry nothing of the engine's shared
prompt cache (`sse.without_cache_figures`, on the one event or body that names it).

What it did: the exchange keeps what its books need as the chunks pass (the answer's
last bytes, its time to first token, the longest silence between chunks: one clock read
and a max per arrival) and hands it over once, when it ends (`Exchange._settle`, to
`backend.port.settlement`: its usage, its session's place, its prompt cache's verdict,
its record in the request inspector).

Failures of the upstream client become the project's errors in one place
(`Exchange._upstream_failures`); errors become answers through `backend.port.http_errors`:
an HTTP answer while no header was sent, a final in-stream error event afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Iterator, Protocol,
                    TypeVar)

from backend.admission.cache_misses import NO_BLOCKS, PromptBlocks
from backend.port import http_errors
from backend.port import sse
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.admission_ticket import Ticket, WaitReason
from backend.admission.caller import Caller
from backend.admission.flow import Band
from backend.port.metrics import UNROUTED
from backend.admission.flow_control import Pass
from backend.admission.need_planner import NO_PLAN, Plan
from backend.admission.hint import NO_HINT, Hint
from backend.port.settlement import Ending, Settlement, SettlementHost
from backend.port.client_watch import DisconnectWatch, StallGuard
from backend.llama.api import engine_headers
from backend.errors import (RETRY_SOON, LoadReplaced, ModelNotReady, QueueTimeout,
                            RequestError, UpstreamFailed, UpstreamUnavailable)
from backend.port.upstream_errors import ConnectFailed, MalformedAnswer, UpstreamError

if TYPE_CHECKING:
    from backend.admission.request_planner import RequestPlanner
    from backend.port.metrics import ModelCounts
    from backend.port.request_body import Parsed
    from backend.port.server import BodyWriter
    from backend.port.upstream_http import UpstreamClient, UpstreamResponse

__all__ = ["Exchange", "ExchangeHost", "GatedRequest", "SSE_HEADERS", "SlotParking"]

log = logging.getLogger("gguf_studio.gateway")

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: Why a request waits that its keep-alives say (`: keep-alive; waiting: REASON`): its
#: key's own concurrency limit, which its client may raise or wait out, and the prefill
#: budget that holds a long prompt; a full server needs no telling.
_TOLD_REASONS = frozenset({WaitReason.KEY_CONCURRENCY, WaitReason.PREFILL_BUDGET})
#: How llama-server's in-stream error events begin (chat-like, and messages).
_DATA_ERROR = b'data: {"error"'
_NAMED_ERROR = b"event: error"
UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
#: What shows that a relayed stream's answer is whole, its client having all of it: the
#: final event's finish reason, or the last event (a Responses stream's last event is
#: the port's own, sent once the engine's stream is over).
_WHOLE_ANSWER = {sse.StreamKind.CHAT: (b'"finish_reason":"', b'"finish_reason": "',
                                       b"data: [DONE]"),
                 sse.StreamKind.MESSAGES: (b'"message_delta"', b"message_stop"),
                 sse.StreamKind.RESPONSES: (b"response.completed",)}
#: First wait before a load that refused a connection is tried again (then doubled per
#: try: 0.05 + 0.1 + ... + 0.8 s = 1.55 s over MAX_REQUEUES tries).  A killed engine is
#: noticed within milliseconds and its waiters then wait for the restarted load instead.
REFUSAL_BACKOFF = 0.05
#: Seconds a slot freed by a request the engine dropped stays empty (see `run`): a
#: crashed engine is noticed well within it, a live one loses only this much.
ENGINE_FAILURE_HOLD = 0.5
#: How much of an upstream error body is read.
ERROR_BODY_LIMIT = 64 * 1024


class _NotReached(Exception):
    """The upstream refused the connection (or never accepted it): nothing was sent."""


class ExchangeHost(SettlementHost, Protocol):
    """What an exchange needs from the port that serves it (and where its books are kept)."""

    @property
    def client(self) -> UpstreamClient: ...

    @property
    def closing(self) -> bool: ...

    @property
    def planner(self) -> RequestPlanner:
        """Plans a request that waited for its model's load, as it admitted the others."""

    def recheck(self, caller: Caller) -> None:
        """Raise the refusal of the caller's key as it is now (revoked, expired, gone)."""

    @property
    def parking(self) -> SlotParking | None:
        """Who restores a session's parked prefix into its seat (None: nobody)."""


class SlotParking(Protocol):
    """Parked prefixes (`backend.app.parking`): between the seat and the request, and
    once the answer's last bytes are in."""

    async def before_send(self, ticket: Ticket, model: str | None) -> object | None: ...

    def after_answer(self, pending: object | None, tail: bytes) -> None: ...

    def remember(self, ticket: Ticket, model: str | None, path: str, body: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class GatedRequest:
    """A checked request for a gated route, before it has a ticket."""

    path: str
    kind: sse.StreamKind
    parsed: Parsed
    model_id: str | None
    #: Its way through its caller's limits (who sent it, its flow, its key's windows).
    passage: Pass
    #: What it will hold of the engine's cache, and whether it is counted while it runs;
    #: None while no engine serves its model yet (it is loading): planned once one does.
    plan: Plan | None = NO_PLAN
    #: The body's size as received, for planning later.
    body_bytes: int = 0
    #: The priority band it asked for (only ever lower than its key's).
    band: Band | None = None
    #: Its wait for its model to load (`Line.when_served`), when it was loading.
    served: asyncio.Future[None] | None = None
    #: Its session and prompt prefix, for placement (planned with it once it can be).
    hint: Hint = NO_HINT
    #: When it arrived (`time.monotonic`), for its waits and its time to first token.
    arrived: float = 0.0
    #: The client's W3C `traceparent`, read only while spans are exported.
    traceparent: str | None = None
    #: Its prompt's blocks, to say why its answer's prompt missed the cache (if it did).
    blocks: PromptBlocks = NO_BLOCKS


class Exchange:
    """A gated request and its ticket; `run()` answers every RequestError itself."""

    def __init__(self, host: ExchangeHost, line: Line[AdmissionQueue], request: GatedRequest,
                 send: Any, receive: Any, *,
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
        self.send = send
        self.receive = receive
        self.ticket: Ticket | None = None
        self.watch: DisconnectWatch | None = None
        self.stage = "queued"
        self.headers_sent = False
        #: Set when the client went away before its answer was complete.
        self.client_gone = False
        self.rewriter = sse.ResponsesRewriter(None) if self.kind is sse.StreamKind.RESPONSES else None
        self.framer = sse.EventFramer()
        self._keepalive = sse.KEEPALIVE_COMMENT
        self._task: asyncio.Task[Any] | None = None
        self._abort: RequestError | None = None
        #: Set when the engine dropped the request while answering (see `run`).
        self._engine_dropped = False
        #: Drops the client's connection at once (unsent bytes discarded), if the server
        #: offers it; see `backend.port.gateway`.
        self._abort_connection = abort_connection
        #: Writes a stream's chunks straight to the client's connection, if the server
        #: offers it (see `backend.port.server.BodyWriter`); else every chunk is `send`.
        self._body_writer = body_writer
        self._stall_timeout = settings.client_stall_timeout
        self._stall: StallGuard | None = None
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
        #: Events relayed from the engine: about one generated token each.
        self._events = 0
        #: An Anthropic stream's `message_start`, the one event that names its prompt.
        self._start = b""
        #: The answer's extra headers (OpenAI's x-ratelimit-* for a key with limits).
        self._extra_headers: list[tuple[bytes, bytes]] = []
        #: The last bytes relayed, where the engine's `usage` is.
        self._tail = b""
        #: The last two chunks of a stream sent so far, kept as they go: a client may
        #: hang up as soon as it has the final event (Codex does), before the stream ends.
        #: As the engine sent them (with the cache's figures, which count the prompt).
        self._last_sent = (b"", b"")
        #: Set once the engine's whole answer was relayed.
        self._answered = False
        #: The error the request ended with, if it did.
        self._failed: RequestError | None = None
        #: The status its client got (an error after the stream began leaves 200).
        self._status = 200
        #: For the inspector (`_settle`), all `time.monotonic`: when it arrived, its
        #: wait for its model to load, the engine's first bytes, the last chunk's
        #: arrival and the longest silence between two chunks.
        self._arrived = request.arrived or time.monotonic()
        self._loading = 0.0
        self._first_at: float | None = None
        self._last_at = 0.0
        self._longest_gap = 0.0

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
        watch = self.watch = DisconnectWatch(self.receive)
        if self._stall_timeout > 0:
            self._stall = StallGuard(self.send, self._stall_timeout, self._stalled)
            self.send = self._stall.send
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
            self._settle()
            self._release_body()
        try:
            await self._send_all(last)
        finally:
            if self._stall is not None:
                self._stall.stop()

    def _release_body(self) -> None:
        """Settled: the request's body (up to `max_body_bytes`) is of no more use.  The
        exchange itself lives on until the collector finds it (its stall guard and it
        refer to each other), which a busy port's oldest generation may wait long for:
        measured, 20 requests of 30 MiB left `serve` 420 MiB larger while it held them."""
        self.request.parsed.body = b""
        self.request.parsed.data = {}

    def _stalled(self) -> None:
        """The client left its answer unread for the stall timeout: drop it (the task
        then ends as for a client that left: upstream request closed, slot freed)."""
        log.info("dropping a client that read nothing for %.0f s", self._stall_timeout)
        self.metrics.count_stalled_client()
        if self._abort_connection is not None:
            self._abort_connection()
        if self.watch is not None:
            self.watch.gone()

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

    async def _send_all(self, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            await self.send(message)

    def _settle(self) -> None:
        """Close the request's books (`backend.port.settlement`): once, as it ends."""
        Settlement(self.host, self.line, self.request, Ending(
            ticket=self.ticket, failed=self._failed, events=self._events,
            answered=self._answered,
            tail=self._answer_tail(),
            arrived=self._arrived, loading=self._loading, first_at=self._first_at,
            last_at=self._last_at, longest_gap=self._longest_gap,
            client_gone=self.client_gone, status=self._status)).close()

    def _failure(self, error: RequestError) -> list[dict[str, Any]]:
        """The last messages for `error`: an HTTP answer, or a final stream event."""
        self._failed = error
        if not self.headers_sent:
            status, headers, body = http_errors.http_error(error, self.metrics)
            self._status = status
            self.headers_sent = True
            return [{"type": "http.response.start", "status": status, "headers": headers},
                    {"type": "http.response.body", "body": body, "more_body": False}]
        self.framer.drop()  # an incomplete event is never completed: leave it out
        response_id = self.rewriter.client_id if self.rewriter else None
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

    async def _admitted_and_forwarded(self) -> list[dict[str, Any]]:
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
                ticket, self.request.model_id)
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
            except _NotReached:
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
        sent = b"".join(self._last_sent)
        if not any(mark in sent for mark in _WHOLE_ANSWER[self.kind]):
            return False
        task = asyncio.current_task()
        if task is None or task.cancelling() != 1:
            return False  # cancelled by someone else too
        task.uncancel()
        self._tail = sent
        self._answered = True
        return True

    def _answer_tail(self) -> bytes:
        """What the answer's figures are read from: its first event (an Anthropic stream
        names its prompt there only) and its last bytes."""
        return self._start + (self._tail or b"".join(self._last_sent))

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
            turn = asyncio.ensure_future(self._turn(ticket, timeout))
            try:
                if self.request.parsed.stream and not self.headers_sent and ticket.requeues:
                    # Quiet through the refusal backoff: a load that keeps refusing is
                    # still a plain 502, a restart noticed meanwhile gets keep-alives.
                    # (Twice the backoff: the retry comes at once after it.)
                    await asyncio.wait((turn,), timeout=2 * _backoff(ticket))
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

    async def _turn(self, ticket: Ticket, timeout: float | None) -> None:
        """`ticket.wait`; after a refusal the load may still count as ready (its end not
        noticed yet, or an attached server that refuses): after a short backoff its
        queue is asked to admit again, so a load that keeps refusing fails after
        MAX_REQUEUES tries instead of at the queue timeout."""
        if ticket.requeues == 0:
            await ticket.wait(timeout)
            return
        waiting = asyncio.ensure_future(ticket.wait(timeout))
        try:
            done, _ = await asyncio.wait((waiting,), timeout=_backoff(ticket))
            if not done:
                ticket.line.admit_waiting()
            await waiting
        finally:
            if not waiting.done():
                waiting.cancel()

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
        """A comment; on the Responses wire our `response.created` first, then
        `response.in_progress` events."""
        if self.rewriter is not None and self.rewriter.our_id is None:
            await self._send_response_created()
        else:
            body = self._keepalive
            ticket = self.ticket
            if (ticket is not None and ticket.wait_reason in _TOLD_REASONS
                    and not ticket.admitted and body is sse.KEEPALIVE_COMMENT):
                body = sse.keepalive_waiting(ticket.wait_reason)
            await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def _send_response_created(self) -> None:
        """Our `response.created`; from now on the upstream's own is dropped and its id
        replaced by ours, and keep-alives are `response.in_progress` events."""
        assert self.rewriter is not None
        our_id = sse.new_response_id()
        self.rewriter.our_id = our_id
        stub = sse.response_stub(our_id, self.request.model_id)
        created = sse.named_event("response.created",
                                  {"type": "response.created", "response": stub})
        self._keepalive = sse.named_event("response.in_progress",
                                          {"type": "response.in_progress", "response": stub})
        await self.send({"type": "http.response.body", "body": created, "more_body": True})

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

    @contextlib.contextmanager
    def _upstream_failures(self, ticket: Ticket, *, connecting: bool = False) -> Iterator[None]:
        """The one place where the upstream client's failures become our errors: the
        engine unreachable, or gone while answering, or its load replaced meanwhile."""
        try:
            yield
        except UpstreamError as exc:
            if connecting and isinstance(exc, ConnectFailed):
                raise _NotReached() from None  # nothing was sent: safe on the next load
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
                self._engine_dropped = True
                error = UpstreamFailed("The model server stopped while answering. Try again.")
            raise error from None
        except sse.BrokenStream:
            raise UpstreamFailed("The model server's answer broke off in the middle of an "
                                 "event. Try again.") from None

    async def _forward(self, ticket: Ticket) -> list[dict[str, Any]]:
        """Forward to the ticket's load; returns the last messages still to send."""
        request = self.client.build_request("POST", ticket.serving.base_url + self.request.path,
                                            content=_seated(self.request.parsed.body, ticket),
                                            headers={**UPSTREAM_HEADERS,
                                                     **engine_headers(ticket.api_key)})
        with self._upstream_failures(ticket, connecting=True):
            upstream = await self.client.send(request, stream=True)
        try:
            if upstream.status_code >= 400:
                raise http_errors.upstream_error(upstream.status_code,
                                                    await self._read_error(upstream))
            with self._upstream_failures(ticket):
                self._check_answer(upstream)
                if self.request.parsed.stream:
                    try:
                        return await self._relay(upstream)
                    except _ErrorAfter as failed:
                        if failed.head:
                            head = failed.head
                            self._events += head.count(b"data:")
                            if self._hide_cache:
                                head = sse.without_cache_figures(head, stream=True)
                            await self.send({"type": "http.response.body", "body": head,
                                             "more_body": True})
                        raise failed.error from None
                return await self._answer(upstream)
        finally:
            await upstream.aclose()

    def _check_answer(self, upstream: UpstreamResponse) -> None:
        """Relay only what llama-server answers: 200 with an event stream for a streamed
        request, JSON otherwise (a redirect, a 2xx without the body asked for, or another
        media type would reach the client as if it were the model's answer)."""
        media = (upstream.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        expected = "text/event-stream" if self.request.parsed.stream else "application/json"
        if upstream.status_code != 200 or media != expected:
            raise MalformedAnswer(f"Unexpected answer: {upstream.status_code} {media!r}.")

    async def _read_error(self, upstream: UpstreamResponse) -> bytes:
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

    async def _answer(self, upstream: UpstreamResponse) -> list[dict[str, Any]]:
        body = await upstream.aread()
        content_type = upstream.headers.get("content-type")
        if content_type is None:
            content_type = "application/json"
        self.headers_sent = True
        self._tail = body
        self._answered = True
        if self._hide_cache:
            body = sse.without_cache_figures(body, stream=False)
        return [{"type": "http.response.start", "status": upstream.status_code,
                 "headers": [(b"content-type", content_type.encode("latin-1")),
                             (b"content-length", str(len(body)).encode()),
                             *self._extra_headers]},
                {"type": "http.response.body", "body": body, "more_body": False}]

    async def _relay(self, upstream: UpstreamResponse) -> list[dict[str, Any]]:
        """The one relay loop.  Each chunk goes through `stage`: the framer alone, or the
        framer then the Responses rewriter, chosen once per stream."""
        send = self.send
        if not self.headers_sent:
            await self._send_stream_headers()
        framer = self.framer
        rewriter = self.rewriter
        stage = framer.feed if rewriter is None else _then(framer.feed, rewriter.feed)
        if self.kind is sse.StreamKind.MESSAGES:
            stage = _then(stage, self._note_start)
        # llama-server ends a failing stream with an error event: `event: error` on the
        # messages wire, `data: {"error"...` elsewhere.  One substring test per chunk
        # (about a third of a microsecond for a 235-byte chunk here); only a chunk that
        # holds the marker is parsed.
        marker = _NAMED_ERROR if self.kind is sse.StreamKind.MESSAGES else _DATA_ERROR
        hide = self._hide_cache
        writer = self._body_writer
        if writer is not None and not writer.ready():
            writer = None  # the start was not sent (the client left): `send` knows
        # Keep-alives until the engine's first bytes: llama-server sends nothing, not
        # even `response.created`, until it has read the whole prompt, which takes longer
        # than a client's idle timeout for a long conversation on a CPU.
        interval = self.keepalive_interval if self.keepalive_interval > 0 else None
        while not await upstream.arrived(interval):
            await self._send_keepalive()
        self._first_at = self._last_at = time.monotonic()
        if self.ticket is not None:
            self.ticket.prefilled()  # the prompt is computed: the next long one may start
        # The first chunk too goes the way of the rest: straight to the client's
        # connection when the server offers it, else through `send`.
        if writer is not None:
            await self._pump(upstream, stage, marker, writer)
        else:
            # Each chunk relayed counts its events (`_events`, what a cut stream is
            # charged): one `bytes.count`, 0.3 us for a 229-byte chunk here (less than
            # the marker's substring test); a named key's chunks one more substring test
            # for the cache.  The same per chunk as `_pump`'s, written out in each: a
            # call per chunk is what the relay's hottest loop does without.
            clock = time.monotonic
            async for chunk in upstream.aiter_raw():
                now = clock()
                if now - self._last_at > self._longest_gap:
                    self._longest_gap = now - self._last_at
                self._last_at = now
                chunk = stage(chunk)
                if chunk:
                    if marker in chunk:
                        chunk = self._before_error(chunk)
                    self._last_sent = (self._last_sent[1], chunk)
                    self._events += chunk.count(b"data:")
                    if hide and sse.CACHE_MARKER in chunk:
                        chunk = sse.without_cache_figures(chunk, stream=True)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = framer.finish()
        if rewriter is not None:
            tail = rewriter.feed(tail) + rewriter.flush()
        self._tail = b"".join(self._last_sent) + tail
        self._answered = True
        if hide:
            tail = sse.without_cache_figures(tail, stream=True)
        return [{"type": "http.response.body", "body": tail, "more_body": False}]

    async def _pump(self, upstream: UpstreamResponse, stage: Callable[[bytes], bytes],
                    marker: bytes, writer: BodyWriter) -> None:
        """The rest of a stream, relayed from the upstream connection's own callback:
        each read goes out to the client in the loop turn it came in, with no task
        switch (on a busy port the CPU per chunk is what delays everyone's next first
        token).  This task only waits: for the end, an error, or a full client."""
        loop = asyncio.get_running_loop()
        hide = self._hide_cache
        cache = sse.CACHE_MARKER
        clock = time.monotonic
        while True:
            turn: asyncio.Future[bool] = loop.create_future()

            def pump() -> None:
                if turn.done():
                    return
                # The inspector's longest silence: one clock read and a max per arrival.
                now = clock()
                if now - self._last_at > self._longest_gap:
                    self._longest_gap = now - self._last_at
                self._last_at = now
                try:
                    while data := upstream.read():
                        chunk = stage(data)
                        if chunk:
                            if marker in chunk:
                                chunk = self._before_error(chunk)
                            self._last_sent = (self._last_sent[1], chunk)
                            self._events += chunk.count(b"data:")
                            if hide and cache in chunk:
                                chunk = sse.without_cache_figures(chunk, stream=True)
                            if not writer.write(chunk):
                                turn.set_result(False)  # the client's buffer is full
                                return
                    if data is None:
                        turn.set_result(True)
                except Exception as exc:  # the upstream's error, or the engine's error event
                    turn.set_exception(exc)

            upstream.on_arrival(pump)
            try:
                pump()  # what came before
                if await turn:
                    return
            finally:
                upstream.on_arrival(None)
                if turn.done() and not turn.cancelled():
                    turn.exception()  # retrieved, even when this task was cancelled meanwhile
            await self._drained(writer)

    async def _drained(self, writer: BodyWriter) -> None:
        """Until the client read enough of what was written (a client that reads
        nothing for the stall timeout is dropped, as for a `send` that waits)."""
        if self._stall is not None:
            await self._stall.wait(writer.drain())
        else:
            await writer.drain()

    def _note_start(self, chunk: bytes) -> bytes:
        """`chunk`, kept if it holds the stream's `message_start` (see `_start`)."""
        if not self._start and b'"message_start"' in chunk:
            self._start = chunk
        return chunk

    def _before_error(self, chunk: bytes) -> bytes:
        """`chunk` (whole events) if it holds no error event of the engine; else raises
        the error, normalized (string code), once the events before it are sent."""
        start = 0
        for end in sse.event_ends(chunk):
            error = http_errors.upstream_stream_error(chunk[start:end])
            if error is not None:
                raise _ErrorAfter(chunk[:start], error)
            start = end
        return chunk


class _ErrorAfter(Exception):
    """Internal: the engine's stream carried an error after `head` (sent first)."""

    def __init__(self, head: bytes, error: RequestError) -> None:
        super().__init__(str(error))
        self.head = head
        self.error = error


def _backoff(ticket: Ticket) -> float:
    return float(REFUSAL_BACKOFF * 2 ** (ticket.requeues - 1))


def _then(first: Callable[[bytes], bytes], second: Callable[[bytes], bytes]
          ) -> Callable[[bytes], bytes]:
    """`second(first(chunk))`, skipping `second` when `first` held everything back."""
    def stage(chunk: bytes) -> bytes:
        chunk = first(chunk)
        return second(chunk) if chunk else chunk
    return stage


def _seated(body: bytes, ticket: Ticket) -> bytes:
    """The body as sent to the engine: with the seat's slot as `id_slot` when its
    placement pinned it (a client's own `id_slot` is refused before this)."""
    seat = ticket.seat
    if seat is None or not seat.pinned or seat.slot is None or not ticket.serving.takes_slot_ids:
        return body
    rest = body.lstrip()[1:]  # a checked body is one JSON object
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return b'{"id_slot":%d%s%s' % (seat.slot, comma, rest)
