"""The client's side of one gated request: whether it left, and whether it stopped reading.

`DisconnectWatch` cancels the request's task the moment the client disconnects;
`StallGuard` notices a `send` that has not returned for too long (a client that stopped
reading holds its slot and the upstream behind it).  `backend.port.relay.Exchange` holds one
of each for the request's life.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from starlette.types import Message, Receive, Send

__all__ = ["DisconnectWatch", "StallGuard"]


class DisconnectWatch:
    """Cancels the request's task the moment its client disconnects.

    uvicorn's `send` stays silent after a disconnect, and a request that waits in line
    or for a slow upstream sends nothing for a long time: so one small task listens on
    `receive` (the body has been read already) and cancels the handler, which then
    leaves the line, or closes the upstream request and releases its slot, at once.
    `stop()` must be called before the final message of the response is sent, because
    `receive` reports a completed response as a disconnect too.
    """

    __slots__ = ("disconnected", "_stopped", "_task", "_watcher", "_kept")

    def __init__(self, receive: Receive, kept: Callable[[], bool] | None = None) -> None:
        self.disconnected = False
        self._stopped = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._watch(receive))
        #: Asked when the client goes: True keeps the task running without it (its
        #: resend may join, `backend.port.resends`), to be `cut` later or `follow` another.
        self._kept = kept

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self.gone()

    def gone(self) -> None:
        """The client is gone (or dropped): cancel the request's task, once (unless
        it is kept running without it)."""
        if not self._stopped and not self.disconnected and self._task is not None:
            self.disconnected = True
            if self._kept is None or not self._kept():
                self._task.cancel()

    def cut(self) -> None:
        """The client is gone and no other came: cancel the request's task now."""
        if not self._stopped and self.disconnected and self._task is not None:
            self._task.cancel()

    def follow(self, receive: Receive) -> None:
        """Another client took the place of the one that left: watch it instead."""
        if self._stopped:
            return
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        self.disconnected = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            if not self._watcher.done():
                self._watcher.cancel()
            # The cancelled task keeps its CancelledError, whose traceback holds the
            # watching frame, which holds this watch: let go of the task, so that none
            # of them waits for the garbage collector.
            self._watcher = None
        # `kept` is its exchange's (a bound method), and the exchange holds this watch.
        self._kept = None


class StallGuard:
    """Calls `on_stall` when one `send` has not returned for `timeout` seconds.

    uvicorn's `send` waits while the connection's write buffer is full, so a client
    that stops reading (or vanished without a FIN) pauses its stream, and the upstream
    behind it, for ever, and holds its slot.  One timer per exchange, re-armed from the
    start of the pending send, keeps the cost per chunk at a clock read.
    """

    __slots__ = ("_send", "_timeout", "_on_stall", "_loop", "_since", "_timer")

    def __init__(self, send: Send, timeout: float, on_stall: Callable[[], None]) -> None:
        self._send = send
        self._timeout = timeout
        self._on_stall = on_stall
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(timeout, self._check)

    async def send(self, message: Message) -> None:
        await self.wait(self._send(message))

    async def wait(self, pending: Awaitable[None]) -> None:
        """`pending` (a send, or a wait for the client to read), timed like `send`."""
        self._since = self._loop.time()
        try:
            await pending
        finally:
            self._since = None

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # `on_stall` is its exchange's (a bound method), and the exchange holds this
        # guard: without the way back, an ended request is freed by its reference counts
        # at once, not by the garbage collector.
        self._on_stall = _ignore

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._timeout:
            self._timer = None
            self._on_stall()
            return
        delay = self._timeout if since is None else since + self._timeout - now
        self._timer = self._loop.call_later(delay, self._check)


def _ignore() -> None:
    """A stopped guard's `on_stall`: it calls none."""
