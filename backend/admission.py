"""Who may talk to llama-server now, and who waits: one bounded FIFO per backend.

This module only decides.  It opens no sockets, sends nothing and never sleeps; the
gateway asks it for a ticket, awaits the ticket, forwards the request to the ticket's
`base_url` and releases the ticket when the upstream answer is finished or abandoned.
Everything runs on the backend's one asyncio loop, so nothing here takes a lock.

    ticket = registry.current.request()      # may raise QueueFull
    try:
        await ticket.wait(queue_timeout)      # may raise QueueTimeout or a refusal
        ...forward to ticket.base_url...
    finally:
        ticket.release()                      # idempotent
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from backend.errors import ModelNotReady, QueueFull, QueueTimeout
from backend.listeners import Listeners

__all__ = [
    "AdmissionQueue",
    "AdmissionRegistry",
    "Ticket",
    "TicketState",
]

Clock = Callable[[], float]

log = logging.getLogger(__name__)


class TicketState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    RELEASED = "released"
    REFUSED = "refused"


class Ticket:
    """One request's place: first in a line, then in a slot of one backend."""

    __slots__ = ("state", "queue", "enqueued_at", "admitted_at", "_error", "_event",
                 "_seq")

    def __init__(self, queue: AdmissionQueue, now: float) -> None:
        self.state = TicketState.WAITING
        self.queue = queue
        self.enqueued_at = now
        self.admitted_at: float | None = None
        self._error: BaseException | None = None
        # Created only when someone awaits: a long line must not cost an Event each.
        self._event: asyncio.Event | None = None
        # Global arrival order, so that lines merged on carry-over stay first come,
        # first served across queues.
        self._seq = next(_arrivals)

    @property
    def base_url(self) -> str:
        return self.queue.key

    @property
    def admitted(self) -> bool:
        return self.state is TicketState.ADMITTED

    @property
    def error(self) -> BaseException | None:
        """Why the ticket was refused, if it was."""
        return self._error

    @property
    def position(self) -> int | None:
        """0-based place in line while waiting, else None.  O(n): diagnostics only."""
        if self.state is not TicketState.WAITING:
            return None
        for index, ticket in enumerate(self.queue._line):
            if ticket is self:
                return index
        return None  # unreachable while the invariants hold

    async def wait(self, timeout: float | None = None) -> None:
        """Return once admitted.  `timeout` None or 0 waits for as long as it takes.

        Raises QueueTimeout (after leaving the line) when the timeout passes, the
        refusal error when the ticket is refused, and RuntimeError when the ticket was
        already released.  If the awaiting task is cancelled the ticket
        is released at once, whether it was still waiting or already admitted.
        """
        if self.state is TicketState.WAITING:
            if self._event is None:
                self._event = asyncio.Event()
            try:
                async with asyncio.timeout(timeout if timeout and timeout > 0 else None):
                    await self._event.wait()
            except TimeoutError:
                # An admission that raced the timer wins: the slot is already held.
                if self.state is TicketState.WAITING:
                    queue = self.queue
                    self.release()
                    raise QueueTimeout(
                        "The request waited too long for a free slot on the model. "
                        "Try again later.",
                        retry_after=queue.retry_after(),
                    ) from None
            except BaseException:
                # The client is gone; a slot granted in the meantime would never be
                # used by anyone, so it goes back too.
                self.release()
                raise
        if self.state is TicketState.ADMITTED:
            return
        if self.state is TicketState.REFUSED:
            assert self._error is not None
            # The same error object may be raised in many waiters: keep its traceback
            # from growing with each of them.
            raise self._error.with_traceback(None)
        raise RuntimeError("The ticket was already released.")

    def release(self) -> None:
        """Give back the slot, or the place in line.  Safe to call more than once."""
        if self.state is TicketState.ADMITTED:
            self.state = TicketState.RELEASED
            self.queue._finish(self)
        elif self.state is TicketState.WAITING:
            self.state = TicketState.RELEASED
            self.queue._leave(self)
            self._wake()

    def __repr__(self) -> str:
        return f"<Ticket #{self._seq} {self.state.value}>"

    # --- called by the queue ---------------------------------------------------------

    def _admit(self, now: float) -> None:
        self.state = TicketState.ADMITTED
        self.admitted_at = now
        self._wake()

    def _refuse(self, error: BaseException) -> None:
        self.state = TicketState.REFUSED
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()


