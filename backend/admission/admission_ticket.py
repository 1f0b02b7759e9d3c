"""One request's place in admission: first in its model's line, then in a slot of one engine.

`Ticket` is what `Line.request()` hands out and the gateway holds for the request's
whole life: it waits on it, releases it when the answer is finished or abandoned, sends
it back in line when the engine refused the connection (`requeue`), and shrinks its
reservation once the prompt is counted (`settle`).  The line decides who is admitted
(`backend.admission.line`); the ticket carries out its own transitions and tells its line
through the small `TicketSeam` below, the only thing it knows of admission.

    ticket = registry.line(model).request(need)   # may raise QueueFull
    try:
        await ticket.wait(queue_timeout)           # may raise QueueTimeout or a refusal
        ...forward to ticket.serving.base_url...
    finally:
        ticket.release()                           # idempotent
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from typing import Any, Protocol

from backend.errors import QueueTimeout
from backend.llama.kv_capacity import TokenNeed
from backend.llama.load import Serving
from backend.admission.flow import Band, Flow
from backend.admission.hint import NO_HINT, Hint
from backend.admission.seat import Seat

__all__ = ["DEFAULT_FLOW", "MAX_REQUEUES", "EngineSeat", "Ticket", "TicketSeam", "TicketState",
           "WaitReason", "as_need"]

#: How often one ticket may go back in line after a refused connection before the
#: request fails: a load that keeps refusing while it counts as ready is not coming back.
MAX_REQUEUES = 5
#: The flow of a request no key or address is known for.
DEFAULT_FLOW = Flow("")


class TicketState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    RELEASED = "released"
    REFUSED = "refused"


class WaitReason:
    """Why a ticket waited before it was admitted, as the line saw it (plain strings: the
    request inspector shows them, `backend.port.request_log`)."""

    #: Every slot of every engine of its model was taken.
    SLOTS_FULL = "slots_full"
    #: A slot was free but no engine's KV cache had room for its need.
    KV_FULL = "kv_full"
    #: A slot was free, on another engine than the one holding its session's prefix:
    #: it waited for that one (placement's `HOME_WAIT` at most).
    SESSION_ENGINE = "session_engine"
    #: Its key already ran (or had waiting before it) as many requests as it may run at
    #: once (`Flow.max_concurrent`), whether or not a slot was free.
    KEY_CONCURRENCY = "key_concurrency"
    #: Another flow's later request went first (its fair share, or its band).
    FAIR_SHARE = "fair_share"
    #: No engine served its model yet (it was loading, or reloading).
    MODEL_LOADING = "model_loading"
    #: The engine's budget of prompt tokens read at once was spent.
    PREFILL_BUDGET = "prefill_budget"
    #: A slot was free on an attached llama-server that picks slots by itself, but a turn
    #: on its way there had not been taken into its slot yet (a turn the engine cannot
    #: pin could have landed on a pinned one's slot: `KeepPrefixes._waits_for_seating`).
    SLOT_SEATING = "slot_seating"


class EngineSeat(Protocol):
    """The engine a ticket was admitted on, as the ticket's holder sees it."""

    @property
    def serving(self) -> Serving: ...

    @property
    def retired(self) -> bool: ...

    @property
    def label(self) -> str:
        """The engine's public name ("this machine", "upstream N"), for the metrics."""


class TicketSeam(Protocol):
    """What a ticket may ask of the line it belongs to; the line does the bookkeeping."""

    def finish(self, ticket: Ticket, *, hold: bool) -> None:
        """An admitted ticket is done: free its slot and tokens (`hold`: admit no one
        into that engine now)."""

    def leave(self, ticket: Ticket) -> None:
        """A waiting ticket leaves the line."""

    def shrink(self, ticket: Ticket, excess: int) -> None:
        """The ticket's need shrank by `excess` tokens."""

    def requeue(self, ticket: Ticket) -> None:
        """An admitted ticket goes back to its place by arrival, its engine refused it."""

    def admit_waiting(self) -> None:
        """Admit from the line while there is room (after a hold or a requeue)."""

    def retry_after(self, position: int | None = None) -> float:
        """Whole seconds until the ticket at `position` is likely admitted."""

    def prefilled(self, ticket: Ticket) -> None:
        """The engine sent its first bytes for `ticket`: its prompt is computed."""

    def seated(self, ticket: Ticket) -> None:
        """The engine answered `ticket`'s request with its headers: a slot took it."""

    def position(self, ticket: Ticket) -> int | None:
        """0-based place of a waiting ticket, else None."""


