"""A seat: one slot of one engine, and which slot of a chosen engine a ticket takes.

`Seat` is where the line admits a ticket (an engine and one of its slot ids, pinned or
not, with the prompt tokens its cache is expected to hold); `SeatEngine` is an engine as
placement reads it.  Once a policy (`backend.admission.placement`) has chosen the engine,
`seat_on` picks the slot: the one holding the session's prefix, pinned, when it is free
and still holds it, else the one llama-server would take by itself (`unpinned`), pinned
where the engine keeps prefixes; on an attached llama-server that finds prefixes in its
RAM cache, a returning session on the least recently used free slot, vacated first, and a
new one on a slot no session holds.  `keeps_slots`: does an engine keep each slot's
prompt in the slot (a split cache)?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

from backend.admission.session_book import Session, Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed

__all__ = ["Seat", "SeatEngine", "keeps_slots", "seat_on", "unpinned"]


class SeatEngine(Protocol):
    """One engine as placement reads it."""

    @property
    def key(self) -> str:
        """Its admission key: a new one for each process (a restart holds no prefix)."""

    @property
    def kv(self) -> KvCapacity | None:
        """Its cache; None while unknown."""

    @property
    def free_slots(self) -> int: ...

    def has_room(self, need: TokenNeed | None) -> bool:
        """A free slot (or admission off), and room for `need`."""

    def lowest_free_slot(self) -> int | None:
        """The lowest slot id free now; None when none is (admission off, all taken)."""

    def lowest_free_seat(self) -> Seat[Self]:
        """The (unpinned) seat of `lowest_free_slot`, kept ready: no allocation."""

    def least_recent_free_seat(self) -> Seat[Self]:
        """The (unpinned) seat of the free slot released longest ago (never used ones
        first, the highest id among equals): the one llama-server takes by itself."""

    def slot_free(self, slot: int) -> bool:
        """Is slot id `slot` one of the engine's and free now?"""

    def slot_used(self, slot: int) -> bool:
        """Has slot id `slot` held a request since the engine started?"""

    @property
    def pin_any_slot(self) -> bool:
        """A request pinned to a slot that has held a prompt still finds its own prefix
        (in that slot or the engine's RAM prompt cache): the engine was started so."""

    @property
    def finds_prefix_in_ram(self) -> bool:
        """An attached llama-server brings a prompt back from its RAM prompt cache into a
        slot that held another, once that slot is vacated (`Serving.finds_prefix_in_ram`)."""

    def free_slot_ids(self) -> list[int]:
        """The slot ids free now, the lowest first."""

    def prefill_seconds(self, tokens: int) -> float | None:
        """Seconds it would take to compute a fresh prompt of `tokens`, from its speed
        measured after its load; None: not measured."""


E = TypeVar("E", bound=SeatEngine)


@dataclass(frozen=True, slots=True)
class Seat(Generic[E]):
    """A slot of one engine.  `slot` None: admitted beyond the slots (admission off)."""

    engine: E
    slot: int | None
    #: The slot id goes to the engine as the request's `id_slot`.
    pinned: bool = False
    #: Prompt tokens the placement expects the engine's cache to hold for the request
    #: (not charged to its flow's fair share).
    cached: int = 0
    #: What the slot holds goes to the engine's RAM prompt cache before the request is
    #: sent (the session steward's `vacate`), so that the pinned request loads its own
    #: prefix from there: an attached llama-server at its default slot similarity would
    #: otherwise reuse another session's prompt in place, from the shared head on.
    vacate: bool = False


def keeps_slots(engine: SeatEngine) -> bool:
    """Does the engine keep each slot's prompt in the slot (a split cache)?  Then the slot
    a turn ran on holds its session's prefix after it (`Sessions.turn_ended`)."""
    kv = engine.kv
    return kv is not None and not kv.unified


# --- helpers ---------------------------------------------------------------------------


