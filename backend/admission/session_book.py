"""Where each session's prompt prefix lives (the session table), what its last turns left
(the cache book), and its last request (what brings its prefix back from an engine's RAM
cache before a planned loss, `backend.app.parking`).

A *session* is one conversation of one caller: its key is scoped to the caller's flow
("flow\\nname", see `backend.admission.hint.request_hint`), so that no key can name,
steer into or read about another key's session.  After each answer the port records the
turn (`record`): which engine served it (its admission key, a new one for each process:
a restarted engine holds nothing) and its public label, the slot id it was pinned to
(None: the engine chose one itself, or kept it in its RAM prompt cache), the prompt's
tokens and how many of them the engine's cache held, and the chained digests of the
prompt's first blocks.  Placement asks where a session lives (`where`), which session
last showed a prefix (`match_prefix`), who holds a slot (`holder`) and how many sessions
live on an engine (`homed`); views read a `snapshot`.

A session's name may carry more than one conversation: OpenCode sends its title request,
and Claude Code its short side questions, with the headers of the agent's session.  A
turn whose prompt begins otherwise than the session's last one (its first block differs)
and is shorter is such a *side* turn: the session's place stays where its conversation
is (a side turn does not continue it, and the next agent turn pinned to the side turn's
slot would find the title there), and only the slot the side turn took is booked (whoever
held it no longer does).  A longer one is the session's conversation from then on: the
agent's turn that ends after its title request, or a client that began anew.

A slot holds one prompt at a time: a turn pinned to slot S of an engine takes S from
whichever session held it before (that one stays *on the engine*, slot None: llama-server
saved it to its RAM prompt cache when it gave the slot away, if the cache had room).
An engine that goes away (`forget_engine`) leaves its sessions homeless.

Bounded: at most `max_sessions` sessions, and of them at most `max_per_flow` of one flow
(a quarter by default: `backend.admission.flow_shares`).  Past its share a flow's own least
recently served session goes; past the table's bound, the least recently served of the
flow holding the most: one key making a session per request never pushes out another's.
Pure: no I/O, no clock of its own beyond the one given, no locks (the backend's one
asyncio loop owns it).  Every operation is O(1) except `resident` and `forget_engine`
(O(sessions)), `snapshot` (O(n log n)) and a session dropped past the bound (O(flows)).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from backend.admission.cache_misses import TurnRecord, Verdict, judge
from backend.admission.flow_shares import FlowShares
from backend.admission.prompt import PromptBlocks
from backend.llama.slot_parking import ParkKey

__all__ = ["CONVERSATIONS", "DEFAULT_MAX_SESSIONS", "REMEMBERED_BYTES", "CacheBook", "LastRequests",
           "Session", "SessionCache", "SessionRequest", "SessionTable"]

#: Sessions kept: enough for every agent of a shared box, small (a few hundred bytes each).
DEFAULT_MAX_SESSIONS = 4096
#: Conversations followed apart within one session (an agent's turns, its title request).
CONVERSATIONS = 4
#: Bytes of sessions' last requests kept to bring their prefixes back from an engine's
#: RAM prompt cache before it goes (the least recently answered dropped first), a
#: quarter of it at most one key's: an agent's 30k-token request is about 120 KiB, so a
#: few hundred sessions, and a hundred of one key.
REMEMBERED_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Session:
    """One session as its last turn left it."""

    #: Its key, scoped to its flow ("flow\\nname").
    key: str
    #: Whose session it is (a key's id, or a client address without named keys).
    flow: str
    #: The admission key of the engine whose cache holds its prefix; None: nowhere known.
    engine: str | None
    #: That engine's public name ("this machine", "upstream N"); "" when none.
    label: str
    #: The slot id holding its prefix, when the engine was told it (pinned); None: a
    #: slot the engine chose, or its RAM prompt cache.
    slot: int | None
    #: Chained digests of its prompt's first blocks (see `request_hint`).
    prefix: tuple[int, ...]
    #: Its last turn's prompt tokens, and how many of them the engine's cache held.
    prompt_tokens: int
    cached_tokens: int
    #: Turns served.
    turns: int
    #: When its last turn was recorded (the table's clock).
    last_turn: float

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens its last turn computed (not found in the cache)."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def resident(self) -> bool:
        """Its prefix is on some engine (in a slot, or that engine's RAM cache)."""
        return self.engine is not None

    def continued_by(self, prefix: tuple[int, ...]) -> bool:
        """Does a prompt with these block digests begin as its last one did (the same
        conversation, or nothing known to tell them apart)?"""
        return not prefix or not self.prefix or prefix[0] == self.prefix[0]


class SessionTable:
    """Sessions by key, least recently served first; which slot each holds."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, *,
                 max_per_flow: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`max_per_flow`: the sessions one flow may hold (None: a quarter of the table)."""
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise ValueError(f"max_sessions is a whole number, at least 1, not {max_sessions!r}")
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # Which sessions go when a flow or the table is full.
        self._shares: FlowShares[str] = FlowShares(max_sessions, max_per_flow)
        # (engine, slot) -> the session key holding it.
        self._slots: dict[tuple[str, int], str] = {}
        # A prefix block's digest -> the session that last showed it.
        self._prefixes: dict[int, str] = {}
        # Engine -> how many sessions' prefixes live there.
        self._homed: Counter[str] = Counter()

    # --- questions -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: object) -> bool:
        return key in self._sessions

    def __iter__(self) -> Iterator[Session]:
        """Least recently served first."""
        return iter(list(self._sessions.values()))

    def where(self, key: str | None) -> Session | None:
        """Session `key` as its last turn left it; None when unknown (or `key` is None)."""
        return None if key is None else self._sessions.get(key)

    def holder(self, engine: str, slot: int) -> Session | None:
        """The session whose prefix slot `slot` of `engine` holds, if one is known."""
        key = self._slots.get((engine, slot))
        return None if key is None else self._sessions.get(key)

    def match_prefix(self, flow: str, prefix: tuple[int, ...]) -> tuple[Session, int] | None:
        """The session of `flow` that last showed the longest start of `prefix`, and how
        many blocks of it match; None when no block does.  Only `flow`'s own sessions."""
        for blocks in range(len(prefix), 0, -1):
            key = self._prefixes.get(prefix[blocks - 1])
            if key is None:
                continue
            session = self._sessions.get(key)
            if (session is not None and session.flow == flow
                    and session.prefix[:blocks] == prefix[:blocks]):
                return session, blocks
        return None

    def homed(self, engine: str) -> int:
        """How many sessions' prefixes live on `engine` (O(1))."""
        return self._homed[engine]

    def resident(self, engine: str) -> list[Session]:
        """The sessions whose prefix lives on `engine`, least recently served first."""
        return [s for s in self._sessions.values() if s.engine == engine]

    def flows(self) -> list[str]:
        """The flows holding any session."""
        return self._shares.flows()

    def snapshot(self) -> tuple[Session, ...]:
        """Every session, most recently served first (for views and metrics)."""
        return tuple(sorted(self._sessions.values(), key=_by_last_turn, reverse=True))

    # --- changes ---------------------------------------------------------------------

    def record(self, key: str, *, flow: str, engine: str | None, label: str = "",
               slot: int | None = None, prompt_tokens: int = 0, cached_tokens: int = 0,
               prefix: tuple[int, ...] = ()) -> Session:
        """A turn of session `key` was served on `engine` (pinned to `slot`, or not):
        its prefix lives there now.  The slot is taken from any other session.  A side
        turn (see the module's doc) leaves the session where it was, and takes the slot."""
        old = self._sessions.get(key)
        if old is not None and not old.continued_by(prefix) and prompt_tokens < old.prompt_tokens:
            return self._aside(old, engine, slot)
        old = self._sessions.pop(key, None)
        if old is not None:
            self._unslot(old)
            self._unhome(old)
        if engine is not None:
            self._homed[engine] += 1
        if engine is not None and slot is not None:
            previous = self._slots.get((engine, slot))
            if previous is not None and previous != key:
                displaced = self._sessions.get(previous)
                if displaced is not None:  # still on the engine: its RAM cache keeps it
                    self._sessions[previous] = replace(displaced, slot=None)
            self._slots[(engine, slot)] = key
        session = Session(key=key, flow=flow, engine=engine, label=label,
                          slot=slot if engine is not None else None, prefix=prefix,
                          prompt_tokens=max(0, prompt_tokens),
                          cached_tokens=max(0, min(cached_tokens, prompt_tokens)),
                          turns=1 if old is None else old.turns + 1,
                          last_turn=self._clock())
        self._sessions[key] = session
        for digest in prefix:
            self._prefixes[digest] = key
        for dropped in self._shares.put(flow, key):
            self._drop(dropped)
        return session

    def forget(self, key: str) -> Session | None:
        """Drop session `key` (its key was revoked); what it was."""
        self._shares.discard(key)
        return self._drop(key)

    def forget_flow(self, flow: str) -> int:
        """Drop every session of `flow`; how many."""
        keys = list(self._shares.keys_of(flow))
        for key in keys:
            self.forget(key)
        return len(keys)

    def forget_engine(self, engine: str) -> list[Session]:
        """`engine` went away with its cache: its sessions live nowhere now; which."""
        moved: list[Session] = []
        for key, session in list(self._sessions.items()):
            if session.engine == engine:
                self._unslot(session)
                self._sessions[key] = replace(session, engine=None, label="", slot=None)
                moved.append(session)
        self._homed.pop(engine, None)
        return moved

    def vacate(self, engine: str, slot: int) -> Session | None:
        """Slot `slot` of `engine` no longer holds what it held (the engine chose it for
        another prompt, or it was cleared); the session that held it, now slot None."""
        key = self._slots.pop((engine, slot), None)
        session = None if key is None else self._sessions.get(key)
        if session is None:
            return None
        self._sessions[session.key] = replace(session, slot=None)
        return session

    # --- helpers ---------------------------------------------------------------------

    def _aside(self, session: Session, engine: str | None, slot: int | None) -> Session:
        """A side turn of `session` ran on `slot` of `engine`: that slot holds its prompt
        now, not whatever it held; the session stays where its conversation is."""
        if engine is not None and slot is not None:
            self.vacate(engine, slot)
        session = replace(self._sessions[session.key], last_turn=self._clock())
        self._sessions[session.key] = session
        self._sessions.move_to_end(session.key)
        self._shares.touch(session.key)
        return session

    def _drop(self, key: str) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._unslot(session)
            self._unhome(session)
            self._unprefix(session)
        return session

    def _unslot(self, session: Session) -> None:
        if session.engine is not None and session.slot is not None:
            place = (session.engine, session.slot)
            if self._slots.get(place) == session.key:
                del self._slots[place]

    def _unhome(self, session: Session) -> None:
        engine = session.engine
        if engine is not None:
            self._homed[engine] -= 1
            if self._homed[engine] <= 0:
                del self._homed[engine]

    def _unprefix(self, session: Session) -> None:
        for digest in session.prefix:
            if self._prefixes.get(digest) == session.key:
                del self._prefixes[digest]


@dataclass(frozen=True, slots=True)
class SessionCache:
    """One session's prompt cache so far: what its turns found cached and computed, and
    its last miss."""

    #: Its key, scoped to its flow ("flow\\nname"; a conversation the client does not name
    #: is named by placement's hint after its start: "flow\\n#digest").
    session: str
    model: str
    turns: int
    cached: int  #: prompt tokens its turns took from a cache
    computed: int  #: prompt tokens its turns computed
    #: Where its last turn ran: the engine's public name and its slot, if pinned.
    engine: str
    slot: int | None
    last: Verdict
    last_miss: Verdict | None
    #: When its last turn ended (the book's clock).
    at: float

    @property
    def hit_percent(self) -> float:
        """Of all its prompt tokens, the share found cached (0-100)."""
        total = self.cached + self.computed
        return 100.0 * self.cached / total if total else 0.0


class CacheBook:
    """Each session's last turn and its figures, bounded as the session table is: at
    most `max_sessions`, of them at most `max_per_flow` of one flow (None: a quarter);
    past its share a flow's own least recently served go, past the bound the least
    recently served of the flow holding the most (`backend.admission.flow_shares`).
    Changed on the port's loop; `snapshot` may be read from any thread."""

    def __init__(self, max_sessions: int = 4096, *, max_per_flow: int | None = None,
                 clock: Callable[[], float]) -> None:
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        # Each session's last turn of each of its last few conversations, newest first.
        self._turns: OrderedDict[str, tuple[tuple[TurnRecord, ...], SessionCache]] = OrderedDict()
        self._shares: FlowShares[str] = FlowShares(max_sessions, max_per_flow)

    def judge(self, session: str | None, flow: str, model: str, blocks: PromptBlocks,
              cached: int, computed: int, *, engine: str | None, label: str = "",
              slot: int | None = None, engine_alive: Callable[[str], bool],
              restored: bool = False) -> tuple[Verdict, SessionCache | None]:
        """The verdict on one answered turn (see `judge`), recorded as the session's last.
        `session`: its session (scoped to `flow`); None: a prompt with nothing to name it
        by, only counted; `engine_alive(key)`: does the engine of that admission key
        still serve."""
        if session is None:
            return Verdict(max(0, cached), max(0, computed)), None
        found = self._turns.get(session)
        records, summary = found if found is not None else ((), None)
        previous = _continued(records, blocks)
        alive = previous is not None and previous.engine is not None and engine_alive(previous.engine)
        verdict = judge(previous, blocks, cached, computed, engine=engine, slot=slot,
                        engine_alive=alive or previous is None, restored=restored)
        # Another conversation's first turn leaves the session's last miss as it was.
        another = previous is not None and verdict.reason == "first_turn"
        summary = SessionCache(
            session, model, (summary.turns if summary else 0) + 1,
            (summary.cached if summary else 0) + verdict.cached,
            (summary.computed if summary else 0) + verdict.computed, label, slot, verdict,
            verdict if verdict.missed and not another
            else (summary.last_miss if summary else None),
            self._clock())
        record = TurnRecord(blocks, verdict.cached + verdict.computed, engine, slot, model)
        kept = (record, *(r for r in records if another or r is not previous))[:CONVERSATIONS]
        with self._lock:
            self._turns.pop(session, None)
            self._turns[session] = (kept, summary)
            for dropped in self._shares.put(flow, session):
                del self._turns[dropped]
        return verdict, summary

    def flows(self) -> list[str]:
        """The flows holding any session."""
        return self._shares.flows()

    def forget_flow(self, flow: str) -> int:
        """Drop every session of `flow` (its key is gone); how many."""
        sessions = list(self._shares.keys_of(flow))
        with self._lock:
            for session in sessions:
                self._shares.discard(session)
                del self._turns[session]
        return len(sessions)

    def continuation(self, session: str | None, model: str,
                     blocks: PromptBlocks) -> TurnRecord | None:
        """The answered turn of `session` on `model` that `blocks` continues (the same
        request with messages added: `PromptBlocks.continues`), whose prompt tokens
        bound this one's (`continued_turn.Continued`); None when there is
        none, or the turns' sizes are unknown."""
        if session is None or not blocks.size:
            return None
        found = self._turns.get(session)
        if found is None:
            return None
        for record in found[0]:
            if (record.model == model and record.blocks.size and record.prompt_tokens
                    and blocks.continues(record.blocks)):
                return record
        return None

    def snapshot(self) -> tuple[SessionCache, ...]:
        """Every session, most recently served first; safe from any thread."""
        with self._lock:
            summaries = [summary for _, summary in self._turns.values()]
        return tuple(reversed(summaries))


@dataclass(frozen=True)
class SessionRequest:
    """A session's last request, to bring its prefix back from the RAM cache."""

    path: str
    body: bytes
    #: The digest of its prompt's first block (`Hint.prefix`), or () when it has none.
    begins: tuple[int, ...] = ()


class LastRequests:
    """Each session's last request of its conversation, within `limit` bytes of bodies,
    of them at most `per_flow` bytes of one key's (None: a quarter): past its share a
    key's own least recently kept go first, past the limit the least recently kept of
    the key holding the most (`backend.admission.flow_shares`), so that one key's
    requests never push out another's.  No I/O; O(1) but for what it drops."""

    def __init__(self, limit: int = REMEMBERED_BYTES, *, per_flow: int | None = None) -> None:
        self.limit = limit
        self._requests: dict[ParkKey, SessionRequest] = {}
        self._shares: FlowShares[ParkKey] = FlowShares(limit, per_flow)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def bytes(self) -> int:
        """The bodies' bytes kept."""
        return self._shares.units

    def get(self, key: ParkKey) -> SessionRequest | None:
        return self._requests.get(key)

    def keep(self, key: ParkKey, request: SessionRequest) -> bool:
        """Keep `request` as `key`'s last one, unless it is a side turn of the
        conversation kept (`_aside`); a body larger than its key's whole share is not
        kept (and forgets the one before).  Whether it was kept."""
        earlier = self._requests.get(key)
        if earlier is not None and _aside(earlier, request):
            return False
        self._requests[key] = request
        for dropped in self._shares.put(key.flow, key, len(request.body)):
            del self._requests[dropped]
        return key in self._requests

    def flows(self) -> list[str]:
        """The flows whose requests are kept."""
        return self._shares.flows()

    def forget_flow(self, flow: str) -> int:
        """Forget every request of `flow` (its key is gone); how many."""
        keys = list(self._shares.keys_of(flow))
        for key in keys:
            self._shares.discard(key)
            del self._requests[key]
        return len(keys)


def _by_last_turn(session: Session) -> float:
    return session.last_turn


def _continued(records: tuple[TurnRecord, ...], blocks: PromptBlocks) -> TurnRecord | None:
    """Of a session's conversations (newest first), the last turn `blocks` continues: the
    one sharing the longest start with it (the newest among equals); the newest when none
    shares any."""
    best, longest = None, 0
    for record in records:
        common = blocks.common_chars(record.blocks)
        if common > longest:
            best, longest = record, common
    return best if best is not None else (records[0] if records else None)


def _aside(earlier: SessionRequest, request: SessionRequest) -> bool:
    """Is `request` a side turn of the session whose last request was `earlier` (another
    beginning, and shorter: a title request, a side question;
    `backend.admission.session_book`)?  Its slot then holds the side prompt, and the
    conversation's prefix is what `earlier` brings back."""
    return bool(request.begins and earlier.begins) and request.begins != earlier.begins \
        and len(request.body) < len(earlier.body)
