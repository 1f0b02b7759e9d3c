"""Server-sent-event framing for the gateway: keep-alives, errors, Responses ids.

Nothing here parses a chat stream: chat, completions and messages chunks are relayed as
bytes.  Only the head of a `/v1/responses` stream is read (to learn the upstream's
response id), and after that the id is swapped with one `bytes.replace` per chunk.
`EventFramer` makes sure that only whole events are sent, so that an error event can
always be appended cleanly and a stream cut mid-event never hands a client half of one.

`without_cache_figures` takes out of an answer what the engine's prompt cache held for
it (`timings`, the cached-token counts): every key shares that cache, so those figures
would tell one key how much of another key's prompt a guess matches.  What the key's
own earlier turn left there it may be told (`told`: the cached count is cut to it, not
to 0).  It parses only an event or body that names the cache (one byte search), in
practice the final one.
"""

from __future__ import annotations

import enum
import json
import secrets
import time
from typing import Any

__all__ = [
    "BrokenStream",
    "CACHE_MARKER",
    "DONE",
    "StreamKind",
    "EventFramer",
    "KEEPALIVE_COMMENT",
    "keepalive_note",
    "keepalive_waiting",
    "ResponsesRewriter",
    "data_event",
    "event_data",
    "event_ends",
    "final_payloads",
    "find_prompt_cache",
    "find_usage",
    "named_event",
    "new_response_id",
    "response_stub",
    "prompt_cache_in",
    "usage_in",
    "without_cache_figures",
]

KEEPALIVE_COMMENT = b": keep-alive\n\n"


def keepalive_waiting(reason: str) -> bytes:
    """A keep-alive comment that says why the request still waits ("prefill_budget",
    "key_concurrency")."""
    return b": keep-alive; waiting: " + reason.encode("ascii", "replace") + b"\n\n"


def keepalive_note(note: str) -> bytes:
    """A keep-alive comment that says how its request fares ("prefill 2048/6000 tokens,
    ETA 40 s"); a comment is one line: a line break in `note` would end it."""
    line = note.replace("\r", " ").replace("\n", " ")
    return b": keep-alive; " + line.encode("utf-8", "replace") + b"\n\n"


class StreamKind(enum.Enum):
    """The framing a gated route's stream uses, and so how its errors are written."""

    CHAT = "chat"  # chat/completions and completions: `data:` events ending in [DONE]
    MESSAGES = "messages"  # Anthropic messages: named events
    RESPONSES = "responses"  # OpenAI Responses: named events around one response id
DONE = b"data: [DONE]\n\n"
#: Every field by which llama-server tells what its prompt cache held names it: `timings`
#: (its `cache_n`), `cached_tokens`, `cache_read_input_tokens`, `tokens_cached`,
#: `prompt_progress` (its `cache`).  An event without these bytes is relayed unread.
CACHE_MARKER = b"cache"

#: Give up looking for the upstream's response.created after this many bytes.
_HEAD_LIMIT = 64 * 1024
#: How a Responses stream's last event begins.
_COMPLETED = b"event: response.completed"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def data_event(payload: Any) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\n" + data_event(payload)


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def response_stub(response_id: str, model: str | None, status: str = "in_progress",
                  created_at: int | None = None, **extra: Any) -> dict[str, Any]:
    """A Responses `response` object as far as the gateway knows it."""
    stub: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": status,
        "model": model or "",
        "output": [],
        "error": None,
        "incomplete_details": None,
    }
    stub.update(extra)
    return stub


