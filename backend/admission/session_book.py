"""The session book: every session's state in one place (`Sessions`), held by the
admission registry; placement, settlement, parking, the metrics and the views read and tell
it, never a copy.

A *session* is one conversation of one caller: its key is scoped to the caller's flow
("flow\\nname", see `backend.admission.hint.request_hint`), so that no key can name,
steer into or read about another key's session.  Its entry holds:

- its *place*, where its prompt prefix lives (`Session`): which engine served its last
  turn (its admission key, a new one for each process: a restarted engine holds nothing)
  and its public label, the slot id holding the prefix (None: the engine chose one itself,
  or kept it in its RAM prompt cache), the prompt's tokens and how many of them the
  engine's cache held, and the chained digests of the prompt's first blocks.  Placement
  asks where a session lives (`where`), which session last showed a prefix
  (`match_prefix`), who holds a slot (`holder`) and how many sessions live on an engine
  (`homed`); parking asks which live on an engine it is about to stop (`resident`);
- its last turns, one per conversation (`CONVERSATIONS`), with its prompt cache figures
  (`SessionCache`): each answered turn is judged against the one it continues
  (`backend.admission.cache_misses.judge`), and the need planner bounds a continued
  turn's prompt by the earlier one's (`continuation`);
- its last request on each model (`SessionRequest`), kept for parking: what brings its
  prefix back from an engine's RAM cache before a planned loss (`backend.app.pool.parking_steward`).

A turn's end is told once, by its settlement (`turn_ended`), which gets its verdict back.

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
recently served session goes; past the book's bound, the least recently served of the
flow holding the most: one key making a session per request never pushes out another's.
The last requests' bodies are bounded the same way in bytes (`REMEMBERED_BYTES`).  A key
revoked or deleted takes its sessions with it (`keep_flows`).
Pure: no I/O, no clock of its own beyond the one given, no locks (the backend's one
asyncio loop owns it).  Every operation is O(1) except `resident`, `forget_engine` and
`caches` (O(sessions)), `snapshot` (O(n log n)) and a session dropped past the bound
(O(flows)).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from backend.admission.cache_misses import TurnRecord, Verdict, judge
from backend.admission.flow_shares import FlowShares
from backend.admission.prompt import PromptBlocks
from backend.llama.slot_parking import ParkKey

__all__ = ["CONVERSATIONS", "DEFAULT_MAX_SESSIONS", "REMEMBERED_BYTES", "Session", "SessionCache",
           "SessionRequest", "Sessions"]

#: Sessions kept: enough for every agent of a shared box, small (a few hundred bytes each).
DEFAULT_MAX_SESSIONS = 4096
#: Conversations followed apart within one session (an agent's turns, its title request).
CONVERSATIONS = 4
#: Bytes of sessions' last requests kept to bring their prefixes back from an engine's
#: RAM prompt cache before it goes (the least recently answered dropped first), a
#: quarter of it at most one key's: an agent's 30k-token request is about 120 KiB, so a
#: few hundred sessions, and a hundred of one key.
REMEMBERED_BYTES = 64 << 20


class Session(NamedTuple):
    """One session as its last turn left it.  Plain values in a tuple, as `SessionCache`
    is, which the garbage collector stops tracking (the book holds thousands)."""

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


class SessionCache(NamedTuple):
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


@dataclass(frozen=True)
class SessionRequest:
    """A session's last request, to bring its prefix back from the RAM cache."""

    path: str
    body: bytes
    #: The digest of its prompt's first block (`Hint.prefix`), or () when it has none.
    begins: tuple[int, ...] = ()


