"""The requests that wait for their model's first engine (`LoadWait`, one per line): the
model loads, so they can be neither planned nor given a ticket yet.

Each is a future, done once an engine serves the model (`serve_all`), or failed with the
refusal of the model's waiters (its load failed, its flow's key was revoked: `refuse`).
Meanwhile its body's bytes count with the line's waiters' against their bound
(`LoadWait.bytes`), and once served it still keeps the model busy until its holder says
it took its ticket or gave up (`stop`): its request is planned in between, and a model
evicted then would leave it no engine to wait for.  No I/O: futures of the backend's one
loop, no locks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LoadWait"]


class LoadWait:
    """The requests waiting for a model's first engine: their flows and bytes."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        """`on_change()`: one of them stopped waiting (its place and bytes are free)."""
        self._on_change = on_change
        self._waiting: dict[asyncio.Future[None], tuple[str, int]] = {}
        #: The bytes the waiting requests hold.
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, flow: str, size: int) -> asyncio.Future[None]:
        """A request of `flow` holding `size` bytes waits: its future."""
        served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[served] = (flow, size)
        self.bytes += size
        served.add_done_callback(self._unless_served)
        return served

    def stop(self, served: asyncio.Future[None]) -> None:
        """The request of `served` took its ticket or gave up."""
        served.cancel()
        self._forget(served)

    def serve_all(self) -> None:
        """An engine serves the model: every request waiting for one may go on."""
        for served in list(self._waiting):
            if not served.done():
                served.set_result(None)

    def refuse(self, error: BaseException, flow: str | None = None) -> int:
        """Fail the waiting requests (of `flow` only, unless None) with `error`; how many."""
        refused = [served for served, (of, _size) in self._waiting.items()
                   if (flow is None or of == flow) and not served.done()]
        for served in refused:
            served.set_exception(error)
            self._forget(served)
        return len(refused)

    def flows(self) -> set[str]:
        """The flows of the waiting requests."""
        return {flow for flow, _size in self._waiting.values()}

    def _unless_served(self, served: asyncio.Future[None]) -> None:
        if served.cancelled() or served.exception() is not None:
            self._forget(served)

    def _forget(self, served: asyncio.Future[None]) -> None:
        held = self._waiting.pop(served, None)
        if held is not None:
            self.bytes -= held[1]
            self._on_change()
