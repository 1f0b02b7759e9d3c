"""One answer's event stream, relayed from the engine to its client, and what the books
keep of it (`StreamRelay`).

Bytes are relayed as they come, cut only at event boundaries (`sse.EventFramer`); only a
`/v1/responses` stream has its head read, to keep one response id throughout
(`sse.ResponsesRewriter`).  Two paths, chosen once per stream, each with its per-chunk
code written out once (a call per chunk is what this, the port's hottest loop, does
without): from the upstream connection's own callback straight to the client's
connection (`_pump`, with the server's `BodyWriter`: no task switch per chunk), or, on a
server that offers no writer, a loop awaiting ASGI `send`.

What it costs: a cut stream is charged one token per event relayed, counted with one
`bytes.count` per chunk.  A named key's answers carry nothing of the engine's shared
prompt cache (`sse.without_cache_figures`, on the one event that names it).  An error
event of the engine ends the relay once the events before it are sent: its error is
raised, normalized, for the exchange to send as the stream's last event.

What it keeps as the chunks pass, for the exchange's books: the events relayed, the last
two chunks (where the engine's `usage` is, and the answer's end), an Anthropic stream's
`message_start`, and its time to first bytes and longest silence (one clock read and a
max per arrival).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from starlette.types import Message, Send

from backend.admission.admission_ticket import WaitReason
from backend.errors import RequestError
from backend.port import http_errors
from backend.port import sse

if TYPE_CHECKING:
    from backend.port.client_watch import StallGuard
    from backend.port.prefill import PrefillProgress
    from backend.port.server import BodyWriter
    from backend.port.upstream_http import UpstreamResponse

__all__ = ["StreamRelay"]

#: Why a request waits that its keep-alives say (`: keep-alive; waiting: REASON`): its
#: key's own concurrency limit, which its client may raise or wait out, and the prefill
#: budget that holds a long prompt; a full server needs no telling.
_TOLD_REASONS = frozenset({WaitReason.KEY_CONCURRENCY, WaitReason.PREFILL_BUDGET})
#: How llama-server's in-stream error events begin (chat-like, and messages).
_DATA_ERROR = b'data: {"error"'
_NAMED_ERROR = b"event: error"
#: What shows that a relayed stream's answer is whole, its client having all of it: the
#: final event's finish reason, or the last event (a Responses stream's last event is
#: the port's own, sent once the engine's stream is over).
_WHOLE_ANSWER = {sse.StreamKind.CHAT: (b'"finish_reason":"', b'"finish_reason": "',
                                       b"data: [DONE]"),
                 sse.StreamKind.MESSAGES: (b'"message_delta"', b"message_stop"),
                 sse.StreamKind.RESPONSES: (b"response.completed",)}


class StreamRelay:
    """The relay of one streamed answer of framing `kind`; `hide_cache`: a named key's,
    which is told nothing of the shared prompt cache but the `cache_told` tokens its own
    earlier turn left there."""

    __slots__ = ("kind", "hide_cache", "cache_told", "framer", "rewriter", "events", "start", "last_sent",
                 "tail", "first_at", "last_at", "longest_gap", "progress", "_in_progress")

    def __init__(self, kind: sse.StreamKind, *, hide_cache: bool, cache_told: int = 0) -> None:
        self.kind = kind
        self.hide_cache = hide_cache
        self.cache_told = cache_told
        self.framer = sse.EventFramer()
        #: On the Responses wire: our `response.created` and one id throughout.
        self.rewriter = sse.ResponsesRewriter(None) if kind is sse.StreamKind.RESPONSES else None
        #: Events relayed from the engine: about one generated token each.
        self.events = 0
        #: An Anthropic stream's `message_start`, the one event that names its prompt.
        self.start = b""
        #: The last two chunks of a stream sent so far, kept as they go: a client may
        #: hang up as soon as it has the final event (Codex does), before the stream ends.
        #: As the engine sent them (with the cache's figures, which count the prompt).
        self.last_sent = (b"", b"")
        #: The answer's last bytes as the engine sent them, once the stream is over.
        self.tail = b""
        #: All `time.monotonic`: the engine's first bytes, the last chunk's arrival and
        #: the longest silence between two chunks.
        self.first_at: float | None = None
        self.last_at = 0.0
        self.longest_gap = 0.0
        #: How far the engine has read the prompt (`backend.port.prefill`), once it said.
        self.progress: PrefillProgress | None = None
        #: The Responses wire's keep-alive, once our `response.created` was sent.
        self._in_progress = b""

    def keepalive(self, model: str | None, waiting: str | None = None) -> bytes:
        """What the stream says while its request waits, or its engine reads the prompt:
        on the Responses wire our `response.created` first (from then on the upstream's
        own is dropped and its id replaced by ours), then `response.in_progress` events
        for `model`; elsewhere a comment, which says why it waits when its client may act
        on it (`waiting`: its ticket's wait reason, while it waits in line), or how far
        the engine has read its prompt (on the Responses wire too, before its event)."""
        rewriter = self.rewriter
        if rewriter is not None:
            if rewriter.our_id is not None:
                if self.progress is not None:
                    return self._progress_note() + self._in_progress
                return self._in_progress
            our_id = rewriter.our_id = sse.new_response_id()
            stub = sse.response_stub(our_id, model)
            self._in_progress = sse.named_event(
                "response.in_progress", {"type": "response.in_progress", "response": stub})
            return sse.named_event("response.created",
                                   {"type": "response.created", "response": stub})
        if waiting in _TOLD_REASONS:
            return sse.keepalive_waiting(waiting)
        if self.progress is not None:
            return self._progress_note()
        return sse.KEEPALIVE_COMMENT

    def _progress_note(self) -> bytes:
        assert self.progress is not None
        return sse.keepalive_note(self.progress.describe(tokens=not self.hide_cache,
                                                         now=time.monotonic()))

    def whole(self) -> bool:
        """Does what was sent hold the answer's end (its finish reason, its last event)?"""
        sent = b"".join(self.last_sent)
        return any(mark in sent for mark in _WHOLE_ANSWER[self.kind])

    async def relay(self, upstream: UpstreamResponse, send: Send, writer: BodyWriter | None,
                    stall: StallGuard | None) -> list[Message]:
        """Relay `upstream`'s stream, whose first bytes have come, to the client whose
        answer's start was sent; returns the last message still to send.  Each chunk is
        written with `writer` when it is ready (a full client waited for under `stall`),
        else `send`.  Raises the engine's in-stream error once the events before it
        are sent, and the upstream's failures (`UpstreamError`, `sse.BrokenStream`)."""
        framer = self.framer
        rewriter = self.rewriter
        # Each chunk goes through `stage`: the framer alone, or the framer then the
        # Responses rewriter, chosen once per stream.
        stage = framer.feed if rewriter is None else _then(framer.feed, rewriter.feed)
        if self.kind is sse.StreamKind.MESSAGES:
            stage = _then(stage, self._note_start)
        # llama-server ends a failing stream with an error event: `event: error` on the
        # messages wire, `data: {"error"...` elsewhere.  One substring test per chunk
        # (about a third of a microsecond for a 235-byte chunk here); only a chunk that
        # holds the marker is parsed.
        marker = _NAMED_ERROR if self.kind is sse.StreamKind.MESSAGES else _DATA_ERROR
        hide = self.hide_cache
        if writer is not None and not writer.ready():
            writer = None  # the start was not sent (the client left): `send` knows
        self.first_at = self.last_at = time.monotonic()
        try:
            if writer is not None:
                await self._pump(upstream, stage, marker, writer, stall)
            else:
                # Each chunk relayed counts its events (`events`, what a cut stream is
                # charged): one `bytes.count`, 0.3 us for a 229-byte chunk here (less
                # than the marker's substring test); a named key's chunks one more
                # substring test for the cache.  The same per chunk as `_pump`'s.
                clock = time.monotonic
                async for chunk in upstream.aiter_raw():
                    now = clock()
                    if now - self.last_at > self.longest_gap:
                        self.longest_gap = now - self.last_at
                    self.last_at = now
                    chunk = stage(chunk)
                    if chunk:
                        if marker in chunk:
                            chunk = self._before_error(chunk)
                        self.last_sent = (self.last_sent[1], chunk)
                        self.events += chunk.count(b"data:")
                        if hide and sse.CACHE_MARKER in chunk:
                            chunk = sse.without_cache_figures(chunk, stream=True,
                                                              told=self.cache_told)
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
        except _ErrorAfter as failed:
            if failed.head:
                head = failed.head
                self.events += head.count(b"data:")
                if hide:
                    head = sse.without_cache_figures(head, stream=True, told=self.cache_told)
                await send({"type": "http.response.body", "body": head, "more_body": True})
            raise failed.error from None
        tail = framer.finish()
        if rewriter is not None:
            tail = rewriter.feed(tail) + rewriter.flush()
        self.tail = b"".join(self.last_sent) + tail
        if hide:
            tail = sse.without_cache_figures(tail, stream=True, told=self.cache_told)
        return [{"type": "http.response.body", "body": tail, "more_body": False}]

    async def _pump(self, upstream: UpstreamResponse, stage: Callable[[bytes], bytes],
                    marker: bytes, writer: BodyWriter, stall: StallGuard | None) -> None:
        """The stream relayed from the upstream connection's own callback: each read goes
        out to the client in the loop turn it came in, with no task switch (on a busy
        port the CPU per chunk is what delays everyone's next first token).  This task
        only waits: for the end, an error, or a full client."""
        loop = asyncio.get_running_loop()
        hide = self.hide_cache
        cache = sse.CACHE_MARKER
        clock = time.monotonic
        while True:
            turn: asyncio.Future[bool] = loop.create_future()

            def pump() -> None:
                if turn.done():
                    return
                # The inspector's longest silence: one clock read and a max per arrival.
                now = clock()
                if now - self.last_at > self.longest_gap:
                    self.longest_gap = now - self.last_at
                self.last_at = now
                try:
                    while data := upstream.read():
                        chunk = stage(data)
                        if chunk:
                            if marker in chunk:
                                chunk = self._before_error(chunk)
                            self.last_sent = (self.last_sent[1], chunk)
                            self.events += chunk.count(b"data:")
                            if hide and cache in chunk:
                                chunk = sse.without_cache_figures(chunk, stream=True,
                                                                  told=self.cache_told)
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
            # Until the client read enough of what was written (a client that reads
            # nothing for the stall timeout is dropped, as for a `send` that waits).
            if stall is not None:
                await stall.wait(writer.drain())
            else:
                await writer.drain()

    def _note_start(self, chunk: bytes) -> bytes:
        """`chunk`, kept if it holds the stream's `message_start` (see `start`)."""
        if not self.start and b'"message_start"' in chunk:
            self.start = chunk
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


# --- helpers -----------------------------------------------------------------------------

class _ErrorAfter(Exception):
    """Internal: the engine's stream carried an error after `head` (sent first)."""

    def __init__(self, head: bytes, error: RequestError) -> None:
        super().__init__(str(error))
        self.head = head
        self.error = error


def _then(first: Callable[[bytes], bytes], second: Callable[[bytes], bytes]
          ) -> Callable[[bytes], bytes]:
    """`second(first(chunk))`, skipping `second` when `first` held everything back."""
    def stage(chunk: bytes) -> bytes:
        chunk = first(chunk)
        return second(chunk) if chunk else chunk
    return stage
