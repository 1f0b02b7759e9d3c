"""A caller's limits at the port: which models its key may use, its flow in the fair
queue (band, weight, concurrency), its token windows, and its usage.

The gateway asks `FlowControl` once per request for a `Pass` (`enter`: the key may use
the model; its flow), and the relay holds that pass as it holds the request's ticket:
`start` when it runs, `reserve` its tokens (per minute and per day, counted from the
reservation) before it waits, `admitted` when it gets a slot, then one ending —
`answered` with the engine's usage (which settles the reservation), `refused` by reason,
or `left` before its turn — and `close`.  A refusal before a pass exists is told to
`FlowControl.refused`.  It decides and counts; it does no I/O (the usage ledger it feeds
saves itself, off the hot path).

It also knows which requests of each named key are under way (from `start` to
`close`), so that a key revoked or deleted while they run ends them (`end_flow`)
instead of letting them take the engine for as long as they like.
"""

from __future__ import annotations

from typing import Protocol

from backend.errors import ModelNotAllowed, RequestError
from backend.keys.key_store import KeyRecord, Priority
from backend.admission.caller import Caller
from backend.admission.flow import Band, Flow
from backend.admission.rate_limits import RateLimiter, Reservation, TokenLimits

__all__ = ["BAND_HEADER", "Endable", "FlowControl", "Pass", "UsageRecorder", "key_band",
           "requested_band"]

#: A request may lower its own priority with this header (never raise it).
BAND_HEADER = b"x-priority"

_BANDS = {Priority.INTERACTIVE: Band.INTERACTIVE, Priority.NORMAL: Band.NORMAL,
          Priority.BATCH: Band.BATCH}


class UsageRecorder(Protocol):
    """Where usage per key goes (backend.keys.usage.UsageLedger)."""

    def record_request(self, key: str, prompt_tokens: int, completion_tokens: int) -> None: ...

    def record_wait(self, key: str, seconds: float) -> None: ...

    def record_refusal(self, key: str, reason: str) -> None: ...


class Endable(Protocol):
    """A request under way that can be ended (backend.port.relay.Exchange)."""

    def end(self, error: RequestError) -> bool:
        """End it with `error` (an HTTP answer, or an in-stream error event); True if it
        will end."""


class FlowControl:
    """The limits of keys at admission, and their usage; see the module docstring."""

    def __init__(self, limiter: RateLimiter | None = None,
                 usage: UsageRecorder | None = None) -> None:
        self.limiter = limiter or RateLimiter()
        self.usage = usage
        self._flows: dict[tuple[str, KeyRecord | None], Flow] = {}
        #: The requests under way of each named key (the owner's and keyless callers have
        #: nothing to be revoked).
        self._running: dict[str, set[Endable]] = {}

    def enter(self, caller: Caller, model: str) -> "Pass":
        """The pass of a request of `caller` for `model`: ModelNotAllowed when its key
        may not use it."""
        self.check_model(caller, model)
        return Pass(self, caller, self.flow_of(caller))

    def check_spent(self, caller: Caller) -> None:
        """RateLimitExceeded when the caller's token windows are spent (before a load,
        whose prompt cannot be counted yet, only a spent window is certain)."""
        reservation = self.reserve(caller, 1)
        if reservation is not None:
            self.limiter.settle(reservation, 0)

    def check_model(self, caller: Caller, model: str) -> None:
        if caller.key is not None and not caller.key.allows(model):
            allowed = ", ".join(caller.key.models)
            raise ModelNotAllowed(f"The key {caller.key.name!r} may not use the model "
                                  f"{model!r}; it may use: {allowed}.", param="model")

    def flow_of(self, caller: Caller) -> Flow:
        """The caller's flow: its key's weight, band and concurrency (remade when the
        key is edited: the record is part of the cache key)."""
        cache_key = (caller.flow, caller.key)
        flow = self._flows.get(cache_key)
        if flow is None:
            record = caller.key
            flow = Flow(caller.flow) if record is None or record.is_owner else Flow(
                caller.flow, weight=record.weight, band=key_band(record),
                max_concurrent=record.max_concurrent or 0)
            if len(self._flows) > 4096:  # addresses come and go: keep the cache bounded
                self._flows.clear()
            self._flows[cache_key] = flow
        return flow

    def reserve(self, caller: Caller, tokens: int) -> Reservation | None:
        """Count `tokens` against the caller's key's windows, or raise RateLimitExceeded
        (429 saying which limit, with Retry-After and OpenAI's x-ratelimit headers)."""
        limits = self._limits(caller)
        if limits is None:
            return None
        return self.limiter.reserve(caller.flow, limits, tokens)

    def headers(self, caller: Caller) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for an answer to the caller (none without
        limits)."""
        limits = self._limits(caller)
        return {} if limits is None else self.limiter.headers(caller.flow, limits)

    def admitted(self, caller: Caller, waited: float) -> None:
        if self.usage is not None:
            self.usage.record_wait(caller.name, waited)

    def answered(self, caller: Caller, reservation: Reservation | None,
                 usage: tuple[int, int] | None) -> None:
        """The request ended: `usage` is the engine's (prompt, completion) tokens, None
        when it did not say (the reservation then stays counted in full)."""
        if reservation is not None:
            self.limiter.settle(reservation, reservation.tokens if usage is None else sum(usage))
        if self.usage is not None:
            prompt, completion = usage or (0, 0)
            self.usage.record_request(caller.name, prompt, completion)

    def started(self, caller: Caller, request: Endable) -> None:
        """`request` of `caller` is under way (waiting or answering) until `finished`."""
        if caller.key is not None and not caller.key.is_owner:
            self._running.setdefault(caller.flow, set()).add(request)

    def finished(self, caller: Caller, request: Endable) -> None:
        running = self._running.get(caller.flow)
        if running is not None:
            running.discard(request)
            if not running:
                del self._running[caller.flow]

    def running_flows(self) -> set[str]:
        """The named keys' flows with a request under way."""
        return set(self._running)

    def end_flow(self, flow: str, error: RequestError) -> int:
        """End every request under way of `flow` with `error` (its key was revoked, has
        expired or was deleted); how many will end."""
        return sum(request.end(error) for request in list(self._running.get(flow, ())))

    def refused(self, caller: Caller, error: RequestError,
                reservation: Reservation | None = None) -> None:
        if reservation is not None:
            self.limiter.settle(reservation, 0)
        if self.usage is not None:
            self.usage.record_refusal(caller.name, getattr(error, "reason", None) or error.code)

    def _limits(self, caller: Caller) -> TokenLimits | None:
        record = caller.key
        if record is None:
            return None
        limits = TokenLimits.of(record)
        return None if limits.unlimited else limits


