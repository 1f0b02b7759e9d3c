"""One request's place in admission: first in a load's line, then in one of its slots.

`Ticket` is what `AdmissionQueue.request()` hands out and the gateway holds for the
request's whole life: it waits on it, releases it when the answer is finished or
abandoned, sends it back in line when the load refused the connection (`requeue`), and
shrinks its reservation once the prompt is counted (`settle`).  The queue decides who is
admitted (`backend.port.admission`); the ticket carries out its own transitions and tells
its queue.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from typing import TYPE_CHECKING

from backend.errors import QueueTimeout
from backend.llama.kv_capacity import TokenNeed

if TYPE_CHECKING:
    from backend.port.admission import AdmissionQueue

__all__ = ["MAX_REQUEUES", "Ticket", "TicketState", "as_need"]

#: How often one ticket may go back in line after a refused connection before the
#: request fails: a load that keeps refusing while it counts as ready is not coming back.
MAX_REQUEUES = 5


class TicketState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    RELEASED = "released"
    REFUSED = "refused"


class Ticket:
    """One request's place: first in a line, then in a slot of one backend."""

    __slots__ = ("state", "queue", "need", "size", "enqueued_at", "admitted_at", "requeues",
                 "_error", "_event", "_seq")

    def __init__(self, queue: AdmissionQueue, now: float,
                 need: TokenNeed | None = None, size: int = 0) -> None:
        self.state = TicketState.WAITING
        self.queue = queue
        #: None: unknown, admitted by slots alone and reserving no tokens.
        self.need = need
        #: Bytes the request holds while it waits (its body).
        self.size = size
        self.enqueued_at = now
        self.admitted_at: float | None = None
        #: Times the load refused the connection and the ticket stood in line again.
        self.requeues = 0
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
    def api_key(self) -> str | None:
        """The key the engine of this ticket's load requires (it travels with the load)."""
        return self.queue.api_key

    @property
    def admitted(self) -> bool:
        return self.state is TicketState.ADMITTED

    @property
    def tokens(self) -> int:
        """The KV tokens this ticket reserves (held while admitted)."""
        return 0 if self.need is None else self.need.total

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
                        "The request waited too long for room on the model. "
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

    def release(self, *, hold: bool = False) -> None:
        """Give back the slot, or the place in line.  Safe to call more than once.

        `hold`: the engine dropped this request while answering, so it is likely going
        away: nobody is let into the freed slot now (they would find the connection
        refused, or worse, be cut off as started requests); the caller asks the queue
        again later with `AdmissionQueue.admit_waiting`, by when a dead load is retired.
        """
        if self.state is TicketState.ADMITTED:
            self.state = TicketState.RELEASED
            self.queue._finish(self, promote=not hold)
        elif self.state is TicketState.WAITING:
            self.state = TicketState.RELEASED
            self.queue._leave(self)
            self._wake()

    def settle(self, need: TokenNeed | int) -> int:
        """The request's prompt was counted after it was admitted on its byte bound:
        shrink the reservation to `need` and return the tokens given back (0 if none).

        Waiters behind it are promoted in order, as on a release.  The bound is an
        upper bound of the count, so a `need` above the reservation cannot come from a
        sound bound: the reservation is kept (never grown, which could overcommit the
        pool behind the admission's back).  A no-op, returning 0, on a released or
        refused ticket, on one reserving nothing, and when called again.  A ticket sent
        back in line (`requeue`) shrinks too, and the head of the line is then tried.
        """
        settled = as_need(need)
        if (settled is None or self.need is None
                or self.state not in (TicketState.ADMITTED, TicketState.WAITING)):
            return 0
        excess = self.need.total - settled.total
        if excess <= 0:
            return 0
        self.need = settled
        self.queue._shrunk(self, excess)
        return excess

    def requeue(self) -> bool:
        """The load refused the connection before any byte of the request reached it:
        give the slot back and stand in line again at the ticket's original place.

        True when the ticket waits again (await `wait` once more); False when it was not
        admitted or has been put back `MAX_REQUEUES` times already (the load keeps
        refusing: the caller gives up).  A refused connection says the load is going
        away, so a requeue promotes no one by itself: the ticket is admitted again by the
        next release, arrival or capacity change, or carried to the next load like any
        waiter when this one is retired.
        """
        if self.state is not TicketState.ADMITTED or self.requeues >= MAX_REQUEUES:
            return False
        self.requeues += 1
        self.state = TicketState.WAITING
        self.admitted_at = None
        self._event = None  # set by the admission: a new one for the next wait
        self.queue._requeue(self)
        return True

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


def as_need(need: TokenNeed | int | None) -> TokenNeed | None:
    """`need` as a TokenNeed (an int is all prompt); None when unknown or 0."""
    if need is None or isinstance(need, TokenNeed):
        return need if need is None or need.total > 0 else None
    if not _whole(need) or need < 0:
        raise ValueError(f"a token need is a whole number, at least 0, not {need!r}")
    return TokenNeed(need, 0) if need else None


_arrivals = itertools.count()


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
