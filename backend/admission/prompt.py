"""A prompt as the port reads it: its text in order, and its blocks.

A request's body is walked once (`read_prompt`), where the gateway reads it: its prompt
as `Prompt`, its parts in the order a template renders them (system, tools, and each
message's role, reasoning, content, tool calls and other fields: a name, a tool call's
id).  The request's hint reads what its conversation says (`Prompt.said`:
`backend.admission.hint`), and its `PromptBlocks` are cut from the same parts
(`Prompt.blocks`): blocks of at most `BLOCK_CHARS` characters that never span two parts,
each with the chained hash of everything up to its end, and each part with its own hash,
compared with the session's last turns (`backend.admission.cache_misses`).  A turn that
continues an earlier one gives the engine what it added to count (`Prompt.text_after`).

Pure: no I/O; hashes are Python's, meaningful within one process only.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["BLOCK_CHARS", "NO_BLOCKS", "NO_PROMPT", "ROLE", "Part", "Prompt", "PromptBlocks",
           "prompt_blocks", "prompt_text", "read_prompt", "text_after"]


#: Characters per block (about 256 tokens of English or code).
BLOCK_CHARS = 1024


class Part(NamedTuple):
    """One part of a prompt: `kind` is system, tools, user, assistant, reasoning, tool
    or prompt; `start`/`end` in characters of the whole prompt text.  A tuple of plain
    values, as `PromptBlocks` is, which the garbage collector stops tracking: a session
    book holds every session's last prompts, hundreds of parts each."""

    kind: str
    start: int
    end: int
    digest: int


class PromptBlocks(NamedTuple):
    """A prompt as the classifier compares it (see the module docstring)."""

    #: Chained hash of the text up to each block's end.
    chained: tuple[int, ...] = ()
    #: Where each block ends, in characters.
    ends: tuple[int, ...] = ()
    parts: tuple[Part, ...] = ()
    #: A hash of the request's other fields (what else a template may render: tool
    #: choice, template arguments, the output limit), for `session_book.Sessions.continuation`.
    frame: int = 0
    #: The body's bytes with its tool calls' allowance (`prompt_bytes.prompt_size`);
    #: 0: unknown (images), no continuation bound.
    size: int = 0

    def continues(self, earlier: PromptBlocks) -> bool:
        """Is this the `earlier` request with messages added at its end (every block of
        the earlier prompt the same, the other fields the same)?"""
        n = len(earlier.chained)
        return (0 < n <= len(self.chained) and self.frame == earlier.frame
                and self.chained[n - 1] == earlier.chained[-1]
                # a block may grow: the earlier prompt's last block ended where it did
                and self.ends[n - 1] == earlier.ends[-1])

    @property
    def chars(self) -> int:
        return self.ends[-1] if self.ends else 0

    def common_chars(self, other: PromptBlocks) -> int:
        """Characters at the start both prompts share, to the precision of a block."""
        same = 0
        for mine, theirs in zip(self.chained, other.chained):
            if mine != theirs:
                break
            same += 1
        return self.ends[same - 1] if same else 0

    def part_at(self, char: int) -> Part | None:
        """The part holding character `char`."""
        i = bisect.bisect_right([p.start for p in self.parts], char) - 1
        return self.parts[i] if 0 <= i < len(self.parts) and char < self.parts[i].end else None


NO_BLOCKS = PromptBlocks()



