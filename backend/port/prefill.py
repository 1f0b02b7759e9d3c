"""A prompt being read: the engine's progress on it, and what its client sees meanwhile.

llama-server sends a streamed request nothing but its headers until it has read the whole
prompt (minutes for an agent's first turn on a CPU), unless the request asks for
`return_progress` (tools/server/README.md of the pinned llama.cpp: the progress "contained
inside `prompt_progress` with 4 values: `total`, `cache`, `processed`, and `time_ms`"),
which the port does for every stream it forwards (`backend.port.forwarding`).  Each step
of the prompt then sends an event that carries it (server-task.cpp: a chunk with a
role-only delta on chat, an empty text on completions, a `response.in_progress` after
the engine's own `response.created` on the Responses wire; the Anthropic wire leaves it
out, `to_json_anthropic`), and a silence of 30 s gets a `:` comment
(`--sse-ping-interval`).

`until_content` reads those until the answer's first event of content, which it puts back
for the relay (`UpstreamResponse.unread`): none of them reaches the client, whose
keep-alives go on every interval as while it waited, with the progress in them
(`PrefillProgress.describe`: `: keep-alive; prefill 2048/6000 tokens, ETA 40 s`).  Before
this the engine's first ping ended the port's keep-alives: a comment, which Codex does not
count (bench/README.md, watchdogs), then silence until the first token.  The progress
also goes into the request's inspector record and its live row (`backend.port.live_rows`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from backend.port import sse

if TYPE_CHECKING:
    from backend.port.upstream_http import UpstreamResponse

__all__ = ["PROGRESS_FIELD", "PrefillProgress", "Reading", "progress_of", "until_content"]

#: The body field that asks llama-server for its progress, and the event field telling it.
PROGRESS_FIELD = "return_progress"
_PROGRESS = b'"prompt_progress"'
#: The most of a stream's head held while looking for whole events (llama-server's are
#: small; past it the stream is not one this reads, and goes to the relay as it is).
_HEAD_LIMIT = 64 * 1024
#: The engine's own Responses events that only say it started (the port sends its own).
_STARTED = frozenset({"response.created", "response.in_progress"})


class Reading(Protocol):
    """The stream whose prompt is read (`backend.port.stream_relay.StreamRelay`)."""

    progress: PrefillProgress | None
    rewriter: sse.ResponsesRewriter | None


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """How far the engine has read a prompt, as its last progress event said."""

    #: The prompt's tokens, those its cache held, and those read so far (cached included).
    total: int
    cached: int
    processed: int
    #: Seconds the engine has spent reading it.
    elapsed: float
    #: When it said so (`time.monotonic`).
    at: float

    def eta(self, now: float | None = None) -> float | None:
        """Seconds until the whole prompt is read at the speed so far (from `now`, when
        given); None while no speed is known."""
        computed = self.processed - self.cached
        if computed <= 0 or self.elapsed <= 0:
            return None
        left = max(0, self.total - self.processed) * self.elapsed / computed
        if now is not None:
            left -= now - self.at
        return max(0.0, left)

    def describe(self, *, tokens: bool = True, now: float | None = None) -> str:
        """"prefill 2048/6000 tokens, ETA 40 s"; without `tokens` its share of what is
        computed instead ("prefill 30%"): the counts would tell what the shared cache
        held, which a named key is never told."""
        if tokens:
            text = f"prefill {self.processed}/{self.total} tokens"
        else:
            computed = max(1, self.total - self.cached)
            share = min(100, max(0, 100 * (self.processed - self.cached) // computed))
            text = f"prefill {share}%"
        eta = self.eta(now)
        return text if eta is None else f"{text}, ETA {eta:.0f} s"


def progress_of(payload: Any, at: float | None = None) -> PrefillProgress | None:
    """The `prompt_progress` of an event's payload, if it carries a sound one."""
    told = payload.get("prompt_progress") if isinstance(payload, dict) else None
    if not isinstance(told, dict):
        return None
    numbers: list[float] = []
    for name in ("total", "cache", "processed", "time_ms"):
        number = told.get(name)
        if not isinstance(number, (int, float)) or isinstance(number, bool) or number < 0:
            return None
        numbers.append(number)
    total, cached, processed, time_ms = numbers
    return PrefillProgress(int(total), int(cached), int(processed), float(time_ms) / 1000,
                           time.monotonic() if at is None else at)


async def until_content(upstream: UpstreamResponse, stream: Reading,
                        keepalive: Callable[[], Awaitable[None]], interval: float) -> None:
    """Returns once the engine's answer has begun (its first event of content, its end,
    or an error, put back for the relay), sending `keepalive()` every `interval` seconds
    (0: never) until then; the engine's progress goes to `stream.progress`, its own
    `response.created` to the stream's rewriter (which learns its id and drops it: the
    port's own went first, sent here if no keep-alive was yet)."""
    loop = asyncio.get_running_loop()
    due = loop.time() + interval if interval > 0 else None
    head = b""
    created = False  # the engine's `response.created` came last
    while True:
        if not await upstream.arrived(None if due is None else max(due - loop.time(), 0.0)):
            await keepalive()
            due = loop.time() + interval
            continue
        data = upstream.read()
        if data is None:  # the end (or an error) with nothing more: the relay says which
            upstream.unread(head)
            return
        buffer = head + data
        start = 0
        for end in sse.event_ends(buffer):
            block = buffer[start:end]
            started = _prefill_event(block, stream)
            if started is None:
                upstream.unread(buffer[start:])
                return
            if started and stream.rewriter is not None:
                if stream.rewriter.our_id is None:
                    await keepalive()  # ours first: the client sees one id
                    if due is not None:
                        due = loop.time() + interval
                stream.rewriter.feed(block)
            elif created and stream.rewriter is not None:
                # The engine's `response.in_progress` after its `response.created`: ours
                # in its place, so the stream has the shape it would have had.
                await keepalive()
                if due is not None:
                    due = loop.time() + interval
            created = bool(started)
            start = end
        head = buffer[start:]
        if len(head) > _HEAD_LIMIT:
            upstream.unread(head)
            return


def _prefill_event(block: bytes, stream: Reading) -> bool | None:
    """What a whole event before the answer is: None, the answer's first (content, an
    error, the end); True the engine's `response.created`; False anything else it
    sends while it reads the prompt (progress, pings, its `response.in_progress`), its
    progress noted in `stream.progress`."""
    data = sse.event_data(block)
    if data is None:
        return False  # a comment (the engine's ping) or a blank block
    responses = stream.rewriter is not None
    if _PROGRESS not in data and not responses:
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    progress = progress_of(payload)
    if progress is not None:
        stream.progress = progress
    kind = payload.get("type") if responses and isinstance(payload, dict) else None
    if kind in _STARTED:
        return bool(kind == "response.created")
    return False if progress is not None else None
