"""`HashRing`: each session on the engine its key falls to on a consistent-hash ring of
the engines (vLLM's session router): no load, no wait bound, no prefix matching between
sessions; a session's slot on that engine as the session book says.  A second
`backend.admission.placement.Placement` of a few lines, chosen by name
(`serve --placement hash-ring`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from backend.admission.hint import Hint
from backend.admission.placement import Placeable, Placement, cached_in, most_free
from backend.admission.seat import E, Seat, seat_on
from backend.admission.session_book import Sessions

__all__ = ["HashRing"]


class HashRing(Placement):
    """Each session on the engine its key falls to on a consistent-hash ring of the
    engines (as vLLM's production-stack session router does): every engine at `points`
    places of the ring, a session at the first engine after its key's hash (Python's
    `hash()`, cached by the key itself: within one process, where engines' keys live too).  A session's
    turns go to one engine as long as the engines stay; an engine that joins or goes moves
    only the sessions of its arcs.  An engine not offered for a decision (a requeue skips
    one, the prefill budget holds a long prompt off one) is off the ring for it: the next
    one takes the turn.  Its engine full, a turn waits for it, whatever the others have
    (the line lets its flow's next turns pass it: `home_while_waiting`); a request with no
    session goes where `MostFreeSlots` puts it.  On its engine a turn takes the slot the
    session book says holds its prefix, as `KeepPrefixes` does; it knows nothing else."""

    name = "hash-ring"

    def __init__(self, sessions: Sessions | None = None, *, points: int = 64) -> None:
        self.sessions = sessions if sessions is not None else Sessions()
        self.points = points
        # The rings of the engine sets seen lately: (the points' hashes, their engines).
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        hint = ticket.hint
        if hint.session is None:
            best = most_free(ticket.need, engines)
            return None if best is None else best.lowest_free_seat()
        engine = self.engine_of(hint.session, engines)
        if not engine.has_room(ticket.need):
            return None
        session = self.sessions.where(hint.session)
        here = session is not None and session.engine == engine.key \
            and session.continued_by(hint.prefix)
        return seat_on(engine, session if here else None, ticket.need, self.sessions,
                        hint.pinnable)

    def engine_of(self, session: str, engines: Sequence[E]) -> E:
        """The engine of `engines` (not empty) that `session` falls to on their ring."""
        keys = tuple(engine.key for engine in engines)
        ring = self._rings.get(keys)
        if ring is None:  # a new set of engines: rare, O(points x engines)
            if len(self._rings) >= 16:
                self._rings.clear()
            points = sorted((_ring_point(key, n), key) for key in keys for n in range(self.points))
            ring = self._rings[keys] = ([h for h, _ in points], [key for _, key in points])
        hashes, owners = ring
        owner = owners[bisect.bisect(hashes, hash(session)) % len(owners)]
        return engines[keys.index(owner)]

    def home_while_waiting(self, ticket: Placeable, engines: Sequence[E]) -> E | None:
        session = ticket.hint.session
        if session is None or len(engines) < 2:
            return None
        need = ticket.need
        home = self.engine_of(session, engines)
        if home.has_room(need) or not any(e.has_room(need) for e in engines):
            return None
        return home

    def cached_tokens(self, hint: Hint, engine: object) -> int:
        return cached_in(self.sessions, hint, engine)

    def __repr__(self) -> str:
        return f"HashRing({self.points} points an engine)"


# --- helpers ---------------------------------------------------------------------------


def _ring_point(engine: str, n: int) -> int:
    """Where engine `engine`'s `n`th point sits on the ring: a digest, spread evenly over
    the range of `hash()` (Python's own hash of a tuple of a name and a counter is not:
    with 64 points of 3 engines one took 15 % of the sessions, another 53 %)."""
    digest = hashlib.blake2b(f"{engine}\x00{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
