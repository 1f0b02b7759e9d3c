"""What of the engine's prompt cache a named key may be told (`own_prefix`): only the hits
on what its own session's earlier turn left in the very slot it runs on.  A named key's
answers otherwise tell nothing of the cache all keys share (`sse.without_cache_figures`):
what it held for a prompt would tell how much of another key's prompt a guess matches."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.admission.admission_ticket import Ticket
    from backend.admission.session_book import Sessions
    from backend.port.gated_request import GatedRequest

__all__ = ["own_prefix"]


def own_prefix(sessions: Sessions, request: GatedRequest, ticket: Ticket) -> int:
    """Of what the engine's cache holds for `request`, what its key may be told: the
    prompt tokens of its own session's turn (sessions are scoped to their key) that it
    continues, when that turn's prefix is in the very slot it runs on (pinned there,
    held since: the cache's hits are then its own, and at most that prompt is told);
    else 0 (the hits may be any key's)."""
    session, seat = request.hint.session, ticket.seat
    place = sessions.where(session)
    if (place is None or seat is None or not seat.pinned or seat.slot is None
            or place.engine != ticket.serving.key or place.slot != seat.slot):
        return 0
    earlier = sessions.continuation(session, request.model_id or "", request.blocks)
    return earlier.prompt_tokens if earlier is not None else 0