class Ticket:
    """One request's place: first in a line, then in a slot of one engine."""

    __slots__ = ("state", "line", "engine", "seat", "need", "hint", "size", "flow", "band",
                 "enqueued_at", "admitted_at", "requeues", "seq", "wait_reason", "waited_behind",
                 "_error", "_event")

    def __init__(self, line: TicketSeam, now: float,
                 need: TokenNeed | None = None, size: int = 0, *,
                 flow: Flow = DEFAULT_FLOW, band: Band | None = None,
                 hint: Hint = NO_HINT) -> None:
        self.state = TicketState.WAITING
        #: Whose share it counts against: a key, or a client address.
        self.flow = flow
        #: The band it asked for (only ever lower than its flow's); None: its flow's.
        self.band = band
        self.line = line
        #: The engine it is admitted on (the last one, once released); None until then.
        self.engine: EngineSeat | None = None
        #: The engine and slot id it is admitted on (the last ones, once released).
        self.seat: Seat[Any] | None = None
        #: None: unknown, admitted by slots alone and reserving no tokens.
        self.need = need
        #: What placement may read beside the need (its session, its prompt's prefix).
        self.hint = hint
        #: Bytes the request holds while it waits (its body).
        self.size = size
        self.enqueued_at = now
        self.admitted_at: float | None = None
        #: Times the engine refused the connection and the ticket stood in line again.
        self.requeues = 0
        #: Global arrival order: a ticket sent back in line returns to its place.
        self.seq = next(_arrivals)
        #: Why it waited (a `WaitReason`), set by its line; None: admitted at once.
        self.wait_reason: str | None = None
        #: With `WaitReason.FAIR_SHARE`: the flow whose later request went first.
        self.waited_behind: str | None = None
        self._error: BaseException | None = None
        # Created only when someone awaits: a long line must not cost an Event each.
        self._event: asyncio.Event | None = None

    @property
    def serving(self) -> Serving:
        """The engine this ticket was admitted on; only while (or after) admitted."""
        if self.engine is None:
            raise RuntimeError("The ticket was never admitted.")
        return self.engine.serving

    @property
    def base_url(self) -> str:
        return self.serving.base_url

    @property
    def api_key(self) -> str | None:
        """The key the engine of this ticket's load requires (it travels with the load)."""
        return self.serving.api_key

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

    def prefilled(self) -> None:
        """The engine sent its first bytes: the prompt is computed (the prefill budget
        lets the next long one start).  Once per request, not per chunk."""
        if self.state is TicketState.ADMITTED:
            self.line.prefilled(self)

    def seated(self) -> None:
        """The engine's answer began (its headers came): a slot has taken the request
        (a streamed one's headers come when its slot starts on the prompt, a whole
        answer's with it).  Placement may then admit a turn that it held so as not to
        take that slot first.  Once per request."""
        if self.state is TicketState.ADMITTED:
            self.line.seated(self)

    @property
    def position(self) -> int | None:
        """0-based place in line while waiting, else None.  O(n): diagnostics only."""
        if self.state is not TicketState.WAITING:
            return None
        return self.line.position(self)

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
                    line = self.line
                    self.release()
                    raise QueueTimeout(
                        "The request waited too long for room on the model. "
                        "Try again later.",
                        retry_after=line.retry_after(),
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
        refused, or worse, be cut off as started requests); the caller asks the line
        again later with `admit_waiting`, by when a dead load is retired.
        """
        if self.state is TicketState.ADMITTED:
            self.state = TicketState.RELEASED
            self.line.finish(self, hold=hold)
        elif self.state is TicketState.WAITING:
            self.state = TicketState.RELEASED
            self.line.leave(self)
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
        self.line.shrink(self, excess)
        return excess

    def requeue(self) -> bool:
        """The engine refused the connection before any byte of the request reached it:
        give the slot back and stand in line again at the ticket's original place.

        True when the ticket waits again (await `wait` once more) or was admitted at
        once on another engine of its model; False when it was not admitted or has been
        put back `MAX_REQUEUES` times already (the engine keeps refusing: the caller
        gives up).  A refused connection says the engine is going away, so its freed
        slot takes no one by itself: the ticket is admitted again by the next release,
        arrival or capacity change, or by another engine of its model.
        """
        if self.state is not TicketState.ADMITTED or self.requeues >= MAX_REQUEUES:
            return False
        self.requeues += 1
        self.state = TicketState.WAITING
        self.admitted_at = None
        self._event = None  # set by the admission: a new one for the next wait
        self.line.requeue(self)
        return True

    def __repr__(self) -> str:
        return f"<Ticket #{self.seq} {self.state.value}>"

    # --- called by the line ----------------------------------------------------------

    def admit(self, seat: Seat[Any], now: float) -> None:
        self.state = TicketState.ADMITTED
        self.seat = seat
        self.engine = seat.engine
        self.admitted_at = now
        self._wake()

    def refuse(self, error: BaseException) -> None:
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
