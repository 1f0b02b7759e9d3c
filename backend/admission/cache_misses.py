"""Why a turn's prompt was recomputed: the verdict on each answer's prompt cache.

After each answer the port knows how many of the prompt's tokens the engine took from
its cache and how many it computed (the engine's `timings`).  `judge` says whether that
was a *miss* (the engine computed what the session's previous turn had left in a
cache) and why, comparing the session's previous turn with this one:

- `first_turn`: the session had no turn before (its computed tokens are no one's fault),
  or the turn begins another conversation under the session's name: its prompt shares
  no block with the session's last one, whose head (system prompt, or first message) is
  not in it either, and no line near the start changed (OpenCode sends its title request
  with its session's headers).  The book follows a session's
  last few conversations apart (`CONVERSATIONS`), each turn judged against the one
  whose prompt it continues;
- `prefix_changed`: the client sent a different beginning than last time, at token N;
  with the likely cause where it is one of the known breakers: the reasoning of an
  earlier answer dropped from the history, a changing line near the start (a date, a
  time), the tools rendered differently;
- `unloaded`: the engine that held the prefix went away (unloaded, evicted, restarted);
- `engine_changed`: the turn ran on another engine than the one holding the prefix;
- `restored`: the prefix was restored from a parked copy, and the engine still
  recomputed it (the restore did not take);
- `slot_taken`: same engine, same load, yet the prefix was gone: its slot was given to
  another session (and the engine's RAM cache did not keep it).

A prompt is seen as `PromptBlocks` (`backend.admission.prompt`).

Pure: no I/O; hashes are Python's, meaningful within one process only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from backend.admission.flow_shares import FlowShares
from backend.admission.prompt import Part, PromptBlocks

__all__ = ["CAUSES", "CONVERSATIONS", "CacheBook", "NEAR_START_CHARS", "REASONS", "SessionCache",
           "TurnRecord", "Verdict", "judge"]

#: A change this close to the start, in a part otherwise kept, is "a changing line".
NEAR_START_CHARS = 4096
#: What a changing line may add to or take from its part's length (a date, a clock).
CHANGING_LINE_CHARS = 80
#: Conversations followed apart within one session (an agent's turns, its title request).
CONVERSATIONS = 4

#: Miss reasons: their metric label and what they say.
REASONS: Mapping[str, str] = {
    "first_turn": "first turn",
    "prefix_changed": "prefix changed",
    "unloaded": "unloaded",
    "engine_changed": "engine changed",
    "restored": "restored",
    "slot_taken": "slot given to another session",
}
#: The known breakers of a prefix: the cause's key and what it says.
CAUSES: Mapping[str, str] = {
    "reasoning_dropped": "reasoning dropped",
    "changing_line": "a changing line near the start",
    "tools_rerendered": "tools re-rendered",
}



@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What a session's last turn left: its prompt, and where it ran."""

    blocks: PromptBlocks
    prompt_tokens: int
    #: The engine's admission key (a new one for each process) and its slot (None: the
    #: engine chose one itself).
    engine: str | None
    slot: int | None = None
    #: The model that counted `prompt_tokens` ("" unknown).
    model: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One answer's prompt: cached and computed tokens, and a miss's reason."""

    cached: int
    computed: int
    #: A key of REASONS; None: no miss (the cache held what it could).
    reason: str | None = None
    #: Where the prompt stopped matching the previous turn's, in tokens
    #: (`prefix_changed` only).
    at_token: int | None = None
    #: A key of CAUSES, when the change looks like one of them.
    cause: str | None = None

    @property
    def missed(self) -> bool:
        return self.reason is not None

    def describe(self) -> str:
        """In a few words, for people: "prefix changed at token 412 (tools re-rendered)"."""
        if self.reason is None:
            return "cache hit"
        text = REASONS[self.reason]
        if self.at_token is not None:
            text += f" at token {self.at_token}"
        if self.cause is not None:
            text += f" ({CAUSES[self.cause]})"
        return text


def judge(previous: TurnRecord | None, blocks: PromptBlocks, cached: int, computed: int, *,
          engine: str | None, slot: int | None = None, engine_alive: bool = True,
          restored: bool = False) -> Verdict:
    """The verdict on a turn that ran on `engine` (admission key; slot `slot` when it
    was pinned), whose prompt is `blocks`, of which the engine took `cached` tokens from
    its cache and computed `computed`.  `previous`: the session's last turn (None: this
    is its first); `engine_alive`: the engine that served `previous` still serves (the
    same process); `restored`: the prefix was restored from a parked copy first."""
    cached, computed = max(0, cached), max(0, computed)
    if previous is None:
        return Verdict(cached, computed, "first_turn" if computed else None)
    if cached + _slack(previous.prompt_tokens) >= previous.prompt_tokens:
        return Verdict(cached, computed)  # the whole previous prompt was kept
    old = previous.blocks
    common = blocks.common_chars(old)
    if old.chars and common < old.chars:
        cause = _cause(old, blocks, common)
        if _another_conversation(old, blocks, common, cause):
            return Verdict(cached, computed, "first_turn" if computed else None)
        # The client sent another beginning: whatever the cache held ends there.  The
        # engine's own count says where when it ran where the previous turn did (it
        # reused exactly the common start); else an estimate from the characters.
        same_place = engine_alive and engine == previous.engine and (
            previous.slot is None or slot is None or slot == previous.slot)
        at = cached if same_place else previous.prompt_tokens * common // old.chars
        return Verdict(cached, computed, "prefix_changed", at, cause)
    if restored:
        return Verdict(cached, computed, "restored")
    if not engine_alive or previous.engine is None:
        return Verdict(cached, computed, "unloaded")
    if engine != previous.engine:
        return Verdict(cached, computed, "engine_changed")
    return Verdict(cached, computed, "slot_taken")


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

# --- helpers ---------------------------------------------------------------------------


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


def _slack(expected: int) -> int:
    """Tokens a kept prefix may still lose: the last token is always computed again, and
    a reply tokenized anew may differ from its generation near its end."""
    return max(8, expected // 32)


def _cause(old: PromptBlocks, new: PromptBlocks, common: int) -> str | None:
    was = old.part_at(common)
    now = new.part_at(common)
    kinds = {p.kind for p in (was, now) if p is not None}
    if "tools" in kinds:
        return "tools_rerendered"
    if was is not None and was.kind == "reasoning" and not _has_part(new, was):
        return "reasoning_dropped"
    if (common < NEAR_START_CHARS and was is not None and now is not None
            and was.kind == now.kind and was.start == now.start
            and abs((was.end - was.start) - (now.end - now.start)) <= CHANGING_LINE_CHARS
            and _rest_kept(old, new, was, now)):
        return "changing_line"
    return None


def _another_conversation(old: PromptBlocks, new: PromptBlocks, common: int,
                          cause: str | None) -> bool:
    """`new` shares no block with `old`, and not even `old`'s head (its system prompt, or
    its first message) comes again in it: the client began another conversation."""
    if common or cause == "changing_line":
        return False
    head = next((p for p in old.parts if p.kind != "tools"), None)
    return head is not None and not _has_part(new, head)


def _has_part(blocks: PromptBlocks, part: Part) -> bool:
    return any(p.digest == part.digest for p in blocks.parts)


def _rest_kept(old: PromptBlocks, new: PromptBlocks, was: Part, now: Part) -> bool:
    """Every part after the changed one is as it was (the change stayed in its line)."""
    after_old = [p.digest for p in old.parts if p.start >= was.end]
    after_new = [p.digest for p in new.parts if p.start >= now.end]
    return after_new[:len(after_old)] == after_old