class AdmissionQueue:
    """The slots of one llama-server process and the FIFO line in front of them."""

    #: Weight of the newest admitted→released duration in the service-time estimate.
    SERVICE_TIME_WEIGHT = 0.2
    #: The service-time estimate before any request has finished.
    DEFAULT_SERVICE_TIME = 1.0

    def __init__(self, key: str, capacity: int, *, max_waiting: int = 0,
                 enabled: bool = True, clock: Clock = time.monotonic,
                 on_change: Callable[[AdmissionQueue], None] | None = None) -> None:
        self.key = key
        self.capacity = _check_capacity(capacity)
        self.max_waiting = max_waiting
        self._enabled = enabled
        self._clock = clock
        self._on_change = on_change
        self._retired = False
        self._active = 0
        # An ordered set: O(1) append, O(1) pop from the front, O(1) removal of any
        # ticket (a list would make every cancellation O(n)).
        self._line: OrderedDict[Ticket, None] = OrderedDict()
        self._service_time: float | None = None

    # --- state -----------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._active

    @property
    def waiting(self) -> int:
        return len(self._line)

    @property
    def idle(self) -> bool:
        return self._active == 0 and not self._line

    @property
    def retired(self) -> bool:
        """No longer the current load: admits no one new."""
        return self._retired

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        if self._promote():
            self._changed()

    @property
    def service_time(self) -> float:
        """Recent mean admitted→released duration in seconds."""
        if self._service_time is None:
            return self.DEFAULT_SERVICE_TIME
        return self._service_time

    # --- decisions -------------------------------------------------------------------

    def request(self) -> Ticket:
        """A ticket: admitted at once if a slot is free and nobody waits, else waiting.

        Raises QueueFull when `max_waiting` requests already wait, and ModelNotReady
        when the queue is retired.
        """
        if self._retired:
            raise ModelNotReady("The model is being reloaded. Try again shortly.",
                                retry_after=self.retry_after())
        now = self._clock()
        if not self._line and self._has_free_slot():
            ticket = Ticket(self, now)
            self._admit(ticket, now)
        else:
            if self.max_waiting and len(self._line) >= self.max_waiting:
                raise QueueFull(
                    f"The server is busy: {len(self._line)} requests are already "
                    "waiting. Try again later.",
                    retry_after=self.retry_after(),
                )
            ticket = Ticket(self, now)
            self._line[ticket] = None
        self._changed()
        return ticket

    def set_capacity(self, n: int) -> None:
        """Growth admits waiters in order; a shrink lets running requests finish."""
        self.capacity = _check_capacity(n)
        self._promote()
        self._changed()

    def retry_after(self, position: int | None = None) -> float:
        """Whole seconds (at least 1) until the ticket at `position` is likely admitted.

        `position` None means the back of the line, where a newcomer would stand.
        """
        if position is None:
            position = len(self._line)
        estimate = (position + 1) / self.capacity * self.service_time
        return float(max(1, math.ceil(estimate)))

    def __repr__(self) -> str:
        flag = " retired" if self._retired else ""
        return (f"<AdmissionQueue {self.key} {self._active}/{self.capacity} active, "
                f"{len(self._line)} waiting{flag}>")

    # --- helpers ---------------------------------------------------------------------

    def _has_free_slot(self) -> bool:
        return not self._enabled or self._active < self.capacity

    def _admit(self, ticket: Ticket, now: float) -> None:
        self._active += 1
        ticket._admit(now)

    def _promote(self) -> bool:
        """Admit from the front of the line while slots are free.  True if any moved."""
        if self._retired:
            return False
        moved = False
        while self._line and self._has_free_slot():
            ticket, _ = self._line.popitem(last=False)
            self._admit(ticket, self._clock())
            moved = True
        return moved

    def _finish(self, ticket: Ticket) -> None:
        self._active -= 1
        assert ticket.admitted_at is not None
        self._observe(self._clock() - ticket.admitted_at)
        self._promote()
        self._changed()

    def _leave(self, ticket: Ticket) -> None:
        del self._line[ticket]
        self._changed()

    def _observe(self, duration: float) -> None:
        duration = max(0.0, duration)
        if self._service_time is None:
            self._service_time = duration
        else:
            self._service_time += self.SERVICE_TIME_WEIGHT * (duration - self._service_time)

    def _take_line(self) -> list[Ticket]:
        tickets = list(self._line)
        self._line.clear()
        return tickets

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