#: A prompt part's kind that marks where a message begins (its text is the message's
#: role): the hint reads it, the blocks do not.
ROLE = "role"


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request body's prompt, read once (`read_prompt`): its parts, in the order a
    template renders them, the texts the body holds (not copied) beside the JSON of its
    tools, tool calls and other fields; each message's parts after a `ROLE` mark."""

    #: (kind, text, said): kind is system, tools, user, assistant, reasoning, tool, prompt,
    #: or `ROLE` (the text is the role of the message that begins); said: the text is
    #: what the conversation says (the system prompt, a message's content), not JSON of
    #: its tools, tool calls or other fields, nor reasoning.
    parts: tuple[tuple[str, str, bool], ...] = ()
    #: A hash of the request's other fields (`PromptBlocks.frame`); 0 without parts.
    frame: int = 0

    def blocks(self, size: int | None = None) -> PromptBlocks:
        """Its blocks (see the module's doc); `size`: the body's
        `prompt_bytes.prompt_size` (None: unknown)."""
        chained: list[int] = []
        ends: list[int] = []
        parts: list[Part] = []
        link = 0
        offset = 0
        for kind, text, _said in self.parts:
            if not text or kind == ROLE:
                continue
            start = offset
            offset += len(text)
            if offset - start <= BLOCK_CHARS:  # most parts: one block, its text not copied
                digest = hash(text)
                link = hash((link, kind, digest))
                chained.append(link)
                ends.append(offset)
            else:
                hashes = []
                end = start
                for at in range(0, len(text), BLOCK_CHARS):
                    piece = text[at:at + BLOCK_CHARS]
                    hashes.append(hash(piece))  # each character is hashed once
                    link = hash((link, kind, hashes[-1]))
                    end += len(piece)
                    chained.append(link)
                    ends.append(end)
                digest = hash(tuple(hashes))
            parts.append(_new_tuple(Part, (kind, start, offset, hash((kind, digest)))))
        if not chained:
            return NO_BLOCKS
        return PromptBlocks(tuple(chained), tuple(ends), tuple(parts), self.frame, size or 0)

    def text_after(self, chars: int) -> str:
        """Its text past its first `chars` characters (as `blocks` counts them), each part
        on a line of its own: what a turn that continues an earlier one of `chars`
        characters added, for the engine to tokenize.  The line breaks keep a tokenizer
        from merging the end of one part with the start of the next (a template separates
        them too)."""
        added: list[str] = []
        offset = 0
        for kind, text, _said in self.parts:
            if kind == ROLE:
                continue
            end = offset + len(text)
            if end > chars:
                added.append(text[max(0, chars - offset):])
            offset = end
        return "\n".join(added)

    def text(self) -> str:
        """Its whole text, each part behind a mark of its kind (a message's role too): the
        same in every process, so that a prompt can be checked against one kept on disk (a
        parked prefix, `backend.app.pool.parking_steward`) after a restart.  A turn that
        continues an earlier one begins with the earlier one's text."""
        return "".join(f"\x1e{kind}\x1f{text}" for kind, text, _said in self.parts if text)

    def said(self) -> Iterator[str]:
        """What the conversation says, in order, for the request's hint
        (`backend.admission.hint`): each message's role as a mark ("\\x1erole\\x1f") and
        its content's texts, after the system prompt's."""
        for kind, text, said in self.parts:
            if kind == ROLE:
                yield f"\x1e{text}\x1f"
            elif said:
                yield text


def read_prompt(data: Mapping[str, Any]) -> Prompt:
    """The prompt of a parsed chat, messages, responses or completions request body: the
    one walk of its fields each request makes (the hint and the blocks read its parts)."""
    found: list[tuple[str, str, bool]] = []
    _parts(data, found.append)
    if not found:
        return NO_PROMPT
    parts = tuple(found)
    # The other fields' repr, not their JSON: the same distinctions (1, 1.0 and true
    # differ; each dict in its order), without json's Python encoder around its C one.
    frame = hash(repr([item for item in sorted(data.items()) if item[0] not in _PROMPT_FIELDS]))
    return Prompt(parts, frame)


NO_PROMPT = Prompt()


def prompt_blocks(data: Mapping[str, Any], size: int | None = None) -> PromptBlocks:
    """The blocks of a parsed request body (`read_prompt(data).blocks(size)`)."""
    return read_prompt(data).blocks(size)


def prompt_text(data: Mapping[str, Any]) -> str:
    """`Prompt.text` of a parsed request body."""
    return read_prompt(data).text()


def text_after(data: Mapping[str, Any], chars: int) -> str:
    """`Prompt.text_after` of a parsed request body."""
    return read_prompt(data).text_after(chars)


# --- helpers ---------------------------------------------------------------------------

#: Makes a `Part` of its four values without its `__new__`'s Python frame (one per part).
_new_tuple = tuple.__new__

