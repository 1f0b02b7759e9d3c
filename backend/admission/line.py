"""Who waits for a model's engines, and who goes next.

`Line`: the waiters of one model, in front of every engine that serves it
(`AdmissionQueue`, `backend.admission.engine_queue`: one engine's slots and KV tokens);
a waiter goes to whichever of them has room first.

The lines by model and the engines by key are kept by `AdmissionRegistry`
(`backend.admission.admission_registry`).

The head of a line starts on an engine of its model with a free slot and room for its
need (its prompt tokens plus its output budget, `TokenNeed`).  Which engine, and which
slot, is the line's `Placement`'s answer (`backend.admission.placement`; by default
`KeepPrefixes`: a session's turn where its prompt prefix is, else the engine with the
most free slots).  A need above every engine's `per_request` can never fit: `request()`
refuses it at once with `ContextLengthExceeded`, and a waiter whose need no longer fits
after a reload is refused the same way.  A ticket without a known need (`need=None` or
0) reserves no tokens and is admitted by slots alone.

Who goes next is the fair queue's order (`backend.admission.fair_queue`: priority bands
with aging, a fair share of reserved tokens between flows, first come first served inside
a flow).  With one flow this is a plain FIFO line, and **no request ever passes the head
of its own flow**: a big head waits only for running requests to finish (each has a
bounded output budget).  Another flow's request that fits may pass a head that does not
fit at most `MAX_PASSES` times; then nothing passes it until it fits, so no head starves.
The price is head-of-line blocking while a big head waits; concurrency is unchanged
whenever the needs fit (the common case).  One exception inside a flow: a head that waits
for its session's engine (full, while another has a free slot) takes nothing the flow's
next turns would take elsewhere, so they may pass it, within the same `MAX_PASSES`
(one key's agents, or every agent of a port without keys, are one flow: before, the
turn waiting for one engine kept the next ones from the other engine's free slot).

Optimistic admission: a long prompt need not wait for its count when its byte bound
(an upper bound of the count) fits right now and nobody waits (`fits_now`): it is
admitted reserving the bound, and `Ticket.settle` shrinks the reservation to the count
when that returns, promoting waiters in order.  Only an empty line is ever entered
this way, so no one is passed.

Waiters belong to their model's line, not to an engine: when an engine goes away (a
crash, a reload), its waiters simply wait for the next engine of their model, in their
order of arrival; only the requests it had started end with an error.

This module only decides: no sockets, no sleeps, no locks (the backend's one asyncio
loop).  The gateway asks a line for a ticket and holds it (`backend.admission.admission_ticket`).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from backend.errors import RETRY_SOON, ContextLengthExceeded, QueueFull
from backend.llama.kv_capacity import TokenNeed
from backend.admission.admission_ticket import (DEFAULT_FLOW, Ticket, TicketState, WaitReason,
                                                as_need)
from backend.admission.flow import Band, Flow
from backend.admission.fair_queue import FairQueue
from backend.admission.hint import NO_HINT, Hint
from backend.admission.line_engine import LineEngine
from backend.admission.load_wait import LoadWait
from backend.admission.placement import KeepPrefixes, Placeable, Placement
from backend.admission.prefill_budget import PrefillBudget, PrefillPlacement
from backend.admission.seat import Seat

__all__ = ["AGING_SECONDS", "DEFAULT_MODEL", "MAX_PASSES", "Clock", "Line"]

Clock = Callable[[], float]

#: The line of requests that name no model, or of a port that fronts one load.
DEFAULT_MODEL = ""
#: Seconds a lower band's head waits before it competes one band higher.
AGING_SECONDS = 30.0
#: How often a head that does not fit may be passed by other flows' requests that do.
MAX_PASSES = 4
#: Admissions a line remembers (arrival order, flow), to tell a waiter who passed it.
RECENT_ADMISSIONS = 64


E = TypeVar("E", bound=LineEngine)


class Line(Generic[E]):
    """The waiters of one model, first come first served, in front of its engines."""

    #: Weight of the newest admitted→released duration in the service-time estimate.
    SERVICE_TIME_WEIGHT = 0.2
    #: The service-time estimate before any request has finished.
    DEFAULT_SERVICE_TIME = 1.0

    def __init__(self, model: str = DEFAULT_MODEL, *, max_waiting: int = 0,
                 clock: Clock = time.monotonic,
                 on_change: Callable[[Line[E]], None] | None = None,
                 aging: float = AGING_SECONDS, max_passes: int = MAX_PASSES,
                 placement: Placement | None = None) -> None:
        self.model = model
        # The prefill budget stands in front of the policy: a long cold prompt waits
        # while another is computed beside running streams (backend.admission.prefill_budget).
        self.prefill_budget = PrefillBudget(aging=aging)
        self._prefill = PrefillPlacement(placement if placement is not None else KeepPrefixes(),
                                         self.prefill_budget, clock)
        self.max_waiting = max_waiting
        self._clock = clock
        self._on_change = on_change
        self._engines: list[E] = []
        # Who goes next: priority bands, a fair share between flows, FIFO in a flow;
        # O(log F) per push, admission and removal.
        self._waiters: FairQueue[Ticket] = FairQueue(clock=clock, aging=aging,
                                                     max_passes=max_passes)
        # Bytes of the waiters' bodies (those waiting for a load hold theirs in `_loading`).
        self._waiting_bytes = 0
        self._service_time: float | None = None
        # Requests that wait for any engine to serve the model (it is loading) before
        # they can be planned and take a ticket.
        self._loading = LoadWait(self._changed)
        # (when, flow) of the last requests that ended.
        self._ended: collections.deque[tuple[float, str]] = collections.deque(maxlen=64)
        # (arrival order, flow) of the last tickets admitted: who passed a waiter.
        self._admitted: collections.deque[tuple[int, str]] = collections.deque(
            maxlen=RECENT_ADMISSIONS)

    # --- state -----------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        """Where a ticket whose turn has come is admitted (`backend.admission.placement`),
        behind the prefill budget; another policy may be set."""
        return self._prefill.inner

    @placement.setter
    def placement(self, policy: Placement) -> None:
        self._prefill.inner = policy

    @property
    def engines(self) -> list[E]:
        """The engines serving this model now, in the order they joined."""
        return list(self._engines)

    @property
    def waiting(self) -> int:
        """Everyone in line, and those waiting for the model's first engine."""
        return len(self._waiters) + len(self._loading)

    @property
    def busy(self) -> bool:
        """Someone runs on one of its engines or waits for them."""
        return bool(self.waiting or any(engine.active for engine in self._engines))

    @property
    def planning_engine(self) -> E | None:
        """The engine whose cache plans a request's need: the one that can take the
        largest (a need refused there fits none of them), among equals one that counts
        prompts (another GGUF Studio port has no counting routes, and the byte estimate
        refused long prompts that fit); None while none serves."""
        best: E | None = None
        for engine in self._engines:
            if best is None or _limit(engine) > _limit(best) or (
                    _limit(engine) == _limit(best) and engine.counts_prompts
                    and not best.counts_prompts):
                best = engine
        return best

    @property
    def capacity(self) -> int:
        """Slots of every engine serving the model."""
        return sum(engine.capacity for engine in self._engines)

    @property
    def service_time(self) -> float:
        """Recent mean admitted→released duration in seconds."""
        if self._service_time is None:
            return self.DEFAULT_SERVICE_TIME
        return self._service_time

    @property
    def per_request(self) -> int | None:
        """The largest need one of its engines could ever take; None while any is
        unknown (or none serves): no need is then refused for its size."""
        limits = [engine.kv.per_request if engine.kv is not None else None
                  for engine in self._engines]
        if not limits or None in limits:
            return None
        return max(limit for limit in limits if limit is not None)

    def __iter__(self) -> Iterator[Ticket]:
        """The waiters in order of admission."""
        return iter(self._waiters)

    # --- decisions -------------------------------------------------------------------

    def request(self, need: TokenNeed | int | None = None, *, size: int = 0,
                max_waiting_bytes: int = 0, flow: Flow = DEFAULT_FLOW,
                band: Band | None = None, hint: Hint = NO_HINT) -> Ticket:
        """A ticket: admitted at once if its turn has come and an engine has room, else
        waiting.

        `need` is the request's prompt tokens plus output budget (an int is all
        prompt); None or 0 means unknown: slots alone decide.  `size` is the bytes the
        request holds while it waits (its body); `max_waiting_bytes` (0: no bound)
        bounds what everyone waiting holds together.  `flow` is whose share it counts
        against (a key, or a client address); `band` may lower the flow's priority for
        this request.  `hint` is what placement may read beside the need.  Raises
        ContextLengthExceeded when the need can never fit one request's share of any
        engine's cache, and QueueFull when `max_waiting` requests already wait or the
        bytes would pass their bound.
        """
        need = as_need(need)
        self._check_fits_some_engine(need)
        ticket = Ticket(self, self._clock(), need, size, flow=flow, band=band, hint=hint)
        self._waiters.push(ticket, flow, max(1, ticket.tokens), ticket.seq, band)
        self._waiting_bytes += size
        self._promote()
        if ticket.state is TicketState.WAITING:
            ticket.wait_reason = self._why_waiting(ticket)
            waiting = len(self._waiters) - 1
            if self.max_waiting and waiting >= self.max_waiting:
                self._pop(ticket)
                raise QueueFull(
                    f"The server is busy: {waiting} requests are already waiting. "
                    "Try again later.", retry_after=self.retry_after())
            held = self._waiting_bytes + self._loading.bytes
            if max_waiting_bytes and held > max_waiting_bytes:
                self._pop(ticket)
                raise _bodies_full(held, max_waiting_bytes, self.retry_after())
        self._changed()
        return ticket

    def fits_now(self, need: TokenNeed | int | None, hint: Hint = NO_HINT) -> bool:
        """Would `request(need)` admit at once?  Nobody waits (no one is passed), and
        the placement finds a seat for the need.  The gateway admits a long prompt on
        its byte bound when this holds, and counts it while it runs."""
        return (not len(self._waiters)
                and self._seat_for(_Probe(as_need(need), hint, self._clock())) is not None)

    def when_served(self, *, size: int = 0, max_waiting_bytes: int = 0,
                    flow: str = DEFAULT_FLOW.key) -> asyncio.Future[None]:
        """Done once an engine serves the model (at once if one does); fails with the
        refusal if the model's waiters are refused first (its load failed, or its flow's
        key was revoked: see `refuse_flow`).  Meanwhile its `size` bytes count with the
        waiters' (QueueFull past `max_waiting_bytes`, as for a ticket).  Once served it
        still keeps the model busy until its holder calls `stop_awaiting` (it took its
        ticket, or gave up): its request is planned in between, and a model evicted then
        would leave it no engine to wait for."""
        if self._engines:
            served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            served.set_result(None)
            return served
        self.check_wait(size, max_waiting_bytes)
        served = self._loading.add(flow, size)
        self._changed()
        return served

    def stop_awaiting(self, served: asyncio.Future[None]) -> None:
        """The request of `served` (`when_served`) took its ticket or gave up."""
        self._loading.stop(served)

    def check_wait(self, size: int = 0, max_waiting_bytes: int = 0) -> None:
        """QueueFull when one more request holding `size` bytes may not wait for the
        model to load (`when_served`): asked before anything starts a load for it."""
        if self.max_waiting and self.waiting >= self.max_waiting:
            raise QueueFull(f"The server is busy: {self.waiting} requests already wait for "
                            "the model to load. Try again later.", retry_after=RETRY_SOON)
        held = self._waiting_bytes + self._loading.bytes
        if max_waiting_bytes and held + size > max_waiting_bytes:
            raise _bodies_full(held, max_waiting_bytes, RETRY_SOON)

    def admit_waiting(self) -> None:
        """Admit from the head of the line while there is room."""
        if self._promote():
            self._changed()

    def retry_after(self, position: int | None = None) -> float:
        """Whole seconds (at least 1) until the ticket at `position` is likely admitted.

        `position` None means the back of the line, where a newcomer would stand.
        """
        if position is None:
            position = len(self._waiters)
        estimate = (position + 1) / max(1, self.capacity) * self.service_time
        return float(max(1, math.ceil(estimate)))

    def __repr__(self) -> str:
        return (f"<Line {self.model!r} {len(self._engines)} engines, "
                f"{len(self._waiters)} waiting>")

    # --- the ticket's seam (backend.admission.admission_ticket.TicketSeam) ---------------------

    def finish(self, ticket: Ticket, *, hold: bool) -> None:
        # Noted for a crash noticed a moment after its requests ended (the pool's).
        self._ended.append((self._clock(), ticket.flow.key))
        engine = self._engine_of(ticket)
        engine.give_back(ticket)
        self.prefill_budget.ended(ticket)
        self._waiters.finished(ticket)
        assert ticket.admitted_at is not None
        self._observe(self._clock() - ticket.admitted_at)
        self._prefill.inner.slot_freed(ticket)
        self._promote(skip=engine if hold else None)
        # After the promotion: a session's first turn still counts where it ran while
        # others choose their engine (its answer is recorded right after this).
        self._placement_ended(ticket)
        self._changed()

    def leave(self, ticket: Ticket) -> None:
        self._pop(ticket)
        # A head that waited for tokens may have held back others behind it.
        self._promote()
        self._changed()

    def shrink(self, ticket: Ticket, excess: int) -> None:
        if ticket.state is TicketState.ADMITTED:
            self._engine_of(ticket).give_back_tokens(excess)
        cost = max(1, ticket.tokens + excess)
        self._waiters.refund(ticket, min(excess, cost - 1))
        self._promote()
        self._changed()

    def requeue(self, ticket: Ticket) -> None:
        """Back from a slot to the ticket's place by arrival (O(n), only on a refusal).
        The refusing engine's slot takes no one now; another engine of the model may."""
        engine = self._engine_of(ticket)
        engine.give_back(ticket)
        self.prefill_budget.ended(ticket)
        self._placement_ended(ticket)
        self._waiters.requeue(ticket)
        self._waiting_bytes += ticket.size
        self._promote(skip=engine)
        self._changed()

    def position(self, ticket: Ticket) -> int | None:
        return self._waiters.position(ticket)

    def prefilled(self, ticket: Ticket) -> None:
        if self.prefill_budget.prefilled(ticket):
            self._promote()
            self._changed()

    def seated(self, ticket: Ticket) -> None:
        self._prefill.inner.seated(ticket)
        if self._promote():
            self._changed()

    @property
    def held_by_prefill_budget(self) -> int:
        """Waiters the prefill budget holds now (their turn came; a long prompt runs)."""
        return len(self._prefill.held)

    # --- the engines' side ----------------------------------------------------------------

    def attach(self, engine: E) -> None:
        """`engine` serves this model now (its waiters may go to it)."""
        if engine not in self._engines:
            self._engines.append(engine)
        self._loading.serve_all()
        self.engines_changed()

    def detach(self, engine: E) -> None:
        """`engine` no longer takes anyone; what runs on it goes on."""
        if engine in self._engines:
            self._engines.remove(engine)
        self._changed()

    def engines_changed(self) -> None:
        """An engine joined, or its slots or cache changed: refuse waiters that can never
        fit now, admit those that fit."""
        self._refuse_never_fitting()
        self._promote()
        self._changed()

    def refuse_waiting(self, error: BaseException) -> int:
        """Refuse every waiter with `error`; how many."""
        tickets = list(self._waiters)
        for ticket in tickets:
            self._pop(ticket)
            ticket.refuse(error)
        awaiting = self._loading.refuse(error)
        if tickets or awaiting:
            self._changed()
        return len(tickets) + awaiting

    def take_waiters(self, other: Line[E]) -> None:
        """`other`'s waiters join this line, everyone in order of arrival (a load that
        replaces another under a new name keeps the old one's waiters)."""
        if other is self or not len(other._waiters):
            return
        for ticket in list(other._waiters):
            other._pop(ticket)
            ticket.line = self
            self._waiters.push(ticket, ticket.flow, max(1, ticket.tokens), ticket.seq,
                               ticket.band)
            self._waiting_bytes += ticket.size
        other._changed()
        self.engines_changed()

    # --- helpers ---------------------------------------------------------------------

    def _seat_for(self, ticket: Placeable) -> Seat[E] | None:
        """The placement's seat for `ticket` on the engines of the model."""
        engines = self._engines
        return self._prefill.place(ticket, engines) if engines else None

    def _promote(self, skip: E | None = None) -> bool:
        """Admit, in the fair queue's order, while an engine has a free slot and the
        placement seats the next one.  True if any moved."""
        moved = False
        waiters = self._waiters
        engines = self._engines
        if skip is not None and skip in engines:  # rare: after a requeue or a hold
            engines = [engine for engine in engines if engine is not skip]
        if not engines:
            return False
        place = self._prefill.place
        chosen: list[Seat[E] | None] = [None]

        held = self._prefill.held

        def fits(ticket: Ticket) -> bool:  # notes the seat, so it is looked up once
            chosen[0] = place(ticket, engines)
            if chosen[0] is None and ticket in held:
                ticket.wait_reason = WaitReason.PREFILL_BUDGET
            return chosen[0] is not None

        policy = self._prefill.inner

        def waits_elsewhere(ticket: Ticket) -> bool:
            # Its engine (its session's) has no free slot: whoever of its flow goes
            # meanwhile goes to another engine, and takes nothing it waits for.
            home = policy.home_while_waiting(ticket, engines)
            return home is not None and not home.free_slots

        may_pass = waits_elsewhere if len(engines) > 1 else None
        while len(waiters) and self._slot_free(skip):
            ticket = waiters.next_to_admit(fits, may_pass)
            if ticket is None:
                break
            seat = chosen[0]
            assert seat is not None
            self._waiting_bytes -= ticket.size
            seat.engine.take(ticket, self._clock(), seat)
            self.prefill_budget.started(ticket, seat.engine)
            policy.admitted(ticket, seat)
            if ticket.wait_reason == WaitReason.SLOTS_FULL:
                self._note_passer(ticket)
            self._admitted.append((ticket.seq, ticket.flow.key))
            if seat.cached:  # the fair share charges what the engine's cache lacks
                waiters.discount(ticket, seat.cached)
            moved = True
        return moved

    def _placement_ended(self, ticket: Ticket) -> None:
        self._prefill.inner.ended(ticket)

    def _why_waiting(self, ticket: Ticket) -> str:
        """Why `ticket` did not go in at once (O(engines), only for one that waits): the
        prefill budget, its flow's concurrency, no engine yet, every slot taken, its
        session's engine full while another has room, or no room in the cache."""
        if ticket in self._prefill.held:
            return WaitReason.PREFILL_BUDGET
        flow = ticket.flow
        # Its key's running requests and those waiting before it (it is in line already):
        # as many as it may run at once, and it waits for them whatever the slots do.
        own = self._waiters.running_of(flow.key) + self._waiters.waiting_of(flow.key) - 1
        if flow.max_concurrent and own >= flow.max_concurrent:
            return WaitReason.KEY_CONCURRENCY
        if not self._engines:
            return WaitReason.MODEL_LOADING
        if not self._slot_free(None):
            return WaitReason.SLOTS_FULL
        if self._prefill.inner.waits_for_home(ticket, self._engines):
            return WaitReason.SESSION_ENGINE
        if self._prefill.inner.waits_for_seating(ticket, self._engines):
            return WaitReason.SLOT_SEATING
        return WaitReason.KV_FULL

    def _note_passer(self, ticket: Ticket) -> None:
        """A ticket that waited for a slot is admitted: if another flow's later arrival
        went in before it, that flow's share (or band) came first (the latest such one
        is named).  O(RECENT_ADMISSIONS), only for a ticket that waited."""
        seq, own = ticket.seq, ticket.flow.key
        for other_seq, other in reversed(self._admitted):
            if other_seq > seq and other != own:
                ticket.wait_reason = WaitReason.FAIR_SHARE
                ticket.waited_behind = other
                return

    def _slot_free(self, skip: E | None) -> bool:
        for engine in self._engines:
            if engine is not skip and (engine.free_slots or not engine.enabled):
                return True
        return False

    # --- flows ---------------------------------------------------------------------------

    def refuse_flow(self, key: str, error: BaseException) -> int:
        """Refuse the waiters of flow `key` (its key was revoked), also those waiting
        for the model to load; how many."""
        refused = [t for t in self._waiters if t.flow.key == key]
        for ticket in refused:
            self._pop(ticket)
            ticket.refuse(error)
        loading = self._loading.refuse(error, key)
        if refused:
            self._promote()
        if refused or loading:
            self._changed()
        return len(refused) + loading

    def flows_in_flight(self, within: float) -> set[str]:
        """The flows with a request running now, or ended within the last `within`
        seconds: those a crash of an engine of this model hit (their requests end as
        their connections break, often before the crash is noticed)."""
        since = self._clock() - within
        return self._waiters.running_flows() | {
            flow for when, flow in self._ended if when >= since}

    def awaiting_flows(self) -> set[str]:
        """The flows of the requests that wait for the model to load."""
        return self._loading.flows()

    def update_flow(self, flow: Flow) -> None:
        """A key's weight, band or concurrency changed: it applies now."""
        self._waiters.update_flow(flow)
        self.admit_waiting()

    def _check_fits_some_engine(self, need: TokenNeed | None) -> None:
        limit = self.per_request
        if need is not None and limit is not None and need.total > limit:
            raise _too_long(need, limit)

    def _refuse_never_fitting(self) -> None:
        """Refuse waiters that no engine of this line could run.

        O(n) in the line, but only on a reload or re-read, never per request.
        """
        limit = self.per_request
        if limit is None:
            return
        for ticket in list(self._waiters):
            if ticket.need is not None and ticket.need.total > limit:
                self._pop(ticket)
                ticket.refuse(_too_long(ticket.need, limit))

    def _pop(self, ticket: Ticket) -> None:
        self._waiters.remove(ticket)
        self._prefill.forget(ticket)
        self._waiting_bytes -= ticket.size

    def _engine_of(self, ticket: Ticket) -> E:
        seat = ticket.seat
        assert seat is not None, "a ticket of this line was never admitted"
        engine: E = seat.engine
        return engine

    def _observe(self, duration: float) -> None:
        duration = max(0.0, duration)
        if self._service_time is None:
            self._service_time = duration
        else:
            self._service_time += self.SERVICE_TIME_WEIGHT * (duration - self._service_time)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


@dataclass(frozen=True, slots=True)
class _Probe:
    """A request that has no ticket yet, as placement reads it (`fits_now`): arriving
    now, so it may wait for its session's engine as its ticket will."""

    need: TokenNeed | None
    hint: Hint
    enqueued_at: float



def _limit(engine: LineEngine) -> int:
    kv = engine.kv
    return kv.per_request if kv is not None else 0


def _bodies_full(held: int, bound: int, retry_after: float) -> QueueFull:
    return QueueFull(f"The server is busy: the requests already waiting hold {_mib(held)} of "
                     f"request bodies (the bound is {_mib(bound)}). Try again later.",
                     retry_after=retry_after)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _too_long(need: TokenNeed, limit: int) -> ContextLengthExceeded:
    return ContextLengthExceeded(prompt_tokens=need.prompt, output_tokens=need.output,
                                 limit=limit)

