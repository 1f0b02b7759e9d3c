"""Helpers shared by the admission tests: backend keys, a fake clock, a started waiter."""

from __future__ import annotations

import asyncio
from typing import Any

from backend.admission.seat import Seat, keeps_slots
from backend.admission.prompt import NO_BLOCKS
from backend.admission.session_book import Sessions
from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.admission_ticket import Ticket

OLD = "http://127.0.0.1:41001"
NEW = "http://127.0.0.1:41002"
NEWER = "http://127.0.0.1:41003"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def started(ticket: Ticket, timeout: float | None = None) -> asyncio.Task[None]:
    """A task awaiting `ticket`, already suspended inside wait().

    One turn of the loop runs a new task up to its first await; this is ordering,
    not a timed sleep.
    """
    task = asyncio.create_task(ticket.wait(timeout))
    await asyncio.sleep(0)
    assert not task.done()
    return task


def queue_of(capacity: int = 1, max_waiting: int = 0, *, kv: KvCapacity | None = None,
             **kwargs) -> AdmissionQueue:
    return AdmissionQueue(Serving(OLD, capacity, kv=kv), max_waiting=max_waiting, **kwargs)


def kv_queue_of(slots: int, kv: KvCapacity, max_waiting: int = 0) -> AdmissionQueue:
    return AdmissionQueue(Serving(OLD, slots, kv=kv), max_waiting=max_waiting)


def told_served(sessions: Sessions, session: str | None, flow: str, prefix: tuple[int, ...],
                seat: Seat[Any] | None, label: str, prompt: int, cached: int = 0) -> None:
    """Settlement's part: the session book is told where an answer left its session's
    prefix (`Sessions.turn_ended`), its prompt's tokens and those its engine's cache held."""
    if seat is None:
        return
    sessions.turn_ended(session, flow, model="m", prefix=prefix, blocks=NO_BLOCKS,
                        engine=seat.engine.key, label=label, slot=seat.slot,
                        pinned=seat.pinned, keeps_slot=keeps_slots(seat.engine),
                        prompt=(prompt, cached), cache=None, engine_alive=lambda key: True)
