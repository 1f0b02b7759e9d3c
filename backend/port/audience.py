"""Who an answer goes to: its client, or while it has none, a bounded buffer (`Audience`).

A coding agent whose watchdog fires while the engine still reads its long prompt hangs
up and sends the same request again (bench/README.md, watchdogs).  Cutting the engine's
work at the hang-up throws the prefill away and puts the resend at the back of the line;
instead its exchange (`backend.port.relay`) keeps working for a grace period with no
client (`backend.port.resends`), and what it would have sent is kept here, bounded, until
a resend takes the client's place (`join`): the answer's start (its headers, and on the
Responses wire the `response.created` the first client saw), what was kept, then the
rest as it comes.  Keep-alives are not kept: nobody is there to need them.

Each client is a `Listener`: its connection's `send` (timed by its `StallGuard`), its
`receive` (where its hang-up is heard), its server's `BodyWriter` and abort, and `done`,
set once it is served no more (its answer ended, or it left).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from starlette.types import Message, Receive, Send

from backend.port.client_watch import StallGuard

if TYPE_CHECKING:
    from backend.port.server import BodyWriter

__all__ = ["Audience", "Listener"]


class Listener:
    """One client connection an answer may go to."""

    __slots__ = ("raw_send", "send", "receive", "writer", "abort", "stall", "done")

    def __init__(self, send: Send, receive: Receive, *, writer: BodyWriter | None = None,
                 abort: Callable[[], None] | None = None) -> None:
        self.raw_send = send
        #: Its `send`, timed by `stall` once `guard` armed it.
        self.send = send
        self.receive = receive
        self.writer = writer
        self.abort = abort
        self.stall: StallGuard | None = None
        #: Set once it is served no more: False when its answer ended, True when it left.
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def guard(self, timeout: float, on_stall: Callable[[], None]) -> None:
        """Drop it (`on_stall`) when one send has not returned for `timeout` seconds."""
        if timeout > 0:
            self.stall = StallGuard(self.raw_send, timeout, on_stall)
            self.send = self.stall.send

    def finish(self, *, left: bool) -> None:
        """It is served no more: it `left`, or its answer ended."""
        if self.stall is not None:
            self.stall.stop()
        if not self.done.done():
            self.done.set_result(left)


class Audience:
    """Where an answer's messages go: `listener`, or while it is None, a buffer of at
    most `limit` bytes; `overflow()` is called once when the buffer would pass it."""

    __slots__ = ("listener", "head", "opening", "kept", "_kept_bytes", "_limit",
                 "_overflow", "_joining", "overflowed")

    def __init__(self, listener: Listener, *, limit: int,
                 overflow: Callable[[], None]) -> None:
        self.listener: Listener | None = listener
        #: The answer's `http.response.start`, once it went out (to anyone).
        self.head: Message | None = None
        #: What a stream's client saw first after the headers, before the answer (our
        #: `response.created` on the Responses wire): a client that joins later sees it too.
        self.opening = b""
        #: The body messages kept while nobody listened (or a joiner catches up).
        self.kept: list[Message] = []
        self._kept_bytes = 0
        self._limit = limit
        self._overflow = overflow
        self._joining = False
        #: Set when more was to be kept than `limit`: the answer is not whole here.
        self.overflowed = False

    @property
    def writer(self) -> BodyWriter | None:
        """The listener's body writer (None while nobody listens, or one catches up)."""
        listener = self.listener
        return listener.writer if listener is not None and not self._joining else None

    @property
    def stall(self) -> StallGuard | None:
        listener = self.listener
        return listener.stall if listener is not None else None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.head = message
        listener = self.listener
        if listener is not None and not self._joining:
            await listener.send(message)
            return
        if message["type"] == "http.response.start":
            return  # `head`, sent first to whoever joins
        body = message.get("body", b"")
        if listener is None and self._kept_bytes + len(body) > self._limit:
            if not self.overflowed:
                self.overflowed = True
                self._overflow()
            return
        self.kept.append(message)
        self._kept_bytes += len(body)

    def leave(self) -> None:
        """Its listener left: what comes is kept from now on."""
        listener, self.listener = self.listener, None
        self._joining = False
        if listener is not None:
            listener.finish(left=True)

    def end(self, *, left: bool) -> None:
        """The answer is over: its listener (which `left` or had it all) is done."""
        if self.listener is not None:
            self.listener.finish(left=left)
        # `overflow` is its exchange's (a bound method), and the exchange holds this
        # audience: without the way back, an ended request is freed by its reference
        # counts at once, not by the garbage collector.
        self._overflow = _ignore

    def recording(self) -> list[Message]:
        """The whole answer as a client that joins now would get it (nobody listening)."""
        head = [] if self.head is None else [self.head]
        opening = [{"type": "http.response.body", "body": self.opening, "more_body": True}
                   ] if self.head is not None and self.opening else []
        return head + opening + self.kept

    async def join(self, listener: Listener) -> None:
        """`listener` takes the place of the one that left: it is sent the answer's
        start, what was kept, then the rest live.  Returns once it caught up."""
        self.listener = listener
        self._joining = True
        try:
            if self.head is not None:
                await listener.send(self.head)
                if self.opening:
                    await listener.send({"type": "http.response.body", "body": self.opening,
                                         "more_body": True})
            while self.kept and self.listener is listener:
                message = self.kept.pop(0)
                self._kept_bytes -= len(message.get("body", b""))
                await listener.send(message)
        finally:
            if self.listener is listener:
                self._joining = False


def _ignore() -> None:
    """An ended audience's `overflow`: it calls none."""
