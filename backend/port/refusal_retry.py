"""A ticket's wait for its turn after the load it was admitted on refused the connection.

The load may still count as ready (its end not noticed yet, or an attached server that
refuses): after a short backoff, doubled per try, its queue is asked to admit again, so
a load that keeps refusing fails after MAX_REQUEUES tries instead of at the queue
timeout (`Exchange._admitted` in `backend.port.relay`).
"""

from __future__ import annotations

import asyncio

from backend.admission.admission_ticket import Ticket

__all__ = ["REFUSAL_BACKOFF", "refusal_backoff", "wait_turn"]

#: First wait before a load that refused a connection is tried again (then doubled per
#: try: 0.05 + 0.1 + ... + 0.8 s = 1.55 s over MAX_REQUEUES tries).  A killed engine is
#: noticed within milliseconds and its waiters then wait for the restarted load instead.
REFUSAL_BACKOFF = 0.05


async def wait_turn(ticket: Ticket, timeout: float | None) -> None:
    """`ticket.wait`; after a refusal, its queue asked to admit again past the backoff."""
    if ticket.requeues == 0:
        await ticket.wait(timeout)
        return
    waiting = asyncio.ensure_future(ticket.wait(timeout))
    try:
        done, _ = await asyncio.wait((waiting,), timeout=refusal_backoff(ticket))
        if not done:
            ticket.line.admit_waiting()
        await waiting
    finally:
        if not waiting.done():
            waiting.cancel()


def refusal_backoff(ticket: Ticket) -> float:
    """The backoff before `ticket`'s next try: REFUSAL_BACKOFF doubled per refusal."""
    return float(REFUSAL_BACKOFF * 2 ** (ticket.requeues - 1))
