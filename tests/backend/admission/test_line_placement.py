"""The line's placement: swapping the policy changes where tickets go, nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.flow import Flow
from backend.admission.hint import Hint
from backend.admission.placement import Placeable, Placement
from backend.admission.seat import Seat, SeatEngine
from tests.backend.admission_helpers import NEW, OLD
from tests.not_none import not_none

E = TypeVar("E", bound=SeatEngine)


class LastEngine(Placement):
    """A test policy: always the last engine that has room."""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        for engine in reversed(engines):
            if engine.has_room(ticket.need):
                return engine.lowest_free_seat()
        return None


class SeatTheHintNames(Placement):
    """A test policy: a session's requests go to the slot named for it, pinned, and wait
    while it is taken; the rest as the default would place them, unpinned."""

    def __init__(self, seats: dict[str, tuple[int, int]]) -> None:
        self.seats = seats  # session -> (engine index, slot id)

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        named = self.seats.get(ticket.hint.session or "")
        if named is None:
            best = max(engines, key=lambda e: e.free_slots)
            return best.lowest_free_seat() if best.has_room(ticket.need) else None
        index, slot = named
        if index >= len(engines):
            return None
        engine = engines[index]
        if not (engine.slot_free(slot) and engine.has_room(ticket.need)):
            return None
        return Seat(engine, slot, pinned=True)


def two_engines(line: Line) -> tuple[AdmissionQueue, AdmissionQueue]:
    return (AdmissionQueue(Serving(OLD, 2), line=line),
            AdmissionQueue(Serving(NEW, 2), line=line))


def test_by_default_requests_spread_over_the_engines_with_the_most_free_slots():
    line: Line[AdmissionQueue] = Line("m")
    first, second = two_engines(line)
    engines = [not_none(line.request().seat).engine for _ in range(4)]
    assert engines == [first, second, first, second]


def test_the_policy_always_the_last_engine_sends_every_request_there_first():
    line: Line[AdmissionQueue] = Line("m", placement=LastEngine())
    first, second = two_engines(line)
    engines = [not_none(line.request().seat).engine for _ in range(4)]
    assert engines == [second, second, first, first]
    assert line.fits_now(None) is False and line.request().admitted is False


def test_the_policy_seat_the_hint_names_pins_a_session_to_its_slot_and_waits_for_it():
    line: Line[AdmissionQueue] = Line("m", placement=SeatTheHintNames({"flow\nagent": (1, 1)}))
    first, second = two_engines(line)
    agent = Hint(session="flow\nagent")

    pinned = line.request(hint=agent)
    assert not_none(pinned.seat) == Seat(second, 1, pinned=True)
    other = line.request()  # no hint: the engine with the most free slots
    assert not_none(other.seat) == Seat(first, 0)

    again = line.request(hint=agent)  # its slot is taken: it waits, others pass it
    assert not again.admitted and not line.fits_now(None, agent)
    passer = line.request(flow=Flow("other"))
    assert passer.admitted and not_none(passer.seat).engine is first
    pinned.release()
    assert again.admitted and not_none(again.seat) == Seat(second, 1, pinned=True)
    assert second.lowest_free_slot() == 0


def test_a_need_that_does_not_fit_is_never_placed_by_the_default():
    line: Line[AdmissionQueue] = Line("m")
    small = AdmissionQueue(Serving(OLD, 4, kv=KvCapacity.shared(1_000)), line=line)
    big = AdmissionQueue(Serving(NEW, 1, kv=KvCapacity.shared(8_000)), line=line)
    ticket = line.request(TokenNeed(3_000, 500))
    assert not_none(ticket.seat) == Seat(big, 0)
    assert small.active == 0


def test_a_pools_needs_are_counted_by_a_llama_server_not_by_another_gguf_studio_port():
    line: Line[AdmissionQueue] = Line("m")
    kv = KvCapacity.split(2 * 4_096, 2)
    port = AdmissionQueue(Serving(OLD, 2, kv=kv, takes_slot_ids=False), line=line)
    assert line.planning_engine is port  # the only one
    engine = AdmissionQueue(Serving(NEW, 2, kv=kv), line=line)
    # Joined later with the same room: it counts prompts (a port has no counting routes,
    # and its byte estimate refused a long prompt that fits as too long for the context).
    assert line.planning_engine is engine
    bigger = AdmissionQueue(Serving("http://127.0.0.1:41003", 2, kv=KvCapacity.split(2 * 8_192, 2),
                                    takes_slot_ids=False), line=line)
    assert line.planning_engine is bigger  # the largest need still decides first