#: The fields `_parts` reads the prompt's text from; the others make a request's frame.
_PROMPT_FIELDS = frozenset({"system", "instructions", "tools", "messages", "input", "prompt"})


#: Adds a part (kind, text, said) to the prompt being read.
_Add = Callable[[tuple[str, str, bool]], None]


def _parts(data: Mapping[str, Any], add: _Add) -> None:
    """(kind, text, said) of a request body's prompt, in the order a template renders it
    (see `Prompt.parts`), each given to `add`."""
    system = data.get("system", data.get("instructions"))
    if system is not None:
        for text in _texts(system):
            add(("system", text, True))
    tools = data.get("tools")
    if tools:
        add(("tools", _dumps(tools), False))
    messages = data.get("messages", data.get("input", data.get("prompt")))
    if isinstance(messages, str):
        add(("prompt", messages, True))
        return
    if not isinstance(messages, list):
        return
    for message in messages:
        if isinstance(message, str):
            add(("prompt", message, True))
        elif isinstance(message, dict):
            role = message.get("role")
            if isinstance(role, str):
                add((ROLE, role, False))
            _message_parts(message, add)


def _message_parts(message: Mapping[str, Any], add: _Add) -> None:
    role = message.get("role")
    kind = _KINDS.get(role) if isinstance(role, str) else None
    item = message.get("type")
    if kind is None:  # a Responses input item, or an unknown role
        if item == "reasoning":
            add(("reasoning", _dumps(message.get("summary") or message.get("content") or ""),
                 False))
        elif item in ("function_call", "function_call_output", "custom_tool_call",
                      "custom_tool_call_output"):
            add(("tool", _dumps(message), False))
        else:
            add(("user", _dumps(message), False))
        return
    # Most messages hold a role and a content only: their other fields are looked for
    # only when there are some.
    others = message.keys() - _ROLE_AND_CONTENT
    if others:
        for name in _REASONING_FIELDS:
            value = message.get(name)
            if isinstance(value, str) and value:
                add(("reasoning", value, False))
    content = message.get("content")
    if isinstance(content, str):
        _add_text(kind, content, add)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                add((kind, part, True))
            elif isinstance(part, dict):
                ptype = part.get("type")
                if ptype in ("thinking", "redacted_thinking", "reasoning"):
                    add(("reasoning", str(part.get("thinking") or part.get("data")
                                          or part.get("text") or ""), False))
                elif ptype in ("tool_use", "tool_result"):
                    add(("tool", _dumps(part), False))
                elif isinstance(part.get("text"), str):
                    _add_text(kind, part["text"], add)
    if not others:
        return
    calls = message.get("tool_calls")
    if calls:
        add((kind, _dumps(calls), False))
    if not others <= _MESSAGE_TEXT_FIELDS:  # its name, its tool call's id: a template
        # may render them too
        add((kind, _dumps({key: value for key, value in message.items()
                           if key not in _MESSAGE_TEXT_FIELDS}), False))


_KINDS = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
#: The fields of a chat message `_message_parts` reads as its parts' text, and its `type`
#: (a Responses "message" item), which no template renders.
_MESSAGE_TEXT_FIELDS = frozenset({"role", "type", "content", "reasoning_content", "reasoning",
                                  "thinking", "tool_calls"})
_ROLE_AND_CONTENT = frozenset({"role", "content"})
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def _add_text(kind: str, text: str, add: _Add) -> None:
    """A message's text; an answer that starts with its `<think>` block: the block is its
    reasoning (what the conversation says all the same: its content)."""
    if kind == "assistant" and text.startswith("<think>"):
        end = text.find("</think>")
        if end >= 0:
            end += len("</think>")
            add(("reasoning", text[:end], True))
            add((kind, text[end:], True))
            return
    add((kind, text, True))


def _texts(content: Any) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]


#: `json.dumps(value, ensure_ascii=False, separators=(",", ":"))` with its encoder made
#: once, not per call (several calls a message); a parsed body holds no cycle to look for.
_dumps = json.JSONEncoder(ensure_ascii=False, check_circular=False,
                          separators=(",", ":")).encode
