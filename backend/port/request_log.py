"""The port's request inspector: a bounded ring of what recent requests cost and why.

One `RequestRecord` per gated request that ended (answered, refused, failed, or left by
its client): who sent it (its key's name, its session), where it ran (model, engine,
slot, band), how long it waited and why (admission's `WaitReason`), and how the engine
spent its time (prompt tokens, how many of them its cache held, prefill, time to first
token, tokens per second, the longest silence between two chunks).  Nothing of a request's
content is ever kept: only names, numbers and codes.

`RequestLog` keeps the last `capacity` records, each with an id that only grows, so a
reader that polls asks for the records after the last id it saw (`after`); the requests
still under way have records of their own, made when asked (`under_way`, id 0, status
0: where each stands, and how far the engine has read its prompt, with an ETA).  Its
`exporter`, when set, hears each new record with the client's W3C `traceparent`
(`backend.port.tracing`: OpenTelemetry, off by default).  A named
key's reader sees its own records only, and of them nothing the shared prompt cache
told (`RequestRecord.for_named_key`): as in its answers, the cache's figures would tell
one key how much of another key's prompt a guess matches.

The engine's figures are read once per request from the answer's last bytes, parsed once
(`figures_in` of `sse.final_payloads`), never per chunk.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Iterable, NamedTuple

from backend.port.sse import final_payloads

__all__ = ["DEFAULT_CAPACITY", "EngineFigures", "NO_FIGURES", "RequestLog", "RequestRecord",
           "engine_figures", "figures_in"]

log = logging.getLogger("gguf_studio.gateway")

#: Records kept by default: a few minutes of a busy team's traffic, about 1 MB.
DEFAULT_CAPACITY = 2000


class EngineFigures(NamedTuple):
    """What the engine said of one answer (its `timings`, its `usage`)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    prefill_ms: float | None = None
    tokens_per_second: float | None = None


NO_FIGURES = EngineFigures()


class RequestRecord(NamedTuple):
    """One request, as the inspector shows it.  Times are seconds; None: not known (the
    request never got that far, or the engine did not say).  A tuple of plain values,
    which the garbage collector stops tracking: the ring holds thousands, and a record
    is made for every request."""

    #: Its place in the ring: ids only grow.
    id: int
    #: When it arrived (seconds since the epoch).
    time: float
    #: The route, e.g. "/v1/chat/completions".
    route: str
    #: Its key's name ("owner", a named key, or "anonymous").
    key: str
    #: The session its client named (`prompt_cache_key` or a session header), if any.
    session: str | None = None
    model: str | None = None
    #: The engine's public name ("this machine", "upstream N").
    engine: str | None = None
    slot: int | None = None
    #: "interactive", "normal" or "batch".
    band: str | None = None
    stream: bool = False
    #: Seconds from arrival until it ran (its model's load included).
    wait: float = 0.0
    #: Why it waited (a `WaitReason`); None when it did not.
    wait_reason: str | None = None
    #: With `FAIR_SHARE`: the key whose request went first.
    waited_behind: str | None = None
    prompt_tokens: int | None = None
    #: Of the prompt: what the engine's cache held, and what it computed.
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    #: Why a prompt the session had sent before was recomputed, when it was.
    cache_miss: str | None = None
    output_tokens: int | None = None
    #: The engine's time reading the prompt, in milliseconds.
    prefill_ms: float | None = None
    #: Seconds from arrival to the engine's first bytes.
    time_to_first_token: float | None = None
    tokens_per_second: float | None = None
    #: The longest silence between two chunks of the answer, in seconds.
    longest_gap: float | None = None
    #: The HTTP status the client got (499: it left first; 0 while it is under way).
    status: int = 200
    #: The error's code ("rate_limit_exceeded", ...), when it ended with one.
    error: str | None = None
    #: Of its prompt, the tokens the engine had read (its cache's included) when it
    #: ended before its answer began, or while it runs (`RequestLog.in_flight`).
    prefilled: int | None = None
    #: While the engine reads its prompt: seconds until it is read, at its speed so far.
    prefill_eta: float | None = None
    #: Its client left before its answer began and sent it again: what the resend
    #: joined instead of starting over (`backend.port.resends`), "a running request"
    #: or "a finished answer".
    joined: str | None = None

    def for_named_key(self) -> RequestRecord:
        """This record as its own named key may read it: nothing the shared prompt cache
        told (cached tokens, prefill time, the prompt read at once), nor the other key it
        waited behind."""
        return self._replace(cached_tokens=None, computed_tokens=None, cache_miss=None,
                             prefill_ms=None, waited_behind=None, prefilled=None)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        """A record as `to_dict` wrote it (fields it does not know are left out)."""
        names = cls._fields
        return cls(**{name: value for name, value in data.items() if name in names})


