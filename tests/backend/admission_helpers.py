"""Helpers shared by the admission tests: backend keys, a fake clock, a started waiter."""

from __future__ import annotations

import asyncio

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
