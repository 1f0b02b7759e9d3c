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
  last few conversations apart (`session_book.CONVERSATIONS`), each turn judged against the one
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

from collections.abc import Mapping
from typing import NamedTuple

from backend.admission.prompt import Part, PromptBlocks

__all__ = ["CAUSES", "NEAR_START_CHARS", "REASONS", "TurnRecord", "Verdict", "judge"]

#: A change this close to the start, in a part otherwise kept, is "a changing line".
NEAR_START_CHARS = 4096
#: What a changing line may add to or take from its part's length (a date, a clock).
CHANGING_LINE_CHARS = 80

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


class TurnRecord(NamedTuple):
    """What a session's last turn left: its prompt, and where it ran.  Plain values in
    tuples (as its blocks are), which the garbage collector stops tracking: the session
    book holds a few of them for every session."""

    blocks: PromptBlocks
    prompt_tokens: int
    #: The engine's admission key (a new one for each process) and its slot (None: the
    #: engine chose one itself).
    engine: str | None
    slot: int | None = None
    #: The model that counted `prompt_tokens` ("" unknown).
    model: str = ""


class Verdict(NamedTuple):
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


# --- helpers ---------------------------------------------------------------------------


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