class Pass:
    """One request's way through its caller's limits; see the module docstring.  Its
    ending is told once: a second `answered`, `refused` or `left` changes nothing."""

    __slots__ = ("caller", "flow", "reservation", "_control", "_request", "_ended")

    def __init__(self, control: FlowControl, caller: Caller, flow: Flow) -> None:
        self.caller = caller
        #: Its flow in the fair queue.
        self.flow = flow
        #: Its tokens counted against the key's windows (None: no limits, or not yet).
        self.reservation: Reservation | None = None
        self._control = control
        self._request: Endable | None = None
        self._ended = False

    def start(self, request: Endable) -> None:
        """`request` runs (waiting or answering) until `close`; a revoked key ends it."""
        self._request = request
        self._control.started(self.caller, request)

    def close(self) -> None:
        if self._request is not None:
            self._control.finished(self.caller, self._request)
            self._request = None

    def reserve(self, tokens: int) -> None:
        """Count `tokens` against the key's windows, or raise RateLimitExceeded."""
        self.reservation = self._control.reserve(self.caller, tokens)

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for its answer (none without limits)."""
        return self._control.headers(self.caller)

    def admitted(self, waited: float) -> None:
        self._control.admitted(self.caller, waited)

    def answered(self, usage: tuple[int, int] | None) -> None:
        """It ended with `usage` (prompt, completion), None when nothing says it (the
        reservation then stays counted in full)."""
        if not self._ended:
            self._ended = True
            self._control.answered(self.caller, self.reservation, usage)

    def refused(self, error: RequestError) -> None:
        """It was refused before anything was relayed: its reservation is given back."""
        if not self._ended:
            self._ended = True
            self._control.refused(self.caller, error, self.reservation)

    def left(self) -> None:
        """Its client left before its turn: its reservation is given back, unbooked."""
        if not self._ended:
            self._ended = True
            if self.reservation is not None:
                self._control.limiter.settle(self.reservation, 0)


def key_band(record: KeyRecord) -> Band:
    """The band a key's requests wait in, by its priority."""
    return _BANDS[record.priority]


def requested_band(headers: list[tuple[bytes, bytes]]) -> Band | None:
    """The band a request asks for in its `x-priority` header (interactive, normal or
    batch); None without one or for a value that names no band."""
    for name, value in headers:
        if name == BAND_HEADER:
            try:
                return _BANDS[Priority(value.decode("latin-1").strip().lower())]
            except ValueError:
                return None
    return None
