"""The Sessions view's rows: each live session as people read it, made from the session
book's figures and places (`backend.admission.session_book`)."""

from __future__ import annotations

import ipaddress
from collections.abc import Container, Iterable
from dataclasses import dataclass

from backend.admission.caller import ADDRESS_FLOW
from backend.admission.session_book import Session, SessionCache

__all__ = ["PARKED", "THIS_COMPUTER", "SessionRow", "session_label", "session_rows"]

#: The owner of a session sent from this machine without a key (a `SessionRow`'s owner).
THIS_COMPUTER = "this computer (owner)"
#: Where a session's prefix lives when it is saved on disk, on no engine (a `SessionRow`).
PARKED = "parked"


@dataclass(frozen=True, slots=True)
class SessionRow:
    """One live session as a view shows it."""

    #: Whose it is, as people know them: its key's name ("owner" for the owner's key);
    #: without named keys "this computer (owner)" for a request from this machine, else
    #: "computer at ADDRESS"; "anonymous" when nothing is known.
    owner: str
    #: The client's name for it, or "unnamed #…" (named after its start), as the Requests
    #: tab names it (`session_label`); "N single requests (unnamed)": one row for the
    #: unnamed sessions of one turn of an owner and model (one-shot requests).
    name: str
    model: str
    turns: int
    hit_percent: float  #: of its prompt tokens, the share found cached
    #: Where its prefix lives: "this machine, slot 1", "upstream 2", "parked", "nowhere".
    where: str
    last_miss: str  #: its last miss and why ("" when it never missed past its first turn)
    idle_seconds: float  #: since its last turn


def session_rows(book: Iterable[SessionCache], table: Iterable[Session] = (), *,
                 now: float, serving: Container[str] | None = None,
                 parked: Container[str] = ()) -> tuple[SessionRow, ...]:
    """Rows for the sessions in `book` (most recent first): where each prefix lives from
    the session book's places (`backend.admission.session_book`) when it knows the session, else
    where its last turn ran; `now` on the book's clock.  `serving`: the admission keys of
    the engines that serve now (None: all the table names), a table's place on any other
    engine is gone with it; `parked`: the sessions whose prefix is parked on disk
    (`backend.app.pool.parking_steward`), "parked" when no serving engine holds it."""
    places = {s.key: s for s in table}
    rows = []
    singles: dict[tuple[str, str], list[SessionCache]] = {}
    for summary in book:
        owner, _, name = summary.session.partition("\n")
        if name.startswith("#") and summary.turns <= 1:
            singles.setdefault((owner, summary.model), []).append(summary)
            continue
        place = places.get(summary.session)
        if place is None:
            where = _place(summary.engine, summary.slot)
        elif place.engine is not None and (serving is None or place.engine in serving):
            where = _place(place.label, place.slot)
        else:
            where = PARKED if summary.session in parked else _place("", None)
        miss = summary.last_miss
        rows.append(SessionRow(_owner(owner), session_label(name), summary.model, summary.turns,
                               round(summary.hit_percent, 1), where,
                               miss.describe() if miss is not None and miss.reason != "first_turn"
                               else "", max(0.0, now - summary.at)))
    for (owner, model), group in singles.items():
        cached = sum(s.cached for s in group)
        total = cached + sum(s.computed for s in group)
        rows.append(SessionRow(
            _owner(owner), f"{len(group)} single request{'s' if len(group) != 1 else ''} "
            "(unnamed)", model, len(group), round(100.0 * cached / total, 1) if total else 0.0,
            "—", "", max(0.0, now - max(s.at for s in group))))
    return tuple(rows)


def session_label(name: str) -> str:
    """A session as every view names it: the client's own name, or "unnamed #…" for one
    named after its start (the request inspector's records keep "#…")."""
    return f"unnamed {name}" if name.startswith("#") else name


def _owner(flow: str) -> str:
    """A flow as people know it: a flow named after a client's address (no named keys)
    is this computer's owner when the address is this machine's own loopback."""
    if not flow:
        return "anonymous"
    if not flow.startswith(ADDRESS_FLOW):
        return flow
    address = flow[len(ADDRESS_FLOW):]
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # no address known ("unknown")
        return f"computer at {address}"
    mapped = getattr(ip, "ipv4_mapped", None)  # "::ffff:127.0.0.1" on a dual-stack port
    return THIS_COMPUTER if ip.is_loopback or (mapped is not None and mapped.is_loopback) \
        else f"computer at {address}"


def _place(label: str, slot: int | None) -> str:
    if not label:
        return "nowhere"
    return label if slot is None else f"{label}, slot {slot}"
