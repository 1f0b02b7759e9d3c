"""Who may talk to llama-server now, and who waits: one bounded FIFO per backend.

Capacity is two numbers: free slots and free KV tokens.  A request's *need* is its
prompt tokens plus its output budget (`TokenNeed`, counted by `backend.port.prompt_tokens`).
The engine's cache (`KvCapacity`) is either

- **split**: each slot owns `total / slots` tokens, so a request must fit one slot
  (`need <= per_request`) and then always fits, whatever the others hold; or
- **unified**: one pool for every slot, so the needs of the running requests plus the
  newcomer's must fit `total` (and each need must fit `per_request`, the engine's cap
  on one sequence).

The head of the line starts when a slot is free and its need fits.  A need above
`per_request` can never fit: `request()` refuses it at once with
`ContextLengthExceeded`, and a waiter whose need no longer fits after a reload is
refused the same way.  A ticket without a known need (`need=None` or 0) reserves no
tokens and is admitted by slots alone, exactly as before KV accounting existed.

Fairness: strictly first come, first served.  **No request ever passes the head of
the line**, not even a small one that would fit while a big head waits for tokens.
The head only waits for running requests to finish (each has a bounded output
budget), so its wait is bounded and no one starves; letting smaller requests pass
would let a steady stream of short agent turns hold the pool below what a long
prompt needs, forever.  The price is head-of-line blocking: while a big head waits,
slots may stand idle.  Concurrency is unchanged whenever the needs fit (the common
case), because then the token check never says no.

Optimistic admission: a long prompt need not wait for its count when its byte bound
(an upper bound of the count, see `backend.port.prompt_tokens`) fits right now and nobody
waits (`fits_now`): it is admitted reserving the bound, and `Ticket.settle` shrinks the
reservation to the count when that returns, promoting waiters in order.  Only an empty
line is ever entered this way, so no one is passed.

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

import bisect
import contextlib
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import EllipsisType

from backend.port.admission_ticket import MAX_REQUEUES, Ticket, TicketState, as_need
from backend.errors import ContextLengthExceeded, ModelNotReady, QueueFull
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.listeners import Listeners

__all__ = [
    "MAX_REQUEUES",
    "AdmissionQueue",
    "AdmissionRegistry",
    "KvCapacity",
    "Ticket",
    "TicketState",
    "TokenNeed",
]

Clock = Callable[[], float]

log = logging.getLogger(__name__)


class AdmissionQueue:
    """The slots of one llama-server process and the FIFO line in front of them."""

    #: Weight of the newest admitted→released duration in the service-time estimate.
    SERVICE_TIME_WEIGHT = 0.2
    #: The service-time estimate before any request has finished.
    DEFAULT_SERVICE_TIME = 1.0

    def __init__(self, key: str, capacity: int, *, kv: KvCapacity | None = None,
                 max_waiting: int = 0, enabled: bool = True,
                 clock: Clock = time.monotonic,
                 on_change: Callable[[AdmissionQueue], None] | None = None) -> None:
        self.key = key
        #: What the engine at `key` requires in its Authorization header, if anything.
        self.api_key: str | None = None
        self.capacity = _check_capacity(capacity)
        #: None: the cache is unknown and only slots are counted.
        self.kv = kv
        self.max_waiting = max_waiting
        self._reserved = 0
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
        """Everyone in line, whether for a slot or for KV tokens."""
        return len(self._line)

    @property
    def reserved_tokens(self) -> int:
        """KV tokens held by the running requests of this load."""
        return self._reserved

    @property
    def kv_capacity(self) -> int:
        """The engine's total KV tokens, 0 while unknown."""
        return 0 if self.kv is None else self.kv.total

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

    def request(self, need: TokenNeed | int | None = None, *, size: int = 0,
                max_waiting_bytes: int = 0) -> Ticket:
        """A ticket: admitted at once if nobody waits and there is room, else waiting.

        `need` is the request's prompt tokens plus output budget (an int is all
        prompt); None or 0 means unknown: slots alone decide.  `size` is the bytes the
        request holds while it waits (its body); `max_waiting_bytes` (0: no bound)
        bounds what everyone waiting holds together.  Raises ContextLengthExceeded when
        the need can never fit one request's share of the cache, QueueFull when
        `max_waiting` requests already wait or the bytes would pass their bound, and
        ModelNotReady when the queue is retired.
        """
        if self._retired:
            raise ModelNotReady("The model is being reloaded. Try again shortly.",
                                retry_after=self.retry_after())
        need = as_need(need)
        if need is not None and self.kv is not None and need.total > self.kv.per_request:
            raise _too_long(need, self.kv)
        now = self._clock()
        if not self._line and self._has_room(need):
            ticket = Ticket(self, now, need)
            self._admit(ticket, now)
        else:
            if self.max_waiting and len(self._line) >= self.max_waiting:
                raise QueueFull(
                    f"The server is busy: {len(self._line)} requests are already "
                    "waiting. Try again later.",
                    retry_after=self.retry_after(),
                )
            if max_waiting_bytes:
                held = sum(waiter.size for waiter in self._line)  # O(n), n <= max_waiting
                if held + size > max_waiting_bytes:
                    raise QueueFull(
                        f"The server is busy: the requests already waiting hold "
                        f"{_mib(held)} of request bodies (the bound is "
                        f"{_mib(max_waiting_bytes)}). Try again later.",
                        retry_after=self.retry_after(),
                    )
            ticket = Ticket(self, now, need, size)
            self._line[ticket] = None
            # A slot left free by a requeue is taken by the head now, in order.
            self._promote()
        self._changed()
        return ticket

    def fits_now(self, need: TokenNeed | int | None) -> bool:
        """Would `request(need)` admit at once?  Nobody waits (no one is passed), this
        load is current, a slot and the tokens are free, and the need fits one
        request's share.  The gateway admits a long prompt on its byte bound when this
        holds, and counts it while it runs (`Ticket.settle`)."""
        need = as_need(need)
        if self._retired or self._line or not self._has_room(need):
            return False
        return need is None or self.kv is None or need.total <= self.kv.per_request

    def admit_waiting(self) -> None:
        """Admit from the head of the line while there is room.  A requeue leaves its
        slot free without promoting anyone; whoever still counts on this load (after a
        short backoff) asks it to try again with this."""
        if self._promote():
            self._changed()

    def set_capacity(self, n: int, kv: KvCapacity | None | EllipsisType = ...) -> None:
        """Growth admits waiters in order; a shrink lets running requests finish.

        `kv` replaces the cache's size (omitted: unchanged).  Waiters whose need no
        longer fits one request's share are refused with ContextLengthExceeded.
        """
        self.capacity = _check_capacity(n)
        if kv is not ...:
            self.kv = kv
            self._refuse_never_fitting()
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
        tokens = (f", {self._reserved}/{self.kv.total} tokens"
                  if self.kv is not None else "")
        return (f"<AdmissionQueue {self.key} {self._active}/{self.capacity} active"
                f"{tokens}, {len(self._line)} waiting{flag}>")

    # --- helpers ---------------------------------------------------------------------

    def _has_room(self, need: TokenNeed | None) -> bool:
        if not self._enabled:
            return True
        if self._active >= self.capacity:
            return False
        # A split cache gives every slot its own share, which `request()` already
        # checked the need against; only a unified pool can run out with a slot free.
        if need is None or self.kv is None or not self.kv.unified:
            return True
        return self._reserved + need.total <= self.kv.total

    def _admit(self, ticket: Ticket, now: float) -> None:
        self._active += 1
        self._reserved += ticket.tokens
        ticket._admit(now)

    def _promote(self) -> bool:
        """Admit from the front of the line while the head fits.  True if any moved.

        Only ever the head: see the module docstring for why no one passes it.
        """
        if self._retired:
            return False
        moved = False
        while self._line:
            ticket = next(iter(self._line))
            if not self._has_room(ticket.need):
                break
            del self._line[ticket]
            self._admit(ticket, self._clock())
            moved = True
        return moved

    def _refuse_never_fitting(self) -> None:
        """After the cache changed: refuse waiters that no load of this size could run.

        O(n) in the line, but only on a reload or re-read, never per request.
        """
        if self.kv is None:
            return
        for ticket in list(self._line):
            if ticket.need is not None and ticket.need.total > self.kv.per_request:
                del self._line[ticket]
                ticket._refuse(_too_long(ticket.need, self.kv))

    def _finish(self, ticket: Ticket, *, promote: bool = True) -> None:
        self._active -= 1
        self._reserved -= ticket.tokens
        assert ticket.admitted_at is not None
        self._observe(self._clock() - ticket.admitted_at)
        if promote:
            self._promote()
        self._changed()

    def _shrunk(self, ticket: Ticket, excess: int) -> None:
        """`ticket`'s need shrank by `excess` tokens (`Ticket.settle`)."""
        if ticket.state is TicketState.ADMITTED:
            self._reserved -= excess
        self._promote()
        self._changed()

    def _requeue(self, ticket: Ticket) -> None:
        """Back from a slot to the ticket's place by arrival (O(n), only on a refusal)."""
        self._active -= 1
        self._reserved -= ticket.tokens
        line = list(self._line)
        at = bisect.bisect(line, ticket._seq, key=lambda t: t._seq)
        line.insert(at, ticket)
        self._line = OrderedDict.fromkeys(line)
        self._changed()

    def _leave(self, ticket: Ticket) -> None:
        was_head = next(iter(self._line)) is ticket
        del self._line[ticket]
        # A head that waited for tokens may have held back smaller ones behind it.
        if was_head:
            self._promote()
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
    def total_reserved_tokens(self) -> int:
        """KV tokens held by running requests, on every live load."""
        return sum(queue.reserved_tokens for queue in self._queues.values())

    @property
    def kv_capacity(self) -> int:
        """The current load's total KV tokens, 0 without a load or while unknown."""
        return 0 if self._current is None else self._current.kv_capacity

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

    def activate(self, key: str, capacity: int,
                 kv: KvCapacity | None = None, *, api_key: str | None = None) -> AdmissionQueue:
        """A load at `key` became ready with `capacity` slots: make its queue current.

        Requests still waiting in earlier queues move to this one, ahead of anyone
        newer and in their order of arrival: they were never admitted, so no backend
        is bound to them yet.  Their needs are checked against this load's cache
        `kv`: those that can never fit it are refused with ContextLengthExceeded.
        """
        _check_capacity(capacity)
        with self._batch():
            queue = self._queues.pop(key, None)
            if queue is None:
                queue = AdmissionQueue(
                    key, capacity, kv=kv, max_waiting=self._max_waiting_for(capacity),
                    enabled=self._enabled, clock=self._clock, on_change=self._queue_changed)
            else:
                queue._retired = False
                queue.capacity = capacity
                queue.kv = kv
                queue.max_waiting = self._max_waiting_for(capacity)
            queue.api_key = api_key
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

            queue._refuse_never_fitting()
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

    def set_capacity(self, n: int, kv: KvCapacity | None | EllipsisType = ...) -> None:
        """The current load's slots (and cache, unless omitted) were re-read.

        Without a current load: nothing.
        """
        queue = self._current
        if queue is None:
            return
        _check_capacity(n)
        with self._batch():
            queue.max_waiting = self._max_waiting_for(n)
            queue.set_capacity(n, kv)

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
        current = self._current
        if queue.retired and queue._line and current is not None and current is not queue:
            # Waiters of a retired load (a requeue after the next load became current)
            # belong to the current one, in their order of arrival.
            tickets = sorted([*current._take_line(), *queue._take_line()],
                             key=lambda t: t._seq)
            for ticket in tickets:
                ticket.queue = current
                current._line[ticket] = None
            current._refuse_never_fitting()
            current._promote()
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



def _check_capacity(n: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"capacity must be a whole number of slots, at least 1, not {n!r}")
    return n


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _too_long(need: TokenNeed, kv: KvCapacity) -> ContextLengthExceeded:
    return ContextLengthExceeded(prompt_tokens=need.prompt, output_tokens=need.output,
                                 limit=kv.per_request)