def unpinned(engine: E, *, pin_fresh: bool = True, pinnable: bool = True,
              sessions: Sessions | None = None, returning: bool = False) -> Seat[E]:
    """The seat llama-server would choose by itself; pinned there when the engine was
    started to keep prefixes and that slot has held a prompt (the port's books then hold
    for sure: requests ending at once may release their slots in another order there),
    and the request takes a pin.

    On an attached llama-server that finds prefixes in its RAM cache (at its default
    slot similarity, which reuses in place any slot whose prompt shares the head), every
    pinnable request is pinned: a session `returning` to the engine, whose prefix its
    RAM cache holds, to the least recently used free slot, vacated first (`Seat.vacate`);
    any other to a free slot where no session's prefix lives, a never used one first
    (`_free_of_sessions`), else that least recently used one, not vacated (a new prompt
    pinned to a vacated slot would take the RAM cache entry of the session sharing most
    of its head, and that session would compute its prompt again).  A request the engine
    cannot pin goes to the least recently used free slot, every idle slot vacated first
    (see below)."""
    seat = engine.least_recent_free_seat()
    if engine.finds_prefix_in_ram and not engine.pin_any_slot and seat.slot is not None:
        if returning or not pinnable:
            # A turn the engine cannot pin takes the idle slot most like its prompt (any
            # sharing the head) in place, or else the least recently used one, loaded
            # from the RAM cache: every idle slot is vacated first, the seat's first, so
            # it lands on the seat and loads its own prefix (a new session, the RAM entry
            # sharing most of its head), and the books say where it is.
            return Seat(engine, seat.slot, pinned=True, vacate=True)
        empty = _free_of_sessions(engine, sessions)
        return Seat(engine, seat.slot if empty is None else empty, pinned=True)
    if pinnable and seat.slot is not None and (engine.pin_any_slot
                                  or (pin_fresh and not engine.slot_used(seat.slot))):
        # A slot never used is pinned too: requests that reach the engine in another
        # order than they were admitted here (two agents' first turns on a fresh engine)
        # would otherwise take each other's empty slots there, and each next turn, sent
        # to the slot the table names, would find the other's prompt (seen in
        # test_sessions_engines, 1 run in 3).  An empty slot skips the RAM cache when
        # pinned: a new session there computes its whole first prompt, once per slot.
        return Seat(engine, seat.slot, pinned=True)
    return seat


def seat_on(engine: E, session: Session | None, need: TokenNeed | None,
             sessions: Sessions, pinnable: bool = True) -> Seat[E]:
    """`engine` holds the session's prefix (or one of its flow's): its slot, pinned,
    when that slot still holds it and is free, else where the engine would put it.

    A request the engine cannot pin, on an engine that keeps prefixes (slot similarity
    1: it never picks a slot by its prompt), goes to the least recently used free slot,
    whatever that holds, and finds its prefix in the RAM prompt cache: the session
    steward moves it there from its slot first (`backend.app.pool.parking_steward`)."""
    if not keeps_slots(engine):
        seat = engine.lowest_free_seat()
    elif not pinnable and engine.pin_any_slot:
        seat = engine.least_recent_free_seat()
    elif (session is not None and session.slot is not None and engine.slot_free(session.slot)
            and sessions.holder(engine.key, session.slot) is session):
        seat = Seat(engine, session.slot, pinned=True)
    else:
        # Not a fresh slot for a session whose prefix is here: unpinned, the engine may
        # still find it in its RAM cache.
        seat = unpinned(engine, pin_fresh=session is None, pinnable=pinnable,
                         sessions=sessions, returning=session is not None)
    if session is None or not session.prompt_tokens:
        return seat
    prompt = session.prompt_tokens if need is None else min(need.prompt, session.prompt_tokens)
    return Seat(engine, seat.slot, seat.pinned, prompt, seat.vacate)


def _free_of_sessions(engine: SeatEngine, sessions: Sessions | None) -> int | None:
    """A free slot of `engine` that holds no session's prefix, as the book says: a never
    used one first (the lowest id), else one no session holds; None: every free slot
    holds one."""
    unheld: int | None = None
    for slot in engine.free_slot_ids():
        if not engine.slot_used(slot):
            return slot
        if unheld is None and (sessions is None or sessions.holder(engine.key, slot) is None):
            unheld = slot
    return unheld
