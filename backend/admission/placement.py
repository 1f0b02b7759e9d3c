"""Which engine, and which of its slots, a ticket is admitted on.

`Line` (`backend.admission.line`) decides *who* goes next; a `Placement` decides *where*:
`place(ticket, engines)` gets the engines that serve the ticket's model and may take it
now (the one a requeue excludes is left out) and answers a `Seat` (an engine and one of
its free slot ids), or None to keep the ticket waiting.  A policy is pure: it reads the
engines' free slots and room and the ticket's need and `Hint`, and changes nothing.
Beside `place` a policy hears a ticket's life (`admitted`, `ended`, `learned`) and says
where a waiting ticket waits and why (`home_while_waiting`, `waits_for_home`) and what an
engine's cache holds of a prompt (`cached_tokens`); each does nothing by default, so any
policy plugs into the line, its prefill budget and settlement as it is.  The operator
picks one by name (`admission_registry.placement_named`: a setting, `serve --placement`,
a model's `placement` in the models file).

`KeepPrefixes` is the default: it keeps each session's prompt prefix warm, with what the
session book (`backend.admission.session_book.Sessions`) learnt from the answers.  What it
relies on in the pinned llama.cpp (tools/server/server-context.cpp, `get_available_slot`):

- a request with `id_slot` takes that slot: with `--slot-prompt-similarity 0` no RAM
  prompt cache is consulted; with a similarity set, a slot whose prompt is not similar
  enough is saved to the cache and the best match loaded (its keep fraction is 0),
  except an *empty* slot (0/0: the cache is skipped); a similar one is used in place;
- a request without one takes the idle slot with the most similar prompt (similarity
  on), else the least recently used idle slot (ties: the highest id); choosing by LRU
  first saves that slot's prompt to the RAM cache and loads the best match for the new
  prompt from it, so an unpinned request finds its prefix in the RAM cache;
- with a unified cache (`--kv-unified`, or auto slots) every idle slot is saved to the
  RAM cache and cleared whenever a request starts: nothing stays in a slot to pin.
- OpenAI-style answers do not say which slot served (only `/completion`'s `id_slot`);
  their `timings` say the prompt's computed (`prompt_n`) and cached (`cache_n`) tokens.
- an Anthropic request (`/v1/messages`) keeps none of the fields it does not convert,
  `id_slot` among them: it cannot be pinned (`Hint.pinnable`).

So, on an engine with a split cache, a session whose last turn left its prefix in slot S
(and nothing took S since) is pinned to S when S is free; any other request goes on the
seat the engine itself would choose (the least recently released free slot:
`least_recent_free_seat`), so the table learns where it went.  On an engine GGUF Studio
started with a slot similarity of 1 (`Serving.pin_any_slot`), pinning a slot that has
held a prompt always goes through the RAM cache (the keep fraction is 0 < 0.5: the slot
is saved, the best match loaded, the slot's own content when it is the prefix), so that
seat is pinned too and the books stay exact when requests ending together release their
slots in another order there than here.  A slot never used is pinned on any split cache
(an empty slot skips the RAM cache, a cost paid once per slot): requests arriving at once
may reach a fresh engine in another order than they were admitted, and the table would
then name the wrong slots.  Nothing is pinned on a unified cache or one not known.  A
request that cannot be pinned goes, on an engine with a slot similarity of 1 (which never
picks a slot by its prompt), on the least recently released free seat, where the engine
puts it, and the session steward first moves its prefix from its slot to the RAM cache
the engine loads from (`backend.app.pool.parking_steward`).  On an attached llama-server
at its default similarity such a request goes where the engine's own similarity and LRU
stamps say, so it goes only when none of that engine's slots is taken, and none follows
it there until a slot took it (`seated`: the answer's headers; `_waits_for_seating`).  Between engines, a session's turn goes to
the engine holding its prefix; a session that lives nowhere yet goes to the engine where the
fewest sessions live, those whose first turn runs there counted (among equals, one holding
another session of its flow that showed the same first blocks: measured with 6 agents
sharing a 1,200-token head on 2 engines, following the head put 4 on one engine and 2 on
the other for their whole conversations, and the 4 queued for its 2 slots; so did counting
a session only once its first turn was answered); while its own engine has no room and
another has, it waits at most `home_wait` seconds (10 by default) from its arrival, or as
long as the other engine would take to compute its prefix again when that is longer (up to
`HOME_WAIT_LIMIT`: measured with SmolLM2 on a pool of 2 engines, agents pausing 15-45 s,
a turn that left after 10 s computed its whole prompt, about 30 s), a new session
`new_wait` (2) for the engine where the fewest live, then goes wherever today's rule puts
it.  A session's request that arrives while another of its turns runs waits for neither:
that turn's slot holds nothing for it until the turn ends (identical chats are one session
by their digest, and one of them waited for another's whole answer beside a free engine).
The fairness bound is the line's: a head that waits for its engine is passed at most
`MAX_PASSES` times, by other flows' requests or by its own flow's turns that go to another
engine meanwhile (`home_while_waiting`), then nothing passes it.  A seat says how many
prompt tokens it expects the engine's cache to hold (`Seat.cached`): the
fair share charges the rest (a warm agent is not billed for the prefix it reuses).

`MostFreeSlots` is the rule before sessions: the need fits; the engine with the most
free slots (spreading the load); its lowest free slot id; nothing pinned.

The second policy, `HashRing`, lives in `backend.admission.hash_ring`; the registry
picks a policy by its name (`backend.admission.admission_registry.placement_named`).

"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from backend.admission.hint import Hint
from backend.admission.seat import E, Seat, SeatEngine, keeps_slots, seat_on, unpinned
from backend.admission.session_book import Session, Sessions
from backend.llama.kv_capacity import TokenNeed

__all__ = ["HOME_WAIT", "HOME_WAIT_LIMIT", "NEW_SESSION_WAIT", "KeepPrefixes",
           "MostFreeSlots", "Placeable", "Placement", "cached_in", "most_free"]

#: Seconds a session's turn may wait for the engine holding its prefix while another
#: engine could take it now (a recomputed prefix costs far more on a CPU or a long prompt).
HOME_WAIT = 10.0
#: The longest a session's turn waits for its engine when computing its prefix elsewhere
#: would take longer than `home_wait` (SmolLM2 on one CPU thread: 2,300 tokens, ~30 s).
HOME_WAIT_LIMIT = 60.0
#: Seconds a new session's first turn may wait for the engine where the fewest sessions
#: live while one where more live has room: it is cold anywhere, and the wait only buys
#: its later turns a less crowded engine; short, since sessions that ended long ago
#: still count where they lived (until the table drops them).
NEW_SESSION_WAIT = 2.0
#: New sessions' waits followed at once (a bound: first turns that leave unserved).
_PASSED_OVER_LIMIT = 4096


class Placeable(Protocol):
    """What a policy reads of the ticket it places."""

    @property
    def need(self) -> TokenNeed | None: ...

    @property
    def hint(self) -> Hint: ...


class Placement:
    """Where a ticket is admitted (`place`: a pure decision over the engines that may take
    it), and what the policy hears of a ticket's life.  The line calls `place`, then
    `admitted` on the seat it took, and `ended` when the ticket leaves it; it asks
    `home_while_waiting` for where a waiting ticket waits (its flow's next turns may pass
    it meanwhile) and `waits_for_home` for its wait's reason.  The prefill budget asks
    `cached_tokens` (its `CacheKnowledge`).  Settlement tells `learned` once the session
    book knows where an answer left its session's prefix.  Every hook but `place` does
    nothing by default, so a policy says only what it decides."""

    #: Its name where the operator chooses it (`admission_registry.placement_named`); "" for the others.
    name = ""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        """A seat for `ticket` on one of `engines` (those serving its model that may take
        it now, in the order they joined), or None: it waits."""
        raise NotImplementedError

    def admitted(self, ticket: Placeable, seat: Seat[Any]) -> None:
        """The line admitted `ticket` on `seat`."""

    def ended(self, ticket: Placeable) -> None:
        """`ticket` left its seat (answered, failed or sent back in line)."""

    def seated(self, ticket: Placeable) -> None:
        """The engine took admitted `ticket` into a slot (its answer's headers came: a
        streamed answer's come when its slot starts on the prompt, a whole answer's with
        it), or nothing more will say so; called at most once, before `ended`."""

    def slot_freed(self, ticket: Placeable) -> None:
        """`ticket`'s slot is free again (its answer ended): before the line admits
        anyone into it, and before `ended`."""

    def waits_for_seating(self, ticket: Placeable, engines: Sequence[E]) -> bool:
        """Does `place` keep `ticket` waiting for the turns an engine runs, or has not
        taken into a slot yet (its wait's reason)?"""
        return False

    def learned(self, ticket: Placeable, session: Session | None) -> None:
        """The session book learnt where `ticket`'s answer left its session's prefix
        (`session`: as the book has it now; None: nowhere), after `ended`."""

    def home_while_waiting(self, ticket: Placeable, engines: Sequence[E]) -> E | None:
        """The one engine `place` keeps `ticket` waiting for while another of `engines`
        has room (whoever of its flow goes meanwhile goes elsewhere, so may pass it);
        None: it waits for no engine in particular."""
        return None

    def waits_for_home(self, ticket: Placeable, engines: Sequence[E]) -> bool:
        """Does `ticket` wait for one engine while another has room (its wait's reason)?"""
        return self.home_while_waiting(ticket, engines) is not None

    def cached_tokens(self, hint: Hint, engine: object) -> int:
        """Prompt tokens of a request with `hint` that `engine`'s cache holds, as far as
        the policy knows (the prefill budget's `CacheKnowledge`); 0: it knows nothing."""
        return 0


class MostFreeSlots(Placement):
    """The need fits; the engine with the most free slots; its lowest free slot id."""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        best = most_free(ticket.need, engines)
        return None if best is None else best.lowest_free_seat()

    def __repr__(self) -> str:
        return "MostFreeSlots()"


class KeepPrefixes(Placement):
    """Each session's turn where its prefix is (see the module's doc), as the session
    book says (settlement tells it where each answer left its prefix)."""

    name = "keep-prefixes"

    def __init__(self, sessions: Sessions | None = None, *, home_wait: float = HOME_WAIT,
                 new_wait: float = NEW_SESSION_WAIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions = sessions if sessions is not None else Sessions(clock=clock)
        self.home_wait = home_wait
        self.new_wait = new_wait
        self._clock = clock
        # Sessions whose first turn runs (admitted, not yet answered): session -> the
        # engine it will live on; and how many per engine.  Counted with the table's
        # sessions when a new one chooses its engine: agents arriving together would
        # otherwise all see empty engines.
        self._arriving: dict[str, str] = {}
        self._arriving_on: Counter[str] = Counter()
        # Turns running per session: a session's request that arrives while another of
        # its own runs waits for no engine (that turn's slot holds nothing for it until
        # it ends): four identical chats, one session by their digest, or an agent's
        # side request beside its turn.
        self._running: Counter[str] = Counter()
        # New sessions' first turns waiting for the engine where the fewest live while
        # another has room: session -> since when (`_fewest_sessions`).
        self._passed_over: dict[str, float] = {}
        # Turns admitted on an engine that picks an unpinned request's slot by itself
        # (`_picks_own_slots`) whose slots are not free again: ticket -> engine, and how
        # many an engine; of those the engine cannot pin, the ones it has not taken into
        # a slot yet, and how many an engine (`_waits_for_seating`).
        self._held_on: dict[object, str] = {}
        self._holding: Counter[str] = Counter()
        self._unseated: dict[object, str] = {}
        self._unseated_on: Counter[str] = Counter()

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        seat = self._place(ticket, engines)
        if seat is not None and self._waits_for_seating(ticket, seat.engine):
            return None  # until the engine took the turns on their way into their slots
        return seat

    def waits_for_seating(self, ticket: Placeable, engines: Sequence[E]) -> bool:
        seat = self._place(ticket, engines)
        return seat is not None and self._waits_for_seating(ticket, seat.engine)

    def seated(self, ticket: Placeable) -> None:
        """The engine took `ticket` into its slot: turns may follow it to that engine."""
        engine = self._unseated.pop(ticket, None)
        if engine is not None:
            _count_down(self._unseated_on, engine)

    def slot_freed(self, ticket: Placeable) -> None:
        """`ticket`'s slot is free again: a turn the engine cannot pin may go there once
        every slot is."""
        self.seated(ticket)
        engine = self._held_on.pop(ticket, None)
        if engine is not None:
            _count_down(self._holding, engine)

    def _waits_for_seating(self, ticket: Placeable, engine: SeatEngine) -> bool:
        """On an attached llama-server at its default slot similarity, a turn it cannot
        pin (Claude Code's) takes the idle slot most like its prompt, else the least
        recently used one *as the engine sees it*; the steward makes its seat that slot by
        emptying every free slot, its seat first (`Seat.vacate`).  A slot that is idle
        there but not free in these books is not emptied, and the turn can land on it:
        one a pinned turn was admitted to and whose request has not reached it yet
        (measured on the attached pool: 1.48x and 1.64x the floor; the pinned turn then
        found another session's prompt), or one whose turn ended there a moment before
        the port heard (it holds a prompt sharing the head, so it is the most similar
        one: the turn reused it in place and computed from the head on).  So a turn the
        engine cannot pin goes to such an engine only when none of its slots is taken,
        and no turn goes there while one it cannot pin is on its way (until its answer's
        headers say a slot took it, or it ends).  Each wait ends with a turn (a running
        one's end, a streamed one's headers); the line's order holds meanwhile: the
        waiting turn is not passed by its own flow's later turns, and by others' only
        `MAX_PASSES` times."""
        key = engine.key
        if self._unseated_on[key]:
            return True
        return not ticket.hint.pinnable and self._holding[key] > 0

    def _place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        need = ticket.need
        hint = ticket.hint
        session = self.sessions.where(hint.session)
        if session is not None and not session.continued_by(hint.prefix):
            session = None  # another conversation under its name: placed as a new one
        home = None if session is None else session.engine
        if home is None and len(engines) > 1:
            return self._place_new(ticket, engines)
        if home is not None:
            for engine in engines:
                if engine.key != home:
                    continue
                if engine.has_room(need):
                    return seat_on(engine, session if session is not None
                                    and session.engine == home else None, need,
                                    self.sessions, hint.pinnable)
                if (session is not None and len(engines) > 1 and not self._runs(ticket)
                        and self._may_wait(ticket, self._home_bound(session, need, engines))):
                    return None  # its engine frees a slot soon: bounded by _home_bound
                break
        best = most_free(need, engines)
        if best is None:
            return None
        return unpinned(best, pinnable=hint.pinnable, sessions=self.sessions) \
            if keeps_slots(best) else best.lowest_free_seat()

    def cached_tokens(self, hint: Hint, engine: object) -> int:
        """What the session book knows `engine`'s cache holds of the request with `hint`
        (`cached_in`): a warm turn counts only its new tokens to the prefill budget."""
        return cached_in(self.sessions, hint, engine)

    def admitted(self, ticket: Placeable, seat: Seat[Any]) -> None:
        """The line admitted `ticket` on `seat`: its session has a turn running until it
        ends (`ended`), and a session's first turn there counts as living on its engine
        until it ends (its answer is recorded in the book right after)."""
        if _picks_own_slots(seat.engine):
            key = seat.engine.key
            holder = None if seat.slot is None else self.sessions.holder(key, seat.slot)
            if holder is not None and holder.key != ticket.hint.session:
                # Its prompt leaves that slot now (to the RAM cache, or overwritten), not
                # when this turn's answer is recorded: a turn of that session admitted
                # as this one ends would be sent there unvacated and reuse this one's
                # prompt in place (on the attached pool, the turns that ran right after
                # another on their slot computed from the shared head on).
                assert seat.slot is not None
                self.sessions.vacate(key, seat.slot)
            self._held_on[ticket] = key
            self._holding[key] += 1
            if not ticket.hint.pinnable:
                self._unseated[ticket] = key
                self._unseated_on[key] += 1
        session = ticket.hint.session
        if session is None:
            return
        self._running[session] += 1
        self._passed_over.pop(session, None)
        if session in self._arriving:
            return
        known = self.sessions.where(session)
        if known is None or known.engine is None:
            engine = seat.engine.key
            self._arriving[session] = engine
            self._arriving_on[engine] += 1

    def ended(self, ticket: Placeable) -> None:
        """`ticket` left its seat (answered, failed or sent back in line)."""
        self.slot_freed(ticket)
        session = ticket.hint.session
        self._unarrive(session)
        if session is not None and session in self._running:
            self._running[session] -= 1
            if self._running[session] <= 0:
                del self._running[session]

    def lives_on(self, engine: SeatEngine) -> int:
        """Sessions whose prefix lives on `engine`, and those whose first turn runs there."""
        key = engine.key
        return self.sessions.homed(key) + self._arriving_on[key]

    def _unarrive(self, session: str | None) -> None:
        engine = None if session is None else self._arriving.pop(session, None)
        if engine is not None:
            self._arriving_on[engine] -= 1
            if self._arriving_on[engine] <= 0:
                del self._arriving_on[engine]

    def _place_new(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        """A session that lives nowhere yet, in a pool: on the engine where the fewest
        sessions live, counting those whose first turn runs there (each stays where its
        prefix is, so a pile of them on one engine queues there for the rest of their
        conversations); among equals the one holding its flow's prefix (a shared head
        computed once), then the most free.  While that engine is full and one where more
        live has room, it waits for it within `new_wait`, as a known session waits for
        its own within `home_wait` (measured in bench/sessions.py's pool, 6 agents on 2 engines of 2 slots:
        taking the first free slot put 4 on one engine and 2 on the other)."""
        need = ticket.need
        fewest = self._fewest_sessions(ticket, engines)
        if fewest is not None and not fewest.has_room(need):
            return None  # it waits for the engine where it belongs, within new_wait
        hint = ticket.hint
        match = self.sessions.match_prefix(hint.flow, hint.prefix) if hint.prefix else None
        near = None if match is None else match[0].engine
        best: E | None = None
        best_rank = (0, 0, 0)
        for engine in engines:
            if not engine.has_room(need):
                continue
            rank = (-self.lives_on(engine), engine.key == near, engine.free_slots)
            if best is None or rank > best_rank:
                best, best_rank = engine, rank
        if best is None:
            return None
        if best.key == near:
            return seat_on(best, None, need, self.sessions, hint.pinnable)
        return unpinned(best, pinnable=hint.pinnable, sessions=self.sessions) \
            if keeps_slots(best) else best.lowest_free_seat()

    def waits_for_home(self, ticket: Placeable, engines: Sequence[E]) -> bool:
        """Does `place` keep `ticket` waiting for the engine holding its session's prefix
        while another of `engines` has room (the line's reason for its wait)?"""
        return self.home_while_waiting(ticket, engines) is not None

    def home_while_waiting(self, ticket: Placeable, engines: Sequence[E]) -> E | None:
        """The engine holding `ticket`'s session's prefix, when `place` keeps the ticket
        waiting for it while another of `engines` has room; else None."""
        if len(engines) < 2 or self._runs(ticket):
            return None
        session = self.sessions.where(ticket.hint.session)
        if session is None or session.engine is None:
            return self._fewest_sessions(ticket, engines)
        need = ticket.need
        home = next((e for e in engines if e.key == session.engine), None)
        if (home is not None and not home.has_room(need)
                and any(e is not home and e.has_room(need) for e in engines)
                and self._may_wait(ticket, self._home_bound(session, need, engines))):
            return home
        return None

    def _home_bound(self, session: Session, need: TokenNeed | None,
                    engines: Sequence[E]) -> float:
        """How long a turn of `session` may wait for the engine holding its prefix:
        `home_wait`, or as long as the quickest other engine with room would take to
        compute that prefix again when that is longer (a real model on a CPU), up to
        `HOME_WAIT_LIMIT`.  An engine elsewhere is not measured: its model is the same,
        so the home engine's own speed stands in for it.  An attached llama-server is
        timed by its answers' prefills (`AdmissionQueue.observe_prefill`)."""
        tokens = session.prompt_tokens
        elsewhere = [e.prefill_seconds(tokens) for e in engines
                     if e.key != session.engine and e.has_room(need)]
        known = [s for s in elsewhere if s is not None]
        if not known:
            home = next((e for e in engines if e.key == session.engine), None)
            here = None if home is None else home.prefill_seconds(tokens)
            known = [] if here is None else [here]
        if not known:
            return self.home_wait
        return min(HOME_WAIT_LIMIT, max(self.home_wait, min(known)))

    def _fewest_sessions(self, ticket: Placeable, engines: Sequence[E]) -> E | None:
        """For a new session's turn that may still wait: the engine with no room where
        fewer sessions live than on every engine with room, if there is one.  It waits
        for it `new_wait` seconds, or as long as that engine would take to compute its
        prompt when that is longer (up to `HOME_WAIT_LIMIT`), counted from when another
        engine first had room for it, not from its arrival: first turns that arrived
        while every slot ran took the first slot freed, wherever (measured on a pool of
        2 attached llama-servers of 2 slots, 6 agents: the fifth and sixth waited 124 s
        for a slot, then both went to one engine, 4 sessions on its 2 slots)."""
        session = ticket.hint.session
        if session is None or self._runs(ticket) or not hasattr(ticket, "enqueued_at"):
            return None
        need = ticket.need
        full: E | None = None
        full_lives = 0
        fewest_with_room: int | None = None
        for engine in engines:
            lives = self.lives_on(engine)
            if engine.has_room(need):
                if fewest_with_room is None or lives < fewest_with_room:
                    fewest_with_room = lives
            elif full is None or lives < full_lives:
                full, full_lives = engine, lives
        if full is None or fewest_with_room is None or full_lives >= fewest_with_room:
            return None
        now = self._clock()
        if len(self._passed_over) >= _PASSED_OVER_LIMIT and session not in self._passed_over:
            self._passed_over.clear()  # those of first turns that left unserved
        since = self._passed_over.setdefault(session, now)
        bound = self.new_wait
        seconds = None if need is None else full.prefill_seconds(need.prompt)
        if seconds is not None:
            bound = min(HOME_WAIT_LIMIT, max(bound, seconds))
        return full if now - since < bound else None

    def _runs(self, ticket: Placeable) -> bool:
        """Does another turn of `ticket`'s session run now?"""
        session = ticket.hint.session
        return session is not None and self._running[session] > 0

    def _may_wait(self, ticket: Placeable, bound: float | None = None) -> bool:
        since = getattr(ticket, "enqueued_at", None)
        return isinstance(since, float) and self._clock() - since < (
            self.home_wait if bound is None else bound)

    def __repr__(self) -> str:
        return f"KeepPrefixes({len(self.sessions)} sessions, home_wait={self.home_wait:g})"


def cached_in(sessions: Sessions, hint: Hint, engine: object) -> int:
    """Prompt tokens of the request with `hint` that `engine`'s cache holds, as far as the
    session book knows: its session's last prompt when that lives on `engine` (in a slot
    or its RAM prompt cache) and the request begins as that prompt did; else 0."""
    session = sessions.where(hint.session)
    if session is None or session.engine is None \
            or session.engine != getattr(engine, "key", None):
        return 0
    shared = min(len(hint.prefix), len(session.prefix))
    if hint.prefix[:shared] != session.prefix[:shared]:
        return 0  # another beginning: the engine holds none of it
    return session.prompt_tokens


def most_free(need: TokenNeed | None, engines: Sequence[E]) -> E | None:
    """The engine of `engines` with room for `need` and the most free slots (the first
    among equals); None when none has room."""
    if len(engines) == 1:  # the common case: one engine serves the model
        only = engines[0]
        return only if only.has_room(need) else None
    best: E | None = None
    for engine in engines:
        if engine.has_room(need) and (best is None or engine.free_slots > best.free_slots):
            best = engine
    return best


# --- helpers ---------------------------------------------------------------------------


def _picks_own_slots(engine: SeatEngine) -> bool:
    """An attached llama-server at its default slot similarity, split cache: it picks an
    unpinned request's slot by its own LRU stamps, which the port steers by vacating."""
    return engine.finds_prefix_in_ram and not engine.pin_any_slot and keeps_slots(engine)


def _count_down(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
