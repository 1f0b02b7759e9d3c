"""A resend joins its twin (`Resends`): the same request again, after its client hung up.

Every coding agent has a watchdog on a silent stream and, when it fires, hangs up and
sends the same request again (bench/README.md, watchdogs: Claude Code resends the same
body at once, OpenCode after a backoff; Codex changes its body a little, so its resends
are new requests).  On a small box the first request's prompt may take minutes to read;
cut at the hang-up, the resend starts over at the back of the line, its kept prefix
exposed while it waits, and a client whose watchdog fires each time never finishes.

So a request whose client hangs up before its answer began (while it waits in line, or
the engine reads its prompt) is an orphan for `grace` seconds (`Settings.resend_grace`):
its exchange keeps its place in line and the engine its work, what it answers meanwhile
kept by its `backend.port.audience.Audience` (at most `ORPHAN_BYTES`).  A request of the
same key, session (header), route, model and body digest (`twin_key`) that comes meanwhile
joins it (`orphan`) instead of being admitted: it is sent the answer from where it
stands, and its usage is booked once, by the orphan.  With no resend, the work is cut
when the grace ends, as for any client that left.  An orphan whose answer ended before
anyone came leaves it here (`finished`) for another `grace` seconds, at most
`FINISHED_ANSWERS` of them and `FINISHED_BYTES` in all: a resend then gets it as it was,
never a second generation.  Requests whose client is still there never join: the same
request twice from a live client is asked twice (a burst of "Hello" is N answers).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from starlette.types import Message

from backend.admission.hint import SESSION_HEADERS
from backend.keys.key_store import CHAT_NAME

if TYPE_CHECKING:
    from backend.port.audience import Listener
    from backend.port.metrics import ModelCounts

__all__ = ["FINISHED_ANSWERS", "FINISHED_BYTES", "JOINED_FINISHED", "JOINED_RUNNING",
           "ORPHAN_BYTES", "FinishedAnswer", "Orphan", "Resends", "twin_key"]

#: The most of an orphan's answer kept while nobody listens (past it the work is cut: no
#: resend could get the whole answer).  An agent's answer of 8,000 tokens is about 2 MB
#: of stream events.
ORPHAN_BYTES = 4 * 1024 * 1024
#: Finished answers kept for a resend, at most, and their bytes in all.
FINISHED_ANSWERS = 16
FINISHED_BYTES = 16 * 1024 * 1024
#: What the inspector says of a request a resend joined (`RequestRecord.joined`).
JOINED_RUNNING = "a running request"
JOINED_FINISHED = "a finished answer"


class Orphan(Protocol):
    """A running request whose client left (`backend.port.relay.Exchange`)."""

    @property
    def metrics(self) -> ModelCounts: ...

    async def adopt(self, listener: Listener) -> bool:
        """`listener` takes its client's place; returns once it is served no more:
        True when it had the answer's end."""


@dataclass(frozen=True, slots=True)
class FinishedAnswer:
    """An orphan's whole answer, as its client would have had it."""

    messages: tuple[Message, ...]
    size: int
    #: Until when it is kept (`time.monotonic`).
    until: float


def twin_key(flow: str, path: str, model: str, headers: Iterable[tuple[bytes, bytes]],
             body: bytes) -> str:
    """What makes two requests twins: the same flow (its key), route, model, session
    headers and body (its SHA-256)."""
    digest = hashlib.sha256()
    for part in (flow, path, model):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    for name, value in sorted((name.lower(), value) for name, value in headers
                              if name.lower() in SESSION_HEADERS):
        digest.update(name + b"\0" + value + b"\0")
    digest.update(body)
    return digest.hexdigest()


class Resends:
    """The orphans of one port and the answers they finished, by twin key."""

    def __init__(self, grace: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._grace = grace  # read per orphan: the setting may change while the port runs
        self._clock = clock
        self._orphans: dict[str, Orphan] = {}
        self._finished: OrderedDict[str, FinishedAnswer] = OrderedDict()
        self._finished_bytes = 0

    @property
    def grace(self) -> float:
        return self._grace()

    def __bool__(self) -> bool:
        """Is anything there a resend could find (else its key is not worth computing)?"""
        return bool(self._orphans or self._finished)

    def orphaned(self, key: str, orphan: Orphan, caller: str) -> bool:
        """`orphan`'s client (`caller`) left: may a resend find it?  Not while another
        holds the same key, nor when the grace is 0, nor for the window's Chat tab, whose
        Stop means stop (the owner's next message must not wait for the grace)."""
        if self._grace() <= 0 or key in self._orphans or caller == CHAT_NAME:
            return False
        self._orphans[key] = orphan
        return True

    def claimed(self, key: str, orphan: Orphan) -> None:
        """`orphan` has a client again, or ended: no resend finds it any more."""
        if self._orphans.get(key) is orphan:
            del self._orphans[key]

    def orphan(self, key: str) -> Orphan | None:
        """The orphan of twin key `key`, taken (the resend joins it), if any."""
        return self._orphans.pop(key, None)

    def finished(self, key: str, messages: list[Message]) -> None:
        """An orphan's whole answer, nobody there: kept for a resend for `grace` seconds."""
        size = sum(len(message.get("body", b"")) for message in messages)
        if size > FINISHED_BYTES:
            return
        self._expire()
        old = self._finished.pop(key, None)
        if old is not None:
            self._finished_bytes -= old.size
        while self._finished and (len(self._finished) >= FINISHED_ANSWERS
                                  or self._finished_bytes + size > FINISHED_BYTES):
            _, dropped = self._finished.popitem(last=False)
            self._finished_bytes -= dropped.size
        self._finished[key] = FinishedAnswer(tuple(messages), size,
                                             self._clock() + self._grace())
        self._finished_bytes += size

    def answer(self, key: str) -> FinishedAnswer | None:
        """The finished answer of twin key `key`, taken (one resend gets it), if any."""
        self._expire()
        found = self._finished.pop(key, None)
        if found is not None:
            self._finished_bytes -= found.size
        return found

    def _expire(self) -> None:
        now = self._clock()
        for key in [key for key, kept in self._finished.items() if kept.until <= now]:
            self._finished_bytes -= self._finished.pop(key).size
