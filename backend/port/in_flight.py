"""The requests under way, as the inspector shows them before they end (`in_flight_record`).

A request leaves its record in the inspector's ring when it ends (`backend.port.settlement`);
while it waits or its engine reads a long prompt, which on a CPU takes minutes, the
inspector (`RequestLog.in_flight`, `GET /requests`' `in_flight`) and the window's Requests
tab show it from this: where it stands, how long it has waited and why, and how far its
prompt is read, with the time left at the engine's speed so far (`backend.port.prefill`).
Names and numbers only, as in every record.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from backend.port.request_log import RequestRecord

if TYPE_CHECKING:
    from backend.admission.admission_ticket import Ticket
    from backend.port.gated_request import GatedRequest
    from backend.port.stream_relay import StreamRelay

__all__ = ["InFlight", "UNDER_WAY", "in_flight_record"]

#: A record's status while its request is under way.
UNDER_WAY = 0


class InFlight(Protocol):
    """What the inspector reads of a request under way (`backend.port.relay.Exchange`)."""

    @property
    def request(self) -> GatedRequest: ...

    @property
    def ticket(self) -> Ticket | None: ...

    @property
    def stream(self) -> StreamRelay: ...


def in_flight_record(exchange: InFlight, now: float | None = None) -> RequestRecord:
    """The record of a request under way: id 0 and status 0 (`UNDER_WAY`)."""
    now = time.monotonic() if now is None else now
    request = exchange.request
    ticket = exchange.ticket
    seat = ticket.seat if ticket is not None else None
    arrived = request.arrived or now
    ran_at = ticket.admitted_at if ticket is not None else None
    progress = exchange.stream.progress
    session = request.hint.session
    return RequestRecord(
        id=0, time=time.time() - (now - arrived), route=request.path,
        key=request.passage.caller.name,
        session=None if session is None else session.split("\n", 1)[-1],
        model=request.model_id, engine=seat.engine.label if seat is not None else None,
        slot=seat.slot if seat is not None else None, stream=request.parsed.stream,
        wait=(ran_at if ran_at is not None else now) - arrived,
        wait_reason=ticket.wait_reason if ticket is not None else None,
        prompt_tokens=progress.total if progress is not None else None,
        prefilled=progress.processed if progress is not None else None,
        prefill_eta=progress.eta(now) if progress is not None and exchange.stream.first_at is None
        else None,
        status=UNDER_WAY)
