"""What a request says about itself beside its need: its `Hint`, read once by the gateway
and kept by its ticket without its parsed body; placement reads it
(`backend.admission.placement`).

A hint names the request's flow; its session (a client's `prompt_cache_key`, or a session
header, `SESSION_HEADERS`, else a digest of the conversation's start: its instructions
and first user message), scoped to its flow so that no caller can name another's session;
and a digest of its prompt's first blocks, seeded with the flow, so that no caller's
prompt can match another's.  Both read what the conversation says as the gateway read it
once (`backend.admission.prompt.Prompt.said`: each message's role and texts, not the
tools), never the body again.  Pure: no I/O.

A session's name is bounded here, once (`bounded_name`): a client's name of at most
`SESSION_NAME_CHARS` printable characters is kept as given, any other becomes a digest of
it ("sha256:" and 32 hex digits).  The hint's form is the one the session book, the
parked files, the inspector's records and the exported spans keep: a
client that names its session with megabytes holds no more of the port than one that
names it "agent-7".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from backend.admission.prompt import ROLE, Prompt, read_prompt

__all__ = ["NO_HINT", "PREFIX_BLOCK_CHARS", "PREFIX_BLOCKS", "SESSION_HEADERS",
           "SESSION_NAME_CHARS", "Hint", "bounded_name", "request_hint"]

#: Characters of prompt text per block of the prefix digest.
PREFIX_BLOCK_CHARS = 1024
#: Blocks of the prompt's beginning the digest covers (the first few KB).
PREFIX_BLOCKS = 4
#: Headers that name a client's session, in order of preference (lower case): OpenCode's
#: affinity and session ids; Codex CLI's thread (0.171 sends `session-id` and `thread-id`,
#: the same id as its body's `prompt_cache_key`; older ones `session_id`,
#: `conversation_id`); Claude Code's.
SESSION_HEADERS = (b"x-session-affinity", b"x-session-id", b"session_id", b"session-id",
                   b"thread-id", b"conversation_id", b"x-claude-code-session-id")
#: The longest session name kept as the client gave it (longer ones become a digest).
SESSION_NAME_CHARS = 128
#: Hex digits of a long name's SHA-256 kept in its digest (128 bits: no two collide).
_NAME_DIGEST_HEX = 32
_SESSION_HEADER_SET = frozenset(SESSION_HEADERS)
#: Characters of a conversation's start read for its session digest, at most.
_SESSION_DIGEST_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class Hint:
    """What a request says about itself beside its need."""

    #: Its session, scoped to its flow ("flow\\nkey"); None: it names none and its prompt
    #: has no text to name it by.
    session: str | None = None
    #: Chained hashes of the prompt text's first blocks, seeded with the flow (each names
    #: the whole prefix up to its block's end); only meaningful within this process.
    prefix: tuple[int, ...] = ()
    #: Whose request it is (its flow's key).
    flow: str = ""
    #: Does the engine honour an `id_slot` in it?  Not on `/v1/messages`: llama-server's
    #: Anthropic conversion keeps only its own fields (`seat.seat_on`).
    pinnable: bool = True


NO_HINT = Hint()


def request_hint(flow: str, headers: Iterable[tuple[bytes, bytes]],
                 data: Mapping[str, Any], *, pinnable: bool = True,
                 prompt: Prompt | None = None) -> Hint:
    """The hint of a request from flow `flow` with these headers and parsed body (on a
    route whose requests the engine pins to a slot, or not).  `prompt`: the body's
    prompt as the gateway read it (`read_prompt(data)`, read here when not given)."""
    session = data.get("prompt_cache_key")
    if isinstance(session, str) and session:
        session = bounded_name(session)
    else:
        session = _session_header(headers)
    if prompt is None:
        prompt = read_prompt(data)
    prefix, named = _read_said(flow, prompt, session is None)
    if session is None:
        session = named
    if session is None and not prefix:
        return NO_HINT if pinnable else Hint(pinnable=False)
    return Hint(None if session is None else f"{flow}\n{session}", prefix, flow, pinnable)


def bounded_name(name: str) -> str:
    """A client's name for something the port keeps (its session): as given when it has
    at most `SESSION_NAME_CHARS` characters, all printable; else "sha256:" and the first
    32 hex digits of its UTF-8 digest (the same in every process: a parked prefix is
    found by its session's name after a restart)."""
    if len(name) <= SESSION_NAME_CHARS and name.isprintable():
        return name
    return _name_digest(name.encode("utf-8", "surrogatepass"))


# --- helpers ---------------------------------------------------------------------------


def _session_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered in _SESSION_HEADER_SET and value:
            found.setdefault(lowered, value)
    if not found:
        return None
    for name in SESSION_HEADERS:
        if name in found:
            value = found[name]
            if len(value) <= SESSION_NAME_CHARS:  # a long one is never decoded
                text = value.decode("latin-1")
                if text.isprintable():
                    return text
            return _name_digest(value)
    return None


def _name_digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:_NAME_DIGEST_HEX]


def _read_said(flow: str, prompt: Prompt, name: bool) -> tuple[tuple[int, ...], str | None]:
    """What the conversation says (`Prompt.said`), read in one walk for both: the chained
    hashes of `PREFIX_BLOCK_CHARS`-character blocks of its first `PREFIX_BLOCKS` blocks
    (a short last block counts too), seeded with the flow; and when `name`, a session
    name for a client that gives none: a digest of its conversation's start, the prompt's
    text up to the end of its first user message (what stays the same turn after turn; a
    shared head of instructions alone would merge sessions); None when it says nothing,
    or without `name`."""
    # blake2b, not hash(): the name must be the same in the next process (a session's
    # parked prefix is found by it after a restart).
    limit = PREFIX_BLOCK_CHARS * PREFIX_BLOCKS
    texts: list[str] = []
    size = 0
    digest = hashlib.blake2b(digest_size=8) if name else None
    named = 0  # characters digested
    seen_user = False
    digest_text: str | None = None
    for kind, text, said in prompt.parts:
        if kind == ROLE:
            text = f"\x1e{text}\x1f"
        elif not said:
            continue
        if size < limit:
            texts.append(text)
            size += len(text)
        if digest is not None:
            if seen_user and text.startswith("\x1e"):
                digest_text = _finish(digest, named)
                digest = None  # the next message's role mark: the first user message ended
            else:
                if text == "\x1euser\x1f":
                    seen_user = True
                digest.update(text.encode("utf-8", "surrogatepass"))
                digest.update(b"\x00")
                named += len(text)
                if named >= _SESSION_DIGEST_CHARS:
                    digest_text = _finish(digest, named)
                    digest = None
        elif size >= limit:
            break
    if digest is not None:
        digest_text = _finish(digest, named)
    return _chained(flow, texts, size), digest_text


def _finish(digest: Any, size: int) -> str | None:
    return f"#{digest.hexdigest()}" if size else None


def _chained(flow: str, texts: list[str], size: int) -> tuple[int, ...]:
    if not size:
        return ()
    limit = PREFIX_BLOCK_CHARS * PREFIX_BLOCKS
    text = "".join(texts)[:limit]
    digest: list[int] = []
    chained = hash(flow)
    for start in range(0, len(text), PREFIX_BLOCK_CHARS):
        chained = hash((chained, text[start:start + PREFIX_BLOCK_CHARS]))
        digest.append(chained)
    return tuple(digest)
