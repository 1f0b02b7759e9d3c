"""Tokens per minute and tokens per day for each named key.

A request is counted when it is admitted, for what it reserves (prompt tokens plus its
output budget: `reserve`), and settled from the engine's `usage` when it ends (`settle`
gives back what it reserved and did not use, or charges what it used beyond).  A request
that does not fit is refused with `RateLimitExceeded` (429, code `rate_limit_exceeded`):
its message names the limit (the key's rate or the key's budget) and when that key's
window frees enough room for it; its `retry_after` and headers say the same to programs.

**The two windows are different on purpose.**

* Tokens per minute is a *rate*, kept as a token bucket (the continuous-refill form,
  as GCRA): the bucket holds up to one minute's tokens and refills at limit/60 per second.
  A key may burst up to a minute's worth, then goes at the steady rate; a refused
  request's wait has an exact closed form (missing tokens / refill rate), which is
  usually a second or two rather than "the rest of the minute" as with a sliding window;
  the state is two numbers per key; a refund is an addition; and it is what OpenAI's
  headers describe (remaining = what the bucket holds, reset = time until it is full).
* Tokens per day is a *budget*, kept as a sliding 24-hour window over one-minute
  buckets: the key never gets more than its limit in any 24 hours.  A bucket would let
  through up to twice the limit in a day (a full bucket, then a day's refill), which is
  fine for a rate but breaks the promise a budget makes.  Tokens counted in a minute free
  up at the end of that minute plus 24 hours (so at most one minute late, never early);
  a key holds at most 1,441 buckets.

Only the windows a key has are kept: a key without limits costs nothing here.  A limit
changed on a key applies at once (the limits are passed with every call); a limit added
to a key that had none starts from an empty window.  After a restart the usage ledger's
per-minute series can refill the day windows (`preload`), so restarting the port does
not hand every key a fresh day.

The SDKs: OpenAI's Python and Node SDKs retry a 429 after `retry-after-ms` (exact), else
`retry-after` (seconds), when that is more than 0 and at most 120 s; longer, they do not
retry at all, which is right for a spent day's budget.  Codex reads the wait from the
message ("Please try again in 6.5s") when the code is `rate_limit_exceeded`; the
message says it in that form only for waits an SDK would honour (<= 120 s), so no agent
sleeps for hours inside one retry.  OpenAI's `x-ratelimit-limit-tokens`,
`-remaining-tokens` (whole tokens) and `-reset-tokens` (a Go duration such as "6m0s",
"1.5s" or "20ms": the time until the window is whole again) come with every refusal and
from `headers` for successful answers; of two windows they describe the one with less
room left.  Requests per minute are not limited, so there are no `-requests` headers.

Pure: no I/O, no sleeping; the clock is injectable (seconds since the epoch by default,
so that the ledger's minutes line up with the day windows).  Everything runs on the
backend's one event loop, so nothing takes a lock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from backend.errors import RateLimitExceeded
from backend.keys.key_store import KeyRecord

__all__ = [
    "DAY",
    "MAX_HONOURED_RETRY",
    "RateLimiter",
    "Reservation",
    "TokenLimits",
    "go_duration",
]

Clock = Callable[[], float]

MINUTE = 60.0
DAY = 86_400.0
#: The longest Retry-After the OpenAI SDKs wait for (openai._constants.MAX_RETRY_AFTER_DELAY).
MAX_HONOURED_RETRY = 120.0
# A request retried exactly when its wait said must fit, though the clock (seconds since
# the epoch, a float good to about 0.24 us) rounds: a wait this short counts as none.
_CLOCK_SLACK = 1e-6
# The same for whole tokens shown as remaining.
_EPSILON = 1e-6

PER_MINUTE = "tokens_per_minute"
PER_DAY = "tokens_per_day"


@dataclass(frozen=True)
class TokenLimits:
    """A key's token limits; None is no limit."""

    per_minute: int | None = None
    per_day: int | None = None

    @classmethod
    def of(cls, record: KeyRecord) -> "TokenLimits":
        return cls(record.tokens_per_minute, record.tokens_per_day)

    @property
    def unlimited(self) -> bool:
        return self.per_minute is None and self.per_day is None


@dataclass(eq=False)
class Reservation:
    """What one admitted request counts against its key until it is settled."""

    key: str
    tokens: int
    #: Whether the minute's bucket was charged; the day's bucket charged, if any.
    in_minute: bool
    day_bucket: int | None
    settled: bool = False


