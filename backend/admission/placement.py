"""Which engine, and which of its slots, a ticket is admitted on.

`Line` (`backend.admission.admission`) decides *who* goes next; a `Placement` decides *where*:
`place(ticket, engines)` gets the engines that serve the ticket's model and may take it
now (the one a requeue excludes is left out) and answers a `Seat` (an engine and one of
its free slot ids), or None to keep the ticket waiting.  A policy is pure: it reads the
engines' free slots and room and the ticket's need and `Hint`, and changes nothing.

`MostFreeSlots` is the default and today's rule: the need fits; the engine with the most
free slots (spreading the load); its lowest free slot id.  The slot id travels to the
engine (`id_slot`) only when a policy sets `Seat.pinned`: pinning an empty slot skips
llama-server's RAM prompt cache, so nothing pins by default.

A `Hint` is what the request says about itself beside its need, kept without its parsed
body: its session (a client's `prompt_cache_key`, or a session header, scoped to its
flow so that no caller can name another's session) and a digest of its prompt's first
blocks (see `request_hint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

from backend.llama.kv_capacity import TokenNeed

__all__ = ["NO_HINT", "PREFIX_BLOCK_CHARS", "PREFIX_BLOCKS", "SESSION_HEADERS", "Hint",
           "MostFreeSlots", "Placeable", "Placement", "Seat", "SeatEngine", "request_hint"]

#: Characters of prompt text per block of the prefix digest.
PREFIX_BLOCK_CHARS = 1024
#: Blocks of the prompt's beginning the digest covers (the first few KB).
PREFIX_BLOCKS = 4
#: Headers that name a client's session, in order of preference (lower case).
SESSION_HEADERS = (b"x-session-affinity", b"x-session-id", b"session_id", b"session-id",
                   b"x-claude-code-session-id")


class SeatEngine(Protocol):
    """One engine as placement reads it."""

    @property
    def free_slots(self) -> int: ...

    def has_room(self, need: TokenNeed | None) -> bool:
        """A free slot (or admission off), and room for `need`."""

    def lowest_free_slot(self) -> int | None:
        """The lowest slot id free now; None when none is (admission off, all taken)."""

    def lowest_free_seat(self) -> Seat[Self]:
        """The (unpinned) seat of `lowest_free_slot`, kept ready: no allocation."""

    def slot_free(self, slot: int) -> bool:
        """Is slot id `slot` one of the engine's and free now?"""


E = TypeVar("E", bound=SeatEngine)


@dataclass(frozen=True, slots=True)
class Seat(Generic[E]):
    """A slot of one engine.  `slot` None: admitted beyond the slots (admission off)."""

    engine: E
    slot: int | None
    #: The slot id goes to the engine as the request's `id_slot`.
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Hint:
    """What a request says about itself beside its need."""

    #: Its session, scoped to its flow ("flow\\nkey"); None: it names none.
    session: str | None = None
    #: Chained hashes of the prompt text's first blocks (each names the whole prefix up
    #: to its block's end); only meaningful within this process.
    prefix: tuple[int, ...] = ()


NO_HINT = Hint()


class Placeable(Protocol):
    """What a policy reads of the ticket it places."""

    @property
    def need(self) -> TokenNeed | None: ...

    @property
    def hint(self) -> Hint: ...


class Placement(Protocol):
    """Where a ticket is admitted: a pure decision over the engines that may take it."""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        """A seat for `ticket` on one of `engines` (those serving its model, in the order
        they joined), or None: it waits."""


class MostFreeSlots:
    """The need fits; the engine with the most free slots; its lowest free slot id."""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        need = ticket.need
        if len(engines) == 1:  # the common case: one engine serves the model
            only = engines[0]
            return only.lowest_free_seat() if only.has_room(need) else None
        best: E | None = None
        for engine in engines:
            if engine.has_room(need) and (best is None or engine.free_slots > best.free_slots):
                best = engine
        return None if best is None else best.lowest_free_seat()

    def __repr__(self) -> str:
        return "MostFreeSlots()"


def request_hint(flow: str, headers: Iterable[tuple[bytes, bytes]],
                 data: Mapping[str, Any]) -> Hint:
    """The hint of a request from flow `flow` with these headers and parsed body."""
    session = data.get("prompt_cache_key")
    if not isinstance(session, str) or not session:
        session = _session_header(headers)
    prefix = _prefix_digest(data)
    if session is None and not prefix:
        return NO_HINT
    return Hint(None if session is None else f"{flow}\n{session}", prefix)


# --- helpers ---------------------------------------------------------------------------

def _session_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered in SESSION_HEADERS and value:
            found.setdefault(lowered, value)
    for name in SESSION_HEADERS:
        if name in found:
            return found[name].decode("latin-1")
    return None


def _prefix_digest(data: Mapping[str, Any]) -> tuple[int, ...]:
    """Chained hashes of `PREFIX_BLOCK_CHARS`-character blocks of the prompt text's
    first `PREFIX_BLOCKS` blocks (a short last block counts too)."""
    limit = PREFIX_BLOCK_CHARS * PREFIX_BLOCKS
    parts: list[str] = []
    size = 0
    for text in _prompt_texts(data):
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    if not size:
        return ()
    text = "".join(parts)[:limit]
    digest: list[int] = []
    chained = 0
    for start in range(0, len(text), PREFIX_BLOCK_CHARS):
        chained = hash((chained, text[start:start + PREFIX_BLOCK_CHARS]))
        digest.append(chained)
    return tuple(digest)


def _prompt_texts(data: Mapping[str, Any]) -> Iterable[str]:
    """The prompt's text in order: system, then each message's role and content (chat,
    messages, responses), or the completion's prompt; stops being read where the caller
    stops."""
    system = data.get("system", data.get("instructions"))
    if system is not None:
        yield from _texts(system)
    messages = data.get("messages", data.get("input", data.get("prompt")))
    if isinstance(messages, str):
        yield messages
        return
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                role = message.get("role")
                if isinstance(role, str):
                    yield f"\x1e{role}\x1f"
                yield from _texts(message.get("content"))
            else:
                yield from _texts(message)


def _texts(content: Any) -> Iterable[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]