class Sessions:
    """Every session's state, by key, least recently served first: its place (which
    engine and slot hold its prefix), its last turns and their figures, its last requests
    (see the module's doc).  The registry holds one for every line's placement."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, *,
                 max_per_flow: int | None = None, request_bytes: int = REMEMBERED_BYTES,
                 request_bytes_per_flow: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`max_per_flow`: the sessions one flow may hold (None: a quarter of the book);
        `request_bytes`: the last requests' bodies kept together, of them at most
        `request_bytes_per_flow` of one flow's (None: a quarter)."""
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise ValueError(f"max_sessions is a whole number, at least 1, not {max_sessions!r}")
        self.max_sessions = max_sessions
        self.request_bytes = request_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Which sessions go when a flow or the book is full.
        self._shares: FlowShares[str] = FlowShares(max_sessions, max_per_flow)
        # Which last requests go (by bytes): (session, model identity).
        self._request_shares: FlowShares[tuple[str, str]] = FlowShares(
            request_bytes, request_bytes_per_flow)
        # (engine, slot) -> the session key holding it.
        self._slots: dict[tuple[str, int], str] = {}
        # A prefix block's digest -> the session that last showed it.
        self._prefixes: dict[int, str] = {}
        # Engine -> how many sessions' prefixes live there.
        self._homed: Counter[str] = Counter()

    # --- where sessions live: placement's and parking's questions --------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Session]:
        """The placed sessions, least recently served first."""
        return iter([e.place for e in self._entries.values() if e.place is not None])

    def where(self, key: str | None) -> Session | None:
        """Session `key` as its last turn left it; None when unknown (or `key` is None)."""
        entry = None if key is None else self._entries.get(key)
        return None if entry is None else entry.place

    def holder(self, engine: str, slot: int) -> Session | None:
        """The session whose prefix slot `slot` of `engine` holds, if one is known."""
        key = self._slots.get((engine, slot))
        return None if key is None else self.where(key)

    def match_prefix(self, flow: str, prefix: tuple[int, ...]) -> tuple[Session, int] | None:
        """The session of `flow` that last showed the longest start of `prefix`, and how
        many blocks of it match; None when no block does.  Only `flow`'s own sessions."""
        for blocks in range(len(prefix), 0, -1):
            key = self._prefixes.get(prefix[blocks - 1])
            if key is None:
                continue
            session = self.where(key)
            if (session is not None and session.flow == flow
                    and session.prefix[:blocks] == prefix[:blocks]):
                return session, blocks
        return None

    def homed(self, engine: str) -> int:
        """How many sessions' prefixes live on `engine` (O(1))."""
        return self._homed[engine]

    def resident(self, engine: str) -> list[Session]:
        """The sessions whose prefix lives on `engine`, least recently served first."""
        return [e.place for e in self._entries.values()
                if e.place is not None and e.place.engine == engine]

    def flows(self) -> list[str]:
        """The flows holding any session."""
        return self._shares.flows()

    def snapshot(self) -> tuple[Session, ...]:
        """Every placed session, most recently served first (for views)."""
        return tuple(sorted(self, key=_by_last_turn, reverse=True))

    # --- what its turns left: the verdicts, the figures, the continued turn ----------

    def caches(self) -> tuple[SessionCache, ...]:
        """Every judged session's prompt cache so far, most recently served first."""
        return tuple(e.cache for e in reversed(self._entries.values()) if e.cache is not None)

    def continuation(self, session: str | None, model: str,
                     blocks: PromptBlocks) -> TurnRecord | None:
        """The answered turn of `session` on `model` that `blocks` continues (the same
        request with messages added: `PromptBlocks.continues`), whose prompt tokens
        bound this one's (`continued_turn.Continued`); None when there is
        none, or the turns' sizes are unknown."""
        if session is None or not blocks.size:
            return None
        entry = self._entries.get(session)
        if entry is None:
            return None
        for record in entry.turns:
            if (record.model == model and record.blocks.size and record.prompt_tokens
                    and blocks.continues(record.blocks)):
                return record
        return None

    @property
    def remembered_bytes(self) -> int:
        """The bodies' bytes of the last requests kept."""
        return self._request_shares.units

    def last_request(self, key: ParkKey) -> SessionRequest | None:
        """Session `key.session`'s last request on the model of `key.model`."""
        entry = self._entries.get(key.session)
        return None if entry is None or entry.requests is None else \
            entry.requests.get(key.model)

    # --- a turn ends --------------------------------------------------------------------

    def turn_ended(self, session: str | None, flow: str, *, model: str,
                   prefix: tuple[int, ...], blocks: PromptBlocks, engine: str, label: str,
                   slot: int | None, pinned: bool, keeps_slot: bool,
                   prompt: tuple[int, int] | None, cache: tuple[int, int] | None,
                   engine_alive: Callable[[str], bool]) -> Verdict | None:
        """A turn of `session` (of `flow`, on `model`; its hint's `prefix`, its prompt's
        `blocks`) ended on slot `slot` of `engine` (`pinned`: the engine was told the
        slot; `keeps_slot`: it keeps each slot's prompt there, a split cache), told once
        by its settlement.  `prompt`: (its prompt tokens, of them found cached) when known:
        its prefix lives there now (`record`); `cache`: an answered turn's (cached,
        computed) tokens, judged against the conversation it continues (`judge`).  The
        verdict; None when not judged."""
        if session is not None and prompt is not None:
            self.record(session, flow=flow, engine=engine, label=label,
                        slot=slot if keeps_slot else None, prompt_tokens=prompt[0],
                        cached_tokens=prompt[1], prefix=prefix)
        if cache is None:
            return None
        verdict, _ = self.judge(session, flow, model, blocks, *cache, engine=engine,
                                label=label, slot=slot if pinned else None,
                                engine_alive=engine_alive)
        return verdict

    def record(self, key: str, *, flow: str, engine: str | None, label: str = "",
               slot: int | None = None, prompt_tokens: int = 0, cached_tokens: int = 0,
               prefix: tuple[int, ...] = ()) -> Session:
        """A turn of session `key` was served on `engine` (pinned to `slot`, or not):
        its prefix lives there now.  The slot is taken from any other session.  A side
        turn (see the module's doc) leaves the session where it was, and takes the slot."""
        entry = self._entries.get(key)
        old = None if entry is None else entry.place
        if old is not None and not old.continued_by(prefix) and prompt_tokens < old.prompt_tokens:
            return self._aside(old, engine, slot)
        if old is not None:
            self._unslot(old)
            self._unhome(old)
        if engine is not None:
            self._homed[engine] += 1
        if engine is not None and slot is not None:
            previous = self._slots.get((engine, slot))
            if previous is not None and previous != key:
                displaced = self.where(previous)
                if displaced is not None:  # still on the engine: its RAM cache keeps it
                    self._entries[previous].place = displaced._replace(slot=None)
            self._slots[(engine, slot)] = key
        session = Session(key=key, flow=flow, engine=engine, label=label,
                          slot=slot if engine is not None else None, prefix=prefix,
                          prompt_tokens=max(0, prompt_tokens),
                          cached_tokens=max(0, min(cached_tokens, prompt_tokens)),
                          turns=1 if old is None else old.turns + 1,
                          last_turn=self._clock())
        self._served(key, flow).place = session
        for digest in prefix:
            self._prefixes[digest] = key
        return session

    def judge(self, session: str | None, flow: str, model: str, blocks: PromptBlocks,
              cached: int, computed: int, *, engine: str | None, label: str = "",
              slot: int | None = None, engine_alive: Callable[[str], bool],
              restored: bool = False) -> tuple[Verdict, SessionCache | None]:
        """The verdict on one answered turn (`cache_misses.judge`), recorded as the
        session's last.  `session`: its session (scoped to `flow`); None: a prompt with
        nothing to name it by, only counted; `engine_alive(key)`: does the engine of that
        admission key still serve."""
        if session is None:
            return Verdict(max(0, cached), max(0, computed)), None
        entry = self._entries.get(session)
        records, summary = ((), None) if entry is None else (entry.turns, entry.cache)
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
        entry = self._served(session, flow)
        entry.turns = (record, *(r for r in records if another or r is not previous))[
            :CONVERSATIONS]
        entry.cache = summary
        return verdict, summary

    def remember(self, key: ParkKey, request: SessionRequest) -> bool:
        """Keep `request` as session `key.session`'s last one on `key.model`,
        unless it is a side turn of the conversation kept (`_aside`); a body larger than
        its flow's whole share of `request_bytes` is not kept (and forgets the one before).
        Whether it was kept.  O(1) but for what it drops."""
        entry = self._entries.get(key.session)
        if entry is None:
            entry = self._served(key.session, key.flow)
        requests = entry.requests
        earlier = None if requests is None else requests.get(key.model)
        if earlier is not None and _aside(earlier, request):
            return False
        if requests is None:
            requests = entry.requests = {}
        requests[key.model] = request
        for session, identity in self._request_shares.put(key.flow, (key.session, key.model),
                                                          len(request.body)):
            self._forget_request(session, identity)
        return key.model in requests

    # --- changes ---------------------------------------------------------------------

    def forget(self, key: str) -> Session | None:
        """Drop session `key` (its key was revoked); where it was."""
        self._shares.discard(key)
        return self._drop(key)

    def forget_flow(self, flow: str) -> int:
        """Drop every session of `flow` (its key is gone); how many."""
        keys = list(self._shares.keys_of(flow))
        for key in keys:
            self.forget(key)
        return len(keys)

    def keep_flows(self, flows: Container[str]) -> int:
        """Drop the sessions of every flow but `flows` (their keys were revoked or
        deleted: nothing of a session is kept past its key); how many."""
        return sum(self.forget_flow(flow) for flow in self.flows() if flow not in flows)

    def forget_engine(self, engine: str) -> list[Session]:
        """`engine` went away with its cache: its sessions live nowhere now; which."""
        moved: list[Session] = []
        for entry in self._entries.values():
            session = entry.place
            if session is not None and session.engine == engine:
                self._unslot(session)
                entry.place = session._replace(engine=None, label="", slot=None)
                moved.append(session)
        self._homed.pop(engine, None)
        return moved

    def vacate(self, engine: str, slot: int) -> Session | None:
        """Slot `slot` of `engine` no longer holds what it held (the engine chose it for
        another prompt, or it was cleared); the session that held it, now slot None."""
        key = self._slots.pop((engine, slot), None)
        entry = None if key is None else self._entries.get(key)
        session = None if entry is None else entry.place
        if entry is None or session is None:
            return None
        entry.place = session._replace(slot=None)
        return session

    # --- helpers ---------------------------------------------------------------------

    def _served(self, key: str, flow: str) -> _Entry:
        """Session `key`'s entry (made on its first turn), now the most recently served;
        the sessions its flow's share or the book's bound then drops go."""
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = _Entry(flow)
        self._entries[key] = entry
        for dropped in self._shares.put(flow, key):
            self._drop(dropped)
        return entry

    def _aside(self, session: Session, engine: str | None, slot: int | None) -> Session:
        """A side turn of `session` ran on `slot` of `engine`: that slot holds its prompt
        now, not whatever it held; the session stays where its conversation is."""
        if engine is not None and slot is not None:
            self.vacate(engine, slot)
        entry = self._entries[session.key]
        assert entry.place is not None
        session = entry.place = entry.place._replace(last_turn=self._clock())
        self._entries.move_to_end(session.key)
        self._shares.touch(session.key)
        return session

    def _drop(self, key: str) -> Session | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        for identity in entry.requests or ():
            self._request_shares.discard((key, identity))
        session = entry.place
        if session is not None:
            self._unslot(session)
            self._unhome(session)
            self._unprefix(session)
        return session

    def _forget_request(self, session: str, identity: str) -> None:
        """The bytes' bound dropped a last request: an entry left holding nothing goes."""
        entry = self._entries.get(session)
        if entry is not None and entry.requests is not None:
            entry.requests.pop(identity, None)
            if not entry.requests:
                entry.requests = None
                if entry.place is None and entry.cache is None:
                    self.forget(session)

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


@dataclass(slots=True)
class _Entry:
    """What the book holds of one session: one entry, whatever asked for it first."""

    flow: str
    #: Where its prefix lives (None: no turn placed yet).
    place: Session | None = None
    #: The last turn of each of its last few conversations, newest first.
    turns: tuple[TurnRecord, ...] = ()
    #: Its prompt cache figures (None: no turn judged yet).
    cache: SessionCache | None = None
    #: Its last request on each model (by identity), when remembered.
    requests: dict[str, SessionRequest] | None = None


# --- helpers ---------------------------------------------------------------------------

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