#: Hears each new record, with the `traceparent` its client sent (if any).
Exporter = Callable[[RequestRecord, "str | None"], None]


class RequestLog:
    """The last `capacity` records, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"capacity is a whole number, at least 1, not {capacity!r}")
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=capacity)
        self._last_id = 0
        #: The last id of the records restored from an earlier run (`restore`).
        self._restored_id = 0
        self._clock = clock
        #: Set to export each record as it comes (None: nothing is exported).
        self.exporter: Exporter | None = None
        #: The records of the requests under way (`backend.port.in_flight`), set by the
        #: port that serves them.
        self.in_flight: Callable[[], Iterable[RequestRecord]] = tuple

    @property
    def last_id(self) -> int:
        return self._last_id

    @property
    def since_start(self) -> int:
        """Records added since this ring started (those restored not counted)."""
        return self._last_id - self._restored_id

    def restore(self, records: Iterable[RequestRecord]) -> None:
        """Hold `records` (an earlier run's, oldest first) before any new one; the next
        ids follow theirs."""
        for record in records:
            if record.id > self._last_id:
                self._records.append(record)
                self._last_id = self._restored_id = record.id

    def add(self, *, traceparent: str | None = None, **fields: Any) -> RequestRecord:
        """Keep a record of these fields (see `RequestRecord`); its id is the next one,
        its time now unless given.  The exporter, if any, gets it with `traceparent`."""
        self._last_id += 1
        fields.setdefault("time", self._clock())
        record = RequestRecord(id=self._last_id, **fields)
        self._records.append(record)
        if self.exporter is not None:
            try:
                self.exporter(record, traceparent)
            except Exception:  # an export that fails never fails the request
                log.exception("exporting a request's span failed")
        return record

    def records(self, *, after: int = 0, key: str | None = None,
                limit: int | None = None) -> list[RequestRecord]:
        """The records with an id above `after`, oldest first; only key `key`'s when
        given, each then as a named key may read it; the newest `limit` of them."""
        chosen: Iterable[RequestRecord] = (r for r in self._records if r.id > after)
        if key is not None:
            chosen = (r.for_named_key() for r in chosen if r.key == key)
        found = list(chosen)
        return found[-limit:] if limit else found


    def under_way(self, *, key: str | None = None) -> list[RequestRecord]:
        """The records of the requests under way (status 0), oldest first; only key
        `key`'s when given, each then as a named key may read it."""
        records = sorted(self.in_flight(), key=lambda record: record.time)
        if key is None:
            return records
        return [record.for_named_key() for record in records if record.key == key]


def engine_figures(*parts: bytes) -> EngineFigures:
    """The engine's figures from an answer's last bytes (a JSON body, or the tail of an
    event stream; for an Anthropic stream its first event first)."""
    return figures_in(final_payloads(b"".join(parts)))


def figures_in(payloads: list[dict[str, Any]]) -> EngineFigures:
    """The engine's figures from an answer's `final_payloads`: the last `timings` it
    carries, and each `usage` field as the last usage naming it says it (an Anthropic
    stream names its prompt in `message_start`, its output in the `message_delta` after)."""
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] = {}
    for payload in payloads:
        if timings is None and isinstance(payload.get("timings"), dict):
            timings = payload["timings"]
        told = _usage_of(payload)
        if told is not None:
            for name, value in told.items():
                usage.setdefault(name, value)
    return _figures(timings or {}, usage)


# --- helpers ------------------------------------------------------------------------------

def _usage_of(payload: dict[str, Any]) -> dict[str, Any] | None:
    for holder in (payload, payload.get("response"), payload.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            usage: dict[str, Any] = holder["usage"]
            return usage
    return None


def _figures(timings: dict[str, Any], usage: dict[str, Any]) -> EngineFigures:
    computed = _count(timings.get("prompt_n"))
    cached = _count(timings.get("cache_n"))
    prompt = None if computed is None else computed + (cached or 0)
    if prompt is None:
        prompt = _count(usage.get("prompt_tokens"))
        if prompt is None:
            prompt = _count(usage.get("input_tokens"))
            read = _count(usage.get("cache_read_input_tokens"))
            if prompt is not None and read is not None:
                prompt += read
    if cached is None:
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is None:
            cached = _count(usage.get("cache_read_input_tokens"))
    output = _count(timings.get("predicted_n"))
    if output is None:
        output = _count(usage.get("completion_tokens"))
        if output is None:
            output = _count(usage.get("output_tokens"))
    return EngineFigures(prompt_tokens=prompt, cached_tokens=cached, output_tokens=output,
                         prefill_ms=_number(timings.get("prompt_ms")),
                         tokens_per_second=_number(timings.get("predicted_per_second")))


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None