class ResponsesRewriter:
    """Makes an upstream `/v1/responses` stream carry one response id from end to end.

    `our_id` is the id the client already saw in the gateway's own `response.created`
    (sent while the request waited), or None when nothing was sent yet.  The first data
    event of the upstream should be its `response.created`: it teaches the upstream id,
    and it is dropped when ours was sent (the client must not see a second, different
    one) or passed on unchanged otherwise.  Afterwards every occurrence of the upstream id
    is replaced by ours with one `bytes.replace` per chunk; events are otherwise relayed
    untouched and unparsed.  `feed` expects whole events (see `EventFramer`).

    The last event, `response.completed`, is held until the stream ends (`flush`): a
    client such as Codex CLI hangs up as soon as it has it, and the port must have read
    the upstream's end (and recorded the answer and its prompt cache) before that, or it
    takes the answer for one its client left (in 1 of 12 Codex turns, the Sessions tab
    missed the turn).  One substring search per chunk.
    """

    __slots__ = ("our_id", "upstream_id", "_head", "_learning", "_old", "_new", "_held")

    def __init__(self, our_id: str | None) -> None:
        self.our_id = our_id
        self.upstream_id: str | None = None
        self._head = b""
        self._learning = True
        self._old: bytes | None = None
        self._new = b""
        self._held = b""

    @property
    def client_id(self) -> str | None:
        """The response id the client has seen (or will see), if any."""
        return self.our_id or self.upstream_id

    def feed(self, chunk: bytes) -> bytes:
        if self._learning:
            chunk = self._learn(chunk)
        else:
            old = self._old
            if old is not None and old in chunk:
                chunk = chunk.replace(old, self._new)
        if self._held:  # events stay in order: what follows the last one waits with it
            self._held += chunk
            return b""
        at = _event_at(chunk, _COMPLETED)
        if at < 0:
            return chunk
        self._held = chunk[at:]
        return chunk[:at]

    def flush(self) -> bytes:
        """Whatever is held back at the end of the stream."""
        out = self._held + self._head
        self._head = self._held = b""
        self._learning = False
        return out

    def _learn(self, chunk: bytes) -> bytes:
        buf = self._head + chunk
        out: list[bytes] = []
        while True:
            end = _block_end(buf)
            if end < 0:
                if len(buf) > _HEAD_LIMIT:  # not an SSE stream we understand
                    self._learning = False
                    out.append(buf)
                    buf = b""
                self._head = buf
                return b"".join(out)
            block, buf = buf[:end], buf[end:]
            data = _data_of(block)
            if data is None:  # a comment or a blank block: pass on, keep looking
                out.append(block)
                continue
            self._learning = False
            self._head = b""
            upstream_id = _created_id(data)
            if upstream_id is None:
                # Not a response.created (an error, most likely): pass everything on.
                return b"".join(out) + block + buf
            self.upstream_id = upstream_id
            if self.our_id is None or self.our_id == upstream_id:
                return b"".join(out) + block + buf
            # Ours was sent: drop theirs and rewrite the rest.
            self._old = upstream_id.encode()
            self._new = self.our_id.encode()
            return b"".join(out) + buf.replace(self._old, self._new)


class BrokenStream(Exception):
    """The upstream's stream cannot be cut into whole events (see `EventFramer`)."""