class AdmissionRegistry:
    """One AdmissionQueue per backend base URL; exactly one of them is current."""

    def __init__(self, *,
                 max_waiting_for: Callable[[int], int] = lambda slots: max(64, 16 * slots),
                 enabled: bool = True, clock: Clock = time.monotonic) -> None:
        self._max_waiting_for = max_waiting_for
        self._enabled = enabled
        self._clock = clock
        # Insertion order is age; the current queue is moved to the end.
        self._queues: dict[str, AdmissionQueue] = {}
        self._current: AdmissionQueue | None = None
        self._listeners: Listeners[[]] = Listeners(log, "admission listener")
        # Set while several queues change at once, so listeners hear one final state.
        self._batching = False

    # --- state -----------------------------------------------------------------------

    @property
    def current(self) -> AdmissionQueue | None:
        return self._current

    @property
    def queues(self) -> list[AdmissionQueue]:
        """Every live queue, oldest first, the current one last."""
        return list(self._queues.values())

    @property
    def total_active(self) -> int:
        return sum(queue.active for queue in self._queues.values())

    @property
    def total_waiting(self) -> int:
        return sum(queue.waiting for queue in self._queues.values())

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        with self._batch():
            for queue in list(self._queues.values()):
                queue.enabled = self._enabled

    def queue_for(self, key: str) -> AdmissionQueue | None:
        return self._queues.get(key)

    # --- lifecycle -------------------------------------------------------------------

    def activate(self, key: str, capacity: int) -> AdmissionQueue:
        """A load at `key` became ready with `capacity` slots: make its queue current.

        Requests still waiting in earlier queues move to this one, ahead of anyone
        newer and in their order of arrival: they were never admitted, so no backend
        is bound to them yet.
        """
        _check_capacity(capacity)
        with self._batch():
            queue = self._queues.pop(key, None)
            if queue is None:
                queue = AdmissionQueue(
                    key, capacity, max_waiting=self._max_waiting_for(capacity),
                    enabled=self._enabled, clock=self._clock, on_change=self._queue_changed)
            else:
                queue._retired = False
                queue.capacity = capacity
                queue.max_waiting = self._max_waiting_for(capacity)
            earlier = list(self._queues.values())
            self._queues[key] = queue
            self._current = queue

            carried = [queue._take_line()]
            for old in earlier:
                old._retired = True
                carried.append(old._take_line())
            for ticket in sorted(itertools.chain.from_iterable(carried),
                                 key=lambda t: t._seq):
                ticket.queue = queue
                queue._line[ticket] = None

            self.prune()
            queue._promote()
        return queue

    def retire_current(self) -> None:
        """The current load is going away: stop admitting; running requests go on.

        Its waiters keep their places until the next `activate` or `refuse_waiting`.
        """
        queue, self._current = self._current, None
        if queue is None:
            return
        with self._batch():
            queue._retired = True
            self.prune()

    def refuse_waiting(self, error: BaseException) -> int:
        """Refuse every waiter of every retired queue with `error`; return how many."""
        refused = 0
        with self._batch():
            for queue in list(self._queues.values()):
                if not queue.retired:
                    continue
                for ticket in queue._take_line():
                    ticket._refuse(error)
                    refused += 1
            self.prune()
        return refused

    def prune(self) -> None:
        """Forget retired queues that have nothing running and nobody waiting."""
        for key, queue in list(self._queues.items()):
            if queue.retired and queue.idle:
                del self._queues[key]
        self._notify()

    def set_capacity(self, n: int) -> None:
        """The current load's slots were re-read.  Without a current load: nothing."""
        queue = self._current
        if queue is None:
            return
        _check_capacity(n)
        with self._batch():
            queue.max_waiting = self._max_waiting_for(n)
            queue.set_capacity(n)

    # --- listeners -------------------------------------------------------------------

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every change of counts.  Its errors are logged only."""
        self._listeners.add(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.remove(callback)

    def __repr__(self) -> str:
        return f"<AdmissionRegistry {self.queues!r}>"

    # --- helpers ---------------------------------------------------------------------

    def _queue_changed(self, queue: AdmissionQueue) -> None:
        if queue.retired and queue.idle and self._queues.get(queue.key) is queue:
            del self._queues[queue.key]
        self._notify()

    def _notify(self) -> None:
        if not self._batching:
            self._listeners()

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        """Hold listener calls back until the outermost batch ends, then call them once."""
        if self._batching:
            yield
            return
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self._notify()


_arrivals = itertools.count()


def _check_capacity(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"capacity must be a whole number of slots, at least 1, not {n!r}")
    return n