class RateLimiter:
    """The minute and day windows of every key that has limits."""

    def __init__(self, clock: Clock = time.time) -> None:
        self._clock = clock
        self._keys: dict[str, _Windows] = {}

    def reserve(self, key: str, limits: TokenLimits, tokens: int) -> Reservation:
        """Count `tokens` against `key` now, or raise RateLimitExceeded saying which
        limit and when it frees room (never when the request is larger than the limit)."""
        if limits.unlimited:
            return Reservation(key, tokens, in_minute=False, day_bucket=None)
        now = self._clock()
        windows = self._keys.get(key)
        if windows is None:
            windows = self._keys[key] = _Windows()
        refusals = []
        if limits.per_minute is not None:
            windows.refill(now, limits.per_minute)
            refusals.append(windows.minute_refusal(key, limits.per_minute, tokens, now))
        else:
            windows.deficit = 0.0
        if limits.per_day is not None:
            windows.expire(now)
            refusals.append(windows.day_refusal(key, limits.per_day, tokens, now))
        found = [r for r in refusals if r is not None]
        if found:
            # A request must fit both windows: it may go when the later one lets it.
            raise max(found, key=lambda r: math.inf if r.retry_after is None else r.retry_after)
        if limits.per_minute is not None:
            windows.deficit += tokens
        day_bucket = windows.charge_day(now, tokens) if limits.per_day is not None else None
        return Reservation(key, tokens, in_minute=limits.per_minute is not None,
                           day_bucket=day_bucket)

    def settle(self, reservation: Reservation, used: int) -> None:
        """The request used `used` tokens in all (the engine's prompt plus completion
        tokens; 0 if it never ran): the difference goes back to, or is taken from, the
        windows it was counted in.  Only the first call counts."""
        if reservation.settled:
            return
        reservation.settled = True
        windows = self._keys.get(reservation.key)
        if windows is None:
            return
        now = self._clock()
        change = used - reservation.tokens
        if reservation.in_minute:
            windows.refill(now, windows.per_minute)
            windows.deficit = max(0.0, windows.deficit + change)
        if reservation.day_bucket is not None:
            windows.expire(now)
            windows.settle_day(reservation.day_bucket, change, now)

    def headers(self, key: str, limits: TokenLimits) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*-tokens` for an answer to `key` (none without limits)."""
        if limits.unlimited:
            return {}
        now = self._clock()
        windows = self._keys.get(key) or _Windows()
        views = []
        if limits.per_minute is not None:
            windows.refill(now, limits.per_minute)
            views.append(windows.minute_view(limits.per_minute))
        if limits.per_day is not None:
            windows.expire(now)
            views.append(windows.day_view(limits.per_day, now))
        return _headers(*min(views, key=lambda v: v[1]))

    def preload(self, key: str, used: Iterable[tuple[float, int]]) -> None:
        """Tokens `key` already used (start of a minute in epoch seconds, tokens), e.g.
        from the usage ledger after a restart, so that its day window is not empty."""
        windows = self._keys.get(key)
        if windows is None:
            windows = self._keys[key] = _Windows()
        for start, tokens in sorted(used):
            if tokens > 0:
                windows.charge_day(start, tokens)
        windows.expire(self._clock())

    def forget(self, key: str) -> None:
        """Drop a key's windows (a key deleted; its limits gone)."""
        self._keys.pop(key, None)


def go_duration(seconds: float) -> str:
    """A wait as OpenAI writes `x-ratelimit-reset-*` (Go's time.Duration text: "20ms",
    "1.5s", "6m0s", "1h2m3s"), rounded up to the millisecond so that a client waiting
    exactly that long finds the room there."""
    ms = math.ceil(seconds * 1000 - 1e-6) if seconds > 0 else 0
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{hours}h" if hours else ""
    if hours or minutes:
        text += f"{minutes}m"
    return text + _seconds(rest) + "s"


# --- one key's windows -------------------------------------------------------------------


class _Windows:
    """A key's token bucket (as the tokens it lacks) and its day's minute buckets."""

    def __init__(self) -> None:
        self.deficit = 0.0        # tokens taken from the minute's bucket, not yet refilled
        self.refilled_at = -math.inf
        self.per_minute = 0
        self.day: deque[list[int]] = deque()   # [minute number, tokens], oldest first
        self.day_total = 0

    # the minute: a token bucket

    def refill(self, now: float, per_minute: int) -> None:
        if self.per_minute and now > self.refilled_at:
            self.deficit = max(0.0, self.deficit - (now - self.refilled_at) * self.per_minute / MINUTE)
        self.refilled_at = max(self.refilled_at, now)
        self.per_minute = per_minute

    def minute_refusal(self, key: str, limit: int, tokens: int,
                       now: float) -> RateLimitExceeded | None:
        if tokens > limit:
            return _too_large(key, PER_MINUTE, limit, tokens, self.minute_view(limit))
        wait = (self.deficit + tokens - limit) * MINUTE / limit
        if wait <= _CLOCK_SLACK:
            return None
        used = round(self.deficit)
        return _refusal(key, PER_MINUTE, wait, self.minute_view(limit),
                        f"Rate limit reached for key {key!r} on tokens per minute: limit "
                        f"{limit:,}, used {used:,}, requested {tokens:,}.")

    def minute_view(self, limit: int) -> tuple[int, int, float]:
        """(limit, remaining, seconds until the bucket is full)."""
        return limit, max(0, math.floor(limit - self.deficit + _EPSILON)), \
            self.deficit * MINUTE / limit

    # the day: a sliding window of minute buckets

    def expire(self, now: float) -> None:
        while self.day and _freed_at(self.day[0][0]) <= now:
            self.day_total -= self.day.popleft()[1]

    def charge_day(self, now: float, tokens: int) -> int:
        minute = math.floor(now / MINUTE)
        if self.day and self.day[-1][0] >= minute:
            # This minute's bucket (or, the clock having gone back, the newest one).
            self.day[-1][1] += tokens
            minute = self.day[-1][0]
        else:
            self.day.append([minute, tokens])
        self.day_total += tokens
        return minute

    def settle_day(self, minute: int, change: int, now: float) -> None:
        if change > 0:  # used beyond the reservation: counted now
            self.charge_day(now, change)
            return
        for bucket in reversed(self.day):
            if bucket[0] == minute:
                back = min(-change, bucket[1])
                bucket[1] -= back
                self.day_total -= back
                return
            if bucket[0] < minute:
                return  # already out of the window

    def day_refusal(self, key: str, limit: int, tokens: int,
                    now: float) -> RateLimitExceeded | None:
        if tokens > limit:
            return _too_large(key, PER_DAY, limit, tokens, self.day_view(limit, now))
        excess = self.day_total + tokens - limit
        if excess <= 0:
            return None
        freed, wait = 0, DAY + MINUTE
        for minute, counted in self.day:
            freed += counted
            if freed >= excess:
                wait = _freed_at(minute) - now
                break
        return _refusal(key, PER_DAY, wait, self.day_view(limit, now),
                        f"Daily token budget reached for key {key!r}: limit {limit:,} tokens "
                        f"per day, used {self.day_total:,} in the last 24 hours, requested "
                        f"{tokens:,}.")

    def day_view(self, limit: int, now: float) -> tuple[int, int, float]:
        reset = _freed_at(self.day[-1][0]) - now if self.day_total > 0 and self.day else 0.0
        return limit, max(0, limit - self.day_total), reset


def _freed_at(minute: int) -> float:
    """When tokens counted in `minute` leave the day window."""
    return (minute + 1) * MINUTE + DAY


# --- refusals ------------------------------------------------------------------------------


def _refusal(key: str, reason: str, wait: float, view: tuple[int, int, float],
             text: str) -> RateLimitExceeded:
    if wait <= MAX_HONOURED_RETRY:
        when = f" Please try again in {_seconds(math.ceil(wait * 1000 - 1e-6))}s."
    else:
        when = f" The key's tokens free up again in {_about(wait)}."
    headers = _headers(*view)
    headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000 - 1e-6)))
    return RateLimitExceeded(text + when, reason=reason, retry_after=wait, headers=headers)


def _too_large(key: str, reason: str, limit: int, tokens: int,
               view: tuple[int, int, float]) -> RateLimitExceeded:
    per = "a minute" if reason == PER_MINUTE else "a day"
    headers = _headers(*view)
    headers["x-should-retry"] = "false"  # the OpenAI SDKs obey it; a retry cannot pass
    return RateLimitExceeded(
        f"Request too large for key {key!r}: it needs {tokens:,} tokens (prompt plus "
        f"output budget), more than the key may use in {per} ({limit:,}). Lower max_tokens "
        "or shorten the prompt.", reason=reason, retry_after=None, headers=headers)


def _headers(limit: int, remaining: int, reset: float) -> dict[str, str]:
    return {"x-ratelimit-limit-tokens": str(limit),
            "x-ratelimit-remaining-tokens": str(remaining),
            "x-ratelimit-reset-tokens": go_duration(reset)}


def _seconds(ms: int) -> str:
    """Milliseconds as seconds without needless zeros: 6500 -> "6.5", 12000 -> "12",
    20 -> "0.02"."""
    whole, rest = divmod(ms, 1000)
    return f"{whole}" if not rest else f"{whole}.{rest:03d}".rstrip("0")


def _about(seconds: float) -> str:
    minutes = math.ceil(seconds / MINUTE)
    hours, minutes = divmod(minutes, 60)
    if not hours:
        return f"about {minutes} min"
    return f"about {hours} h {minutes} min" if minutes else f"about {hours} h"