class EventFramer:
    """Cuts a byte stream at SSE event boundaries, so that only whole events are sent.

    A chunk that ends an event (the usual case: llama-server writes whole events) costs
    one `endswith`.  A partial event is held until its end arrives, and never sent
    otherwise: an error event appended after an upstream failure never lands in the
    middle of another event, and a client never gets half an event it cannot parse.
    """

    __slots__ = ("_pending",)

    #: The largest event held whole.  llama-server's largest is a Responses stream's
    #: `response.completed`, which repeats the whole output (a few hundred KiB for a
    #: context's worth of tokens); past it the stream is broken (BrokenStream).
    LIMIT = 16 << 20

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes; BrokenStream past `LIMIT` pending bytes."""
        if self._pending:
            chunk = self._pending + chunk
            self._pending = b""
        if chunk.endswith(b"\n\n"):
            return chunk
        end = _block_end_last(chunk)
        if end < 0:
            if len(chunk) > self.LIMIT:
                raise BrokenStream("an event larger than the framer's limit")
            self._pending = chunk
            return b""
        self._pending = chunk[end:]
        return chunk[:end]

    def finish(self) -> bytes:
        """The end of the stream: blank lines still held; BrokenStream if an event
        started and did not end."""
        out, self._pending = self._pending, b""
        if out.strip(b"\r\n"):
            raise BrokenStream("the stream ended in the middle of an event")
        return out

    def drop(self) -> None:
        self._pending = b""


def event_ends(data: bytes) -> list[int]:
    """Where each whole event of `data` ends (exclusive), `data` starting at an event."""
    ends = []
    end = _block_end(data)
    while end >= 0:
        ends.append(end)
        end = _block_end(data, end)
    return ends


def event_data(block: bytes) -> bytes | None:
    """The data of a whole event (its `data:` lines joined); None for a comment."""
    return _data_of(block)


def _event_at(chunk: bytes, line: bytes) -> int:
    """Where the event with the line `line` begins in `chunk` (whole events); -1 if none.
    Only a line counts: text inside an event's data never starts one (JSON escapes its
    newlines)."""
    at = chunk.find(line)
    while at > 0 and chunk[at - 1] != 0x0A:  # not at a line's start
        at = chunk.find(line, at + 1)
    if at <= 0:
        return at
    return max((end for end in event_ends(chunk) if end <= at), default=0)


def _block_end(buf: bytes, start: int = 0) -> int:
    """End (exclusive) of the first complete event in `buf` from `start`, or -1."""
    # Called for every event a request's stream is read by (its first events, an error's
    # check, the end): two finds and no list.
    a = buf.find(b"\n\n", start)
    b = buf.find(b"\r\n\r\n", start)
    if b < 0:
        return a + 2 if a >= 0 else -1
    return b + 4 if a < 0 or b + 4 < a + 2 else a + 2


def _block_end_last(buf: bytes) -> int:
    """End (exclusive) of the last complete event in `buf`, or -1."""
    a = buf.rfind(b"\n\n")
    b = buf.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else -1, b + 4 if b >= 0 else -1)


def _data_of(block: bytes) -> bytes | None:
    lines = [line.rstrip(b"\r") for line in block.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].lstrip(b" ") for line in lines)


def _created_id(data: bytes) -> str | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") != "response.created":
        return None
    response = event.get("response")
    created = response.get("id") if isinstance(response, dict) else None
    return created if isinstance(created, str) and created else None


def without_cache_figures(data: bytes, *, stream: bool, told: int = 0) -> bytes:
    """`data` (whole events of a stream, or a JSON body) without what the engine's prompt
    cache held for the request: `timings` and `prompt_progress` left out (they also time
    the prompt: a cached prefix is read faster), cached-token counts made at most `told`
    (what the caller's own earlier turn left in the cache; 0: nothing).  Events and
    bodies that do not name the cache come back as they were (the same object)."""
    if CACHE_MARKER not in data:
        return data
    if not stream:
        return _scrubbed_json(data, told) or data
    parts: list[bytes] = []
    start = 0
    changed = False
    for line_end in _line_ends(data):
        line = data[start:line_end]
        if line.startswith(b"data:") and CACHE_MARKER in line:
            body = line[5:].rstrip(b"\r\n")
            scrubbed = _scrubbed_json(body, told)
            if scrubbed is not None:
                line = b"data: " + scrubbed + line[5 + len(body):]
                changed = True
        parts.append(line)
        start = line_end
    return b"".join(parts) if changed else data


def final_payloads(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects in `data` (a JSON body, or the tail of an event stream) that carry
    an answer's figures (`usage` or `timings`), the last first.  An exchange parses its
    answer's last bytes once, when it ends; `usage_in`, `prompt_cache_in` and the
    inspector's `figures_in` read what this found."""
    found = []
    for block in reversed(data.split(b"\n")):
        if b'"usage"' not in block and b'"timings"' not in block:
            continue
        text = block[5:] if block.startswith(b"data:") else block
        try:
            payload = json.loads(text)
        except ValueError:
            continue
        if isinstance(payload, dict):
            found.append(payload)
    return found


def usage_in(payloads: list[dict[str, Any]]) -> tuple[int | None, int | None] | None:
    """(prompt, completion) tokens from the last `usage` an answer carries (its
    `final_payloads`: chat's final chunk, Responses' `response.completed`, Anthropic's
    `message_start` and `message_delta`, or a body).  None when it says nothing, and None
    for the prompt when only the completion is said (an Anthropic stream names its prompt
    in its first event only).  The prompt is all of it, also the tokens the engine's cache
    held (which Anthropic's `input_tokens` leave out)."""
    prompt = completion = None
    for payload in payloads:
        told_prompt, told_completion = _usage_of(payload)
        if completion is None:
            completion = told_completion
        if prompt is None:
            prompt = told_prompt
        if prompt is not None and completion is not None:
            break
    if prompt is None and completion is None:
        return None
    return prompt, completion


def prompt_cache_in(payloads: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(cached, computed) prompt tokens from the last answer's figures (its
    `final_payloads`): llama-server's `timings` (`cache_n`, `prompt_n`), else a usage that
    says its cached tokens (OpenAI's `prompt_tokens_details`, Anthropic's
    `cache_read_input_tokens`).  None when it says neither."""
    for payload in payloads:
        found = _prompt_cache_of(payload)
        if found is not None:
            return found
    return None


def find_usage(data: bytes) -> tuple[int | None, int | None] | None:
    """`usage_in` of the answer's last bytes `data`."""
    return usage_in(final_payloads(data))


def find_prompt_cache(data: bytes) -> tuple[int, int] | None:
    """`prompt_cache_in` of the answer's last bytes `data`."""
    return prompt_cache_in(final_payloads(data))


def _prompt_cache_of(payload: Any) -> tuple[int, int] | None:
    if not isinstance(payload, dict):
        return None
    timings = payload.get("timings")
    if isinstance(timings, dict):
        cached, computed = _count(timings, "cache_n"), _count(timings, "prompt_n")
        if cached is not None and computed is not None:
            return cached, computed
    for holder in (payload, payload.get("response"), payload.get("message")):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if not isinstance(usage, dict):
            continue
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        prompt = _count(usage, "prompt_tokens")
        if prompt is None and isinstance(details, dict):
            prompt = _count(usage, "input_tokens")
        if isinstance(details, dict) and prompt is not None:
            cached = _count(details, "cached_tokens")
            if cached is not None:
                return cached, max(0, prompt - cached)
        read = _count(usage, "cache_read_input_tokens")
        told = _count(usage, "input_tokens")
        if read is not None and told is not None:
            return read, told
    return None


def _usage_of(payload: Any) -> tuple[int | None, int | None]:
    """(prompt, completion) as one event or body says them; None for what it does not."""
    if not isinstance(payload, dict):
        return None, None
    prompt = completion = None
    for holder in (payload, payload.get("response"), payload.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            usage: dict[str, Any] = holder["usage"]
            # Anthropic's message_start says its output_tokens before there are any.
            if payload.get("type") != "message_start":
                completion = _count(usage, "completion_tokens", "output_tokens")
            prompt = _count(usage, "prompt_tokens")
            if prompt is None:
                prompt = _count(usage, "input_tokens")
                if prompt is not None:  # Anthropic's leave out what the cache held
                    prompt += sum(_count(usage, name) or 0 for name in _ANTHROPIC_CACHED)
            break
    # llama-server's streams carry no `usage` unless asked (stream_options), and
    # Anthropic's last one no prompt, but their last chunk has its `timings`: the
    # prompt's new and cached tokens, and the reply's.
    timings = payload.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        if prompt is None:
            prompt = sum(n for n in (timings.get("prompt_n"), timings.get("cache_n"))
                         if isinstance(n, int) and n > 0)
        if completion is None:
            completion = _count(timings, "predicted_n")
    return prompt, completion


#: What Anthropic's usage counts of the prompt beside its `input_tokens`.
_ANTHROPIC_CACHED = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _count(usage: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


# --- the prompt cache's figures ------------------------------------------------------------

_CACHE_OBJECTS = frozenset({"timings", "prompt_progress"})
_CACHE_COUNTS = frozenset({"cached_tokens", "cache_read_input_tokens", "tokens_cached"})


def _line_ends(data: bytes) -> list[int]:
    """Where each line of `data` ends (exclusive, after its newline; the last line may
    have none)."""
    ends = []
    at = data.find(b"\n")
    while at >= 0:
        ends.append(at + 1)
        at = data.find(b"\n", at + 1)
    if not ends or ends[-1] < len(data):
        ends.append(len(data))
    return ends


def _scrubbed_json(text: bytes, told: int = 0) -> bytes | None:
    """`text` (JSON) encoded again without the cache's figures (cached counts at most
    `told`); None when it is not JSON or holds none of them."""
    try:
        payload = json.loads(text)
    except ValueError:
        return None
    return _dumps(payload) if _scrub(payload, told) else None


def _scrub(value: Any, told: int = 0) -> bool:
    """Take the cache's figures out of `value` in place, cached counts cut to `told`;
    whether there were any."""
    changed = False
    if isinstance(value, dict):
        for name in list(value):
            if name in _CACHE_OBJECTS:
                del value[name]
                changed = True
            elif name in _CACHE_COUNTS:
                cached = value[name]
                shown = min(cached, told) if _is_count(cached) else 0
                if cached != shown:
                    value[name] = shown
                    changed = True
                    # Anthropic's input_tokens are the prompt's tokens the cache did not
                    # hold: those it is not told of count among them.
                    computed = value.get("input_tokens")
                    if name == "cache_read_input_tokens" and _is_count(computed) and _is_count(cached):
                        value["input_tokens"] = computed + cached - shown
            elif isinstance(value[name], (dict, list)):
                changed = _scrub(value[name], told) or changed
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                changed = _scrub(item, told) or changed
    return changed


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
